"""Apply a plan: re-evaluate the jaxpr with ``with_sharding_constraint`` on planned values.

The returned function is meant to be traced under ``jax.jit`` with the plan's input and output
shardings. It walks the jaxpr with ``_walk.Walker`` (the walk the planner's graph was built
with), binds every primitive, inlines calls, rebuilds loops with ``lax.scan`` /
``lax.while_loop`` / ``lax.switch`` so constraints can sit inside their bodies, and pins, by
``site`` (equation path and output position, stable across re-traces):

* the output of every planned node, followers included (dots, convs, gathers, reshapes,
  elementwise ops...),
* every loop carry at the start and the end of an iteration, and scanned slices,
* an operand whose required spec differs from its producer's (the planned resharding).

A pin whose site the program does not have, or whose spec does not fit the value there, means
the plan was made for another program: that is an error naming the site, never a silent skip.
Values computed from constants only (iota, masks) are left to XLA, which slices them locally.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.extend import core
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..ir._compat import bind_eqn, sharding_pinner
from ..ir._walk import REMATS, Walker, eqn_site, site
from .partial_run import PartialSums
from .plan import ShardingPlan


class PlanMismatch(ValueError):
    """A plan's pins do not fit the program it is applied to."""


class _Pins:
    def __init__(self, plan: ShardingPlan, mesh: Mesh):
        self.mesh = mesh
        self.values = {key: NamedSharding(mesh, spec) for key, spec in plan.intermediates}
        self.operands = {(key, p): NamedSharding(mesh, spec)
                         for key, p, spec in plan.operand_specs}
        self.used: set = set()
        self.pinned: dict[int, tuple] = {}
        """id of a pinned value -> (the value, its spec): which outputs leave the step split."""
        self.partial = PartialSums(plan.partial_sums + plan.reduce_scattered, mesh)
        """The plan's sums of partial sums (they spend their own pins)."""
        self._constrain = sharding_pinner()   # made inside the trace: its context mesh
        self._named: dict[tuple, NamedSharding] = {}

    def _pin(self, key, x, sharding, spec=None):
        if sharding is None:
            return x
        self.used.add(key)
        if not _shardable(x):
            return x
        spec = tuple(sharding.spec) if spec is None else spec
        if len(spec) > jax.numpy.ndim(x):
            raise PlanMismatch(
                f"the plan pins the value at site {key!r} with {PartitionSpec(*spec)}, but the "
                f"program has a rank-{jax.numpy.ndim(x)} value of shape "
                f"{jax.numpy.shape(x)} there: the plan was made for another program. Plan "
                "this step again (or check the plan's "
                "fingerprint before applying it).")
        named = self._named.get(spec)
        if named is None:
            named = self._named[spec] = NamedSharding(self.mesh, PartitionSpec(*spec))
        y = self._constrain(x, named)
        self.pinned[id(y)] = (y, spec)
        return y

    def value(self, key, x):
        return self._pin(key, x, self.values.get(key))

    def operand(self, path, p, x):
        key = (eqn_site(path), p)
        return self._pin(key, x, self.operands.get(key))

    def sliced(self, key, x, drop_leading: bool):
        """Pin a per-iteration slice with the spec of its stacked value (or the reverse)."""
        sharding = self.values.get(key)
        if sharding is None:
            return x
        spec = tuple(sharding.spec)
        return self._pin(key, x, sharding, spec[1:] if drop_leading else (None,) + spec)

    def check_all_used(self) -> None:
        if self.partial.missing():
            raise PlanMismatch(
                f"the plan reduces partial sums at sites this program does not have (e.g. "
                f"{', '.join(self.partial.missing()[:3])}): the plan was made for another "
                "program. Plan this step again (or check the plan's fingerprint before "
                "applying it).")
        missing = (set(self.values) | set(self.operands)) - self.used
        if missing:
            first = sorted(map(str, missing))[:3]
            raise PlanMismatch(
                f"{len(missing)} of the plan's pins name sites this program does not have "
                f"(e.g. {', '.join(first)}): the plan was made for another program. Plan this "
                "step again (or check the plan's fingerprint before applying it).")


