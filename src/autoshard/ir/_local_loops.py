"""Per-device rules of ``_local.LocalEval`` for loops: ``scan`` (over time steps, or over the
rows themselves as an accumulation), ``while`` and ``cond``, whose bodies run on each device's
rows, with the fixpoint that finds the kinds a loop's carries keep."""

from __future__ import annotations

import jax
from jax import lax

from ._compat import Literal, Var
from ._local_kinds import P, R, is_split, split


class LoopRules:
    """Rules mixed into ``LocalEval``: each returns (output(s), kind(s)) or None."""

    def _scan(self, e, ins, ks):
        """A scan over a dim other than the rows (time steps of an RNN): the body runs on each
        device's rows."""
        p = e.params
        nc, ncar = p["num_consts"], p["num_carry"]
        consts, init, xs = list(ins[:nc]), ins[nc:nc + ncar], list(ins[nc + ncar:])
        const_kinds, init_kinds, xs_kinds = list(ks[:nc]), ks[nc:nc + ncar], ks[nc + ncar:]
        if split(0) in xs_kinds:
            return self._scan_rows(e, ins, ks)
        x_kinds = [split(k[1] - 1) if is_split(k) else k for k in xs_kinds]

        def run(carry, carry_kinds, x, gathered):
            return self._run_body(p["jaxpr"], consts + list(carry) + list(x),
                                  const_kinds + carry_kinds + x_kinds, gathered)
        x_avals = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs]
        carry_kinds = self._stable_carries(
            init, init_kinds, lambda c, kinds, x: run(c, kinds, x, set())[:ncar], x_avals)
        if carry_kinds is None:
            return None
        gathered, ys_kinds = set(), []

        def step(carry, x):
            outs = run(carry, carry_kinds, x, gathered)
            ys_kinds[:] = [k for _, k in outs[ncar:]]
            return ([self.to_kind(v, k, c) for (v, k), c in zip(
                outs[:ncar], carry_kinds, strict=True)], [v for v, _ in outs[ncar:]])
        carry, ys = lax.scan(step, self._converted(init, init_kinds, carry_kinds), xs,
                             length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        self.gathered |= gathered
        out_kinds = carry_kinds + [split(k[1] + 1) if is_split(k) else k for k in ys_kinds]
        return list(carry) + list(ys), out_kinds

    def _while(self, e, ins, ks):
        """A while loop whose condition reads no rows: the body runs on each device's rows."""
        p = e.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, init = list(ins[:cn]), list(ins[cn:cn + bn]), ins[cn + bn:]
        cond_kinds, body_kinds, init_kinds = list(ks[:cn]), list(ks[cn:cn + bn]), ks[cn + bn:]

        def run(carry, carry_kinds, gathered):
            return self._run_body(p["body_jaxpr"], body_consts + list(carry),
                                  body_kinds + carry_kinds, gathered)

        def test(carry, carry_kinds, gathered):
            return self._run_body(p["cond_jaxpr"], cond_consts + list(carry),
                                  cond_kinds + carry_kinds, gathered)[0]
        carry_kinds = self._stable_carries(init, init_kinds,
                                           lambda c, kinds, _: run(c, kinds, set()))
        if carry_kinds is None:
            return None
        verdict = []
        jax.eval_shape(lambda c: verdict.append(test(self._converted(
            c, init_kinds, carry_kinds), carry_kinds, set())[1]), list(init))
        if verdict != [R]:
            return None  # the condition depends on the rows
        gathered: set[str] = set()

        def body(carry):
            return [self.to_kind(v, k, c) for (v, k), c in zip(
                run(carry, carry_kinds, gathered), carry_kinds, strict=True)]
        out = lax.while_loop(lambda c: test(c, carry_kinds, gathered)[0], body,
                             self._converted(init, init_kinds, carry_kinds))
        self.gathered |= gathered
        return list(out), carry_kinds

    def _cond(self, e, ins, ks):
        """Branches chosen by a whole index: each runs on each device's rows."""
        if ks[0] != R:
            return None
        branches, ops, op_kinds = e.params["branches"], list(ins[1:]), list(ks[1:])
        kinds = None
        for branch in branches:
            found = []
            jax.eval_shape(lambda *a, branch=branch, found=found: found.extend(
                k for _, k in self._run_body(branch, list(a), op_kinds, set())), *ops)
            kinds = found if kinds is None else [_join(a, b) for a, b in zip(
                kinds, found, strict=True)]
        if None in kinds:
            return None
        gathered: set[str] = set()
        fns = [lambda *a, branch=branch: [self.to_kind(v, k, t) for (v, k), t in zip(
            self._run_body(branch, list(a), op_kinds, gathered), kinds, strict=True)]
            for branch in branches]
        outs = lax.switch(ins[0], fns, *ops)
        self.gathered |= gathered
        return list(outs), kinds

    def _stable_carries(self, init, init_kinds, natural, extra_avals=()):
        """Kinds of loop carries that the body keeps: each starts as its initial value's and
        moves to what the body returns when that costs nothing (whole -> split or partial);
        None when a carry would need communication every iteration. ``natural(carry,
        carry_kinds, extra)`` evaluates the body on abstract values."""
        kinds = list(init_kinds)
        for _ in range(len(kinds) + 2):  # each round moves a carry away from R
            returned = []

            def probe(init, extra, kinds=kinds, returned=returned):
                outs = natural(self._converted(init, init_kinds, kinds), kinds, extra)
                returned[:] = [k for _, k in outs]
            jax.eval_shape(probe, list(init), list(extra_avals))
            joined = [_join(c, r) for c, r in zip(kinds, returned, strict=True)]
            if None in joined or joined == kinds:
                return None if None in joined else kinds
            kinds = joined
        return None

    def _converted(self, values, kinds, targets):
        return [self.to_kind(v, k, t) for v, k, t in zip(values, kinds, targets, strict=True)]

    def _scan_rows(self, e, ins, ks):
        """A scan over the rows themselves: ``lax.map`` over the batch, and its transpose, which
        adds a term per row into carries. Each device runs its own rows; a carry holds the
        sum of its rows' terms (partial; the first device also starts from the initial
        value). Every other operand must be whole."""
        p = e.params
        nc, ncar = p["num_consts"], p["num_carry"]
        xs, xs_kinds = ins[nc + ncar:], ks[nc + ncar:]
        if any(k != R for k in ks[:nc + ncar]) or any(k not in (R, split(0)) for k in xs_kinds) or (
                not _accumulators(p["jaxpr"].jaxpr, nc, ncar)):
            return None
        xs = [self.to_split(x, k, 0) for x, k in zip(xs, xs_kinds, strict=True)]
        consts, init = list(ins[:nc]), [self.to_p(x, R) for x in ins[nc:nc + ncar]]
        whole = [R] * len(ins)  # inside, one row of this device: plain evaluation

        def step(carry, x):
            outs = self._run_body(p["jaxpr"], consts + list(carry) + list(x), whole,
                                  self.gathered)
            return [v for v, _ in outs[:ncar]], [v for v, _ in outs[ncar:]]
        carry, ys = lax.scan(step, init, xs, length=xs[0].shape[0], reverse=p["reverse"],
                             unroll=p["unroll"])
        return list(carry) + list(ys), [P] * ncar + [split(0)] * len(ys)

    def _run_body(self, closed, values, kinds, gathered: set):
        """(value, kind) of the outputs of a loop body run by a child evaluator."""
        sub = self.child()
        jaxpr = closed.jaxpr
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, values, strict=True))
        kind_of = dict(zip(jaxpr.invars, kinds, strict=True))
        sub.run(jaxpr.eqns, env, kind_of)
        gathered |= sub.gathered
        return [(v.val, R) if isinstance(v, Literal) else (env[v], kind_of.get(v, R))
                for v in jaxpr.outvars]


def _join(carried, returned):
    """The kind a loop carry keeps when the body returns ``returned`` for ``carried`` (or two
    branches' outputs share): a whole value gives way (slicing or zeroing it is free), two
    different splits or a split and a partial cannot be kept without communication (None)."""
    if carried == returned or returned == R:
        return carried
    if carried == R:
        return returned
    return None


def _accumulators(jaxpr, num_consts: int, num_carry: int) -> bool:
    """Whether every carry of a scan body only has terms added to it (``c + f(x, consts)``)."""
    carries = jaxpr.invars[num_consts:num_consts + num_carry]
    tainted = set(carries)
    sums = {}
    for e in jaxpr.eqns:
        reads = [v for v in e.invars if isinstance(v, Var) and v in tainted]
        if not reads:
            continue
        if e.primitive.name not in ("add", "add_any") or len(reads) != 1 or (
                reads[0] not in carries):
            return False
        sums[e.outvars[0]] = reads[0]
        tainted.add(e.outvars[0])
    return [sums.get(v) for v in jaxpr.outvars[:num_carry]] == list(carries) and not any(
        v in tainted for v in jaxpr.outvars[num_carry:])
