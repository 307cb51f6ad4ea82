"""One walk over a jaxpr for everything that interprets a program equation by equation.

The planner's graph builder (``sharding.graph``), the plan's application (``sharding.apply``),
plain re-evaluation (``_jaxpr.Env``) and the per-device evaluation of gradient accumulation
(``_local``) all read a jaxpr the same way: literals and constants, one equation after the
other, calls inlined, identities forwarded, loops handled as a whole. ``Walker`` holds that
walk once; an interpreter overrides the hooks whose meaning differs (what a value is, what an
equation does, how a loop is rebuilt).

Every equation has a **path**: the tuple of equation indices from the top-level jaxpr down
through inlined calls and loop bodies (a ``while`` adds 0 for its condition and 1 for its
body, a ``cond`` the branch index). The path depends only on the program's structure, so it is
the same on every trace of the same step: plans key their pins on it (``site``).
"""

from __future__ import annotations

from typing import Any

from jax.extend import core

from . import _compat

INLINE_CALLS = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
    "remat": "jaxpr", "custom_vmap_call": "call",
}
"""Call primitives whose body is walked in place, and the parameter that holds the body."""
REMATS = ("remat2", "checkpoint", "remat")
IDENTITIES = {"pipeline_marker", "optimization_barrier", "device_put", "mesh_cast", "reshard"}
"""Forwarded as their operands by interpreters that place values themselves. A user's
``sharding_constraint`` is not among them: the planner keeps it as a pin."""
LOOPS = ("scan", "while", "cond")


def eqn_site(path: tuple[int, ...]) -> str:
    """An equation's key that survives a re-trace: its path, e.g. ``"12/3"``."""
    return "/".join(map(str, path))


def site(path: tuple[int, ...], output: int | str) -> str:
    """A value's key that survives a re-trace: its equation's path and its output position
    (``xs<j>`` for the j-th per-iteration slice of a scan), e.g. ``"12/3:0"``."""
    return f"{eqn_site(path)}:{output}"


def body_of(eqn) -> tuple[Any, tuple]:
    """(jaxpr, consts) of an inlined call."""
    sub = eqn.params[INLINE_CALLS[eqn.primitive.name]]
    return (sub.jaxpr, sub.consts) if isinstance(sub, core.ClosedJaxpr) else (sub, ())


def sub_jaxprs(eqn) -> list:
    """Every jaxpr held by ``eqn``'s parameters, open: call bodies, loop bodies and conditions,
    cond branches, custom_jvp/vjp bodies, shard_map bodies. The one way passes find them."""
    found = []
    for param in eqn.params.values():
        for sub in param if isinstance(param, tuple | list) else (param,):
            jaxpr = sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub
            if isinstance(jaxpr, core.Jaxpr):
                found.append(jaxpr)
    return found


def all_eqns(jaxpr):
    """The equations of ``jaxpr`` and, after each, those inside it, at any depth."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from all_eqns(sub)


def any_eqn(jaxpr, predicate) -> bool:
    """Whether some equation of ``jaxpr``, at any depth, satisfies ``predicate``."""
    return any(predicate(eqn) for eqn in all_eqns(jaxpr))


class Walker:
    """A walk over a jaxpr; override the hooks.

    Defaults evaluate: literals are their values, calls are inlined, identities forward,
    everything else (loops included) is left to ``equation``.
    """

    inline_calls = True
    """Walk call bodies in place (False: a call is one ``equation``)."""
    forward_identities = True
    """Forward identities' operands (False: an identity is one ``equation``)."""

    def literal(self, lit):
        return lit.val

    def constant(self, var, value, path: tuple):
        return value

    def equation(self, eqn, ins: list, path: tuple) -> list:
        raise NotImplementedError

    def call(self, eqn, ins: list, path: tuple) -> list:
        jaxpr, consts = body_of(eqn)
        return self.walk(jaxpr, consts, ins, path)

    def identity(self, eqn, ins: list, path: tuple) -> list:
        return list(ins[: len(eqn.outvars)])

    def loop(self, eqn, ins: list, path: tuple) -> list:
        return self.equation(eqn, ins, path)

    # The walk ----------------------------------------------------------------------------------
    def walk(self, jaxpr, consts, args, path: tuple = ()) -> list:
        """Outputs of ``jaxpr`` on ``args`` (interpreted values) under ``path``."""
        env: dict = {}
        for var, value in zip(jaxpr.constvars, consts, strict=False):
            env[var] = self.constant(var, value, path)
        assert len(jaxpr.invars) == len(args), (len(jaxpr.invars), len(args))
        for var, a in zip(jaxpr.invars, args, strict=True):
            env[var] = a
        self.run_eqns(jaxpr.eqns, env, path)
        return [self.lookup(env, a) for a in jaxpr.outvars]

    def lookup(self, env: dict, atom):
        return self.literal(atom) if isinstance(atom, _compat.Literal) else env[atom]

    def run_eqns(self, eqns, env: dict, path: tuple = (), indices=None) -> None:
        """Interpret ``eqns`` in order, reading and writing ``env`` (jaxpr var -> value).

        ``indices``: each equation's index in its jaxpr when ``eqns`` is a part of it (so its
        path, and the plan's pins keyed on it, are those of the whole program)."""
        for i, eqn in zip(range(len(eqns)) if indices is None else indices, eqns, strict=True):
            key = path + (i,)
            ins = [self.lookup(env, a) for a in eqn.invars]
            name = eqn.primitive.name
            if name in INLINE_CALLS and self.inline_calls:
                outs = self.call(eqn, ins, key)
            elif name in IDENTITIES and self.forward_identities:
                outs = self.identity(eqn, ins, key)
            elif name in LOOPS:
                outs = self.loop(eqn, ins, key)
            else:
                outs = self.equation(eqn, ins, key)
            for var, out in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, _compat.DropVar):
                    env[var] = out


__all__ = ["IDENTITIES", "INLINE_CALLS", "LOOPS", "REMATS", "Walker", "all_eqns", "any_eqn",
           "body_of", "eqn_site", "site", "sub_jaxprs"]