def _shardable(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def apply_plan(closed_jaxpr: core.ClosedJaxpr, plan: ShardingPlan, mesh: Mesh) -> Callable:
    """``fn(*flat_args) -> list of flat outputs`` that follows ``plan`` on ``mesh``."""
    if tuple(mesh.shape.values()) != tuple(plan.mesh_shape) or tuple(mesh.axis_names) != tuple(
            plan.axis_names):
        raise ValueError(
            f"mesh {dict(mesh.shape)} does not match the plan's mesh "
            f"{dict(zip(plan.axis_names, plan.mesh_shape, strict=False))}; build it as "
            "Mesh(devices.reshape(plan.mesh_shape), plan.axis_names).")
    n_in = len(closed_jaxpr.jaxpr.invars)

    def fn(*args):
        if len(args) != n_in:
            raise TypeError(f"the planned function takes {n_in} flat arguments, got {len(args)}.")
        pins = _Pins(plan, mesh)
        outs = _Apply(pins).walk(closed_jaxpr.jaxpr, closed_jaxpr.consts, list(args))
        outs = [pins.partial.resolve(x) for x in outs]
        pins.check_all_used()
        return gather_outputs_once(outs, plan.out_specs, pins, mesh)

    return fn


def gather_outputs_once(outs: list, out_specs, pins: _Pins, mesh: Mesh) -> list:
    """``outs`` with the outputs the plan computes split and returns whole made whole by one
    all-gather per dtype and mesh axes, of a buffer holding every device's pieces of all of
    them (the updated parameters of a ZeRO-2 update).

    XLA:GPU's combiner merges such independent all-gathers; XLA:CPU does not, so without
    this each parameter had its own all-gather there. The bytes moved are the same.
    """
    groups: dict = {}
    for k, x in enumerate(outs):
        held = pins.pinned.get(id(x))
        if held is None or held[0] is not x or any(e is not None for e in tuple(out_specs[k])):
            continue
        split = [(d, e) for d, e in enumerate(held[1]) if e is not None]
        if len(split) != 1:
            continue
        d, entry = split[0]
        axes = tuple(entry) if isinstance(entry, tuple | list) else (entry,)
        groups.setdefault((jax.numpy.dtype(x.dtype), axes), []).append((k, d))
    constrain, whole = lax.with_sharding_constraint, NamedSharding(mesh, PartitionSpec())
    outs = list(outs)
    for (_, axes), members in groups.items():
        if len(members) < 2:
            continue
        n = 1
        for a in axes:
            n *= mesh.shape[a]
        rows = NamedSharding(mesh, PartitionSpec(axes if len(axes) > 1 else axes[0]))
        moved, pieces = [], []
        for k, d in members:  # the split dim first: device i holds row i of (n, size / n)
            x = constrain(jax.numpy.moveaxis(outs[k], d, 0), rows)
            moved.append(x.shape)
            pieces.append(constrain(x.reshape(n, -1), rows))
        buf = constrain(constrain(jax.numpy.concatenate(pieces, axis=1), rows), whole)
        at = 0
        for (k, d), shape, piece in zip(members, moved, pieces, strict=True):
            width = piece.shape[1]
            outs[k] = jax.numpy.moveaxis(buf[:, at:at + width].reshape(shape), 0, d)
            at += width
    return outs


class PlanEvaluator:
    """A planned program evaluated in pieces, every piece pinned as ``apply_plan`` pins it.

    Gradient accumulation runs one micro-batch's step in three parts (the equations before the
    gradient marker that do not read the batch, the loop body over micro-batches, the update
    after the marker); each part runs its top-level equations by their index in the whole
    program, so every site keeps the key the plan pinned it by. ``finish`` checks, as
    ``apply_plan`` does, that every pin was used.
    """

    def __init__(self, plan: ShardingPlan, mesh: Mesh):
        self.pins = _Pins(plan, mesh)
        self._apply = _Apply(self.pins)
        self._in_specs = plan.in_specs
        self._out_specs = plan.out_specs

    def run(self, jaxpr, indices, env: dict, key_hook: Callable | None = None) -> None:
        """Evaluate ``jaxpr.eqns[i]`` for ``i`` in ``indices`` on ``env`` (var -> value).

        ``key_hook(eqn, ins) -> ins`` may replace the operands of any equation at any depth
        (gradient accumulation folds the micro-batch index into random keys)."""
        self._apply.key_hook = key_hook
        try:
            self._apply.run_eqns([jaxpr.eqns[i] for i in indices], env, (), list(indices))
        finally:
            self._apply.key_hook = None
        for var, x in env.items():  # the parts run in different traces: nothing stays pending
            env[var] = self.pins.partial.resolve(x)

    def mark_used(self, jaxpr, indices) -> None:
        """Count the pins of ``jaxpr.eqns[i]`` (and everything inside them) as used: that part
        runs under another evaluator that places its values itself."""
        heads = {str(i) for i in indices}
        for key in list(self.pins.values) + list(self.pins.operands):
            name = key if isinstance(key, str) else key[0]
            if name.split(":")[0].split("/")[0] in heads:
                self.pins.used.add(key)
        self.pins.partial.mark_seen(heads)

    def pin(self, key: str, x):
        """``x`` with the plan's spec of the value at site ``key``."""
        return self.pins.value(key, x)

    def pin_input(self, n: int, x, stacked: bool = False):
        """``x`` with the plan's spec of flat input ``n`` (``stacked``: several values of that
        input along a new leading dim, e.g. every micro-batch of a batch input)."""
        spec = tuple(self._in_specs[n])
        return lax.with_sharding_constraint(x, NamedSharding(
            self.pins.mesh, PartitionSpec(*(((None,) + spec) if stacked else spec))))

    def finish(self, outs: list) -> list:
        """``outs`` (the step's flat outputs), after checking as ``apply_plan`` does that
        every pin was used, with the outputs computed split and returned whole gathered in
        one buffer as ``apply_plan`` gathers them (``gather_outputs_once``)."""
        self.pins.check_all_used()
        outs = [self.pins.partial.resolve(x) for x in outs]
        return gather_outputs_once(outs, self._out_specs, self.pins, self.pins.mesh)


class _Apply(Walker):
    """Evaluates the program under tracing, pinning the plan's values by site.

    A reduce-scattered partial sum is held ``Pending`` until an equation reads one
    (``PartialSums.resolve``); loops and rematerialised calls trace their bodies as functions
    of their own, so every pending sum is reduced before them."""

    def __init__(self, pins: _Pins):
        self.pins = pins
        self.key_hook: Callable | None = None

    def equation(self, eqn, ins, path):
        pins = self.pins
        ins = [pins.partial.resolve(x) for x in ins]
        if pins.partial.handles(path):  # a term, layout op or sum of a partial sum
            pins.used.update(pins.partial.pin_keys(eqn, path))
            return pins.partial.run(eqn, ins, path)
        ins = [pins.operand(path, p, x) for p, x in enumerate(ins)]
        if self.key_hook is not None:
            ins = self.key_hook(eqn, ins)
        if eqn.primitive.name == "sharding_constraint":  # the user's pin, kept as the plan's
            return [pins.value(site(path, j), x) for j, x in enumerate(ins)]
        outs = bind_eqn(eqn, ins)
        return [pins.value(site(path, j), o) for j, o in enumerate(outs)]

    def call(self, eqn, ins, path):
        if eqn.primitive.name not in REMATS:
            return super().call(eqn, ins, path)
        parent, partial = super(), self.pins.partial
        partial.flush()
        ins = [partial.resolve(x) for x in ins]

        def body(*xs):
            return [partial.resolve(x) for x in parent.call(eqn, list(xs), path)]

        return list(jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True),
                                   policy=eqn.params.get("policy"))(*ins))

    def loop(self, eqn, ins, path):
        self.pins.partial.flush()
        ins = [self.pins.partial.resolve(x) for x in ins]
        return {"scan": self._scan, "while": self._while, "cond": self._cond}[
            eqn.primitive.name](eqn, ins, path)

    def _scan(self, eqn, ins, path):
        pins, p = self.pins, eqn.params
        nc, ncar = p["num_consts"], p["num_carry"]
        body = p["jaxpr"]
        consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
        carry_keys = [site(path, j) for j in range(ncar)]
        slice_keys = [site(path, f"xs{j}") for j in range(len(xs))]
        ys_keys = [site(path, ncar + j) for j in range(len(eqn.outvars) - ncar)]
        init = [pins.value(k, x) for k, x in zip(carry_keys, init, strict=True)]
        xs = [pins.sliced(k, x, drop_leading=False) for k, x in zip(slice_keys, xs, strict=True)]

        def step(carry, x):
            carry = [pins.value(k, c) for k, c in zip(carry_keys, carry, strict=True)]
            x = [pins.value(k, xi) for k, xi in zip(slice_keys, x, strict=True)]
            outs = self.walk(body.jaxpr, body.consts, list(consts) + carry + x, path)
            new = [pins.value(k, c) for k, c in zip(carry_keys, outs[:ncar], strict=True)]
            ys = [pins.sliced(k, y, drop_leading=True)
                  for k, y in zip(ys_keys, outs[ncar:], strict=True)]
            return new, ys

        carry, ys = lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])
        ys = [pins.value(k, y) for k, y in zip(ys_keys, ys, strict=True)]
        return list(carry) + list(ys)

    def _while(self, eqn, ins, path):
        pins, p = self.pins, eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        keys = [site(path, j) for j in range(len(init))]
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        init = [pins.value(k, x) for k, x in zip(keys, init, strict=True)]

        def cond_fun(carry):
            return self.walk(cj.jaxpr, cj.consts, list(cconsts) + list(carry), path + (0,))[0]

        def body_fun(carry):
            carry = [pins.value(k, c) for k, c in zip(keys, carry, strict=True)]
            outs = self.walk(bj.jaxpr, bj.consts, list(bconsts) + carry, path + (1,))
            return [pins.value(k, c) for k, c in zip(keys, outs, strict=True)]

        return list(lax.while_loop(cond_fun, body_fun, init))

    def _cond(self, eqn, ins, path):
        keys = [site(path, j) for j in range(len(eqn.outvars))]

        def branch_fn(b, br):
            def run(*ops):
                outs = self.walk(br.jaxpr, br.consts, list(ops), path + (b,))
                return [self.pins.value(k, o) for k, o in zip(keys, outs, strict=True)]
            return run

        branches = [branch_fn(b, br) for b, br in enumerate(eqn.params["branches"])]
        return list(lax.switch(ins[0], branches, *ins[1:]))
