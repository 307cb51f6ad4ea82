"""The pipeline-marker primitive: an identity that tags values for the planner and the runtime.

Mark types: ``start``/``end`` delimit a pipeline layer, ``jvp_start``/``jvp_end`` are their
tangent copies, ``boundary`` cuts layers, ``grad`` tags gradients (and values computed with
them) for gradient accumulation, with one declared reduction per value (``mean`` or ``sum``
over micro-batches), ``params`` tags the values ``autoshard.grad`` differentiates (the model
parameters, found by structure), ``hook`` is a user tap. In HLO a marker is nothing at all.

``pipeline_p.bind(*values, name=..., mark_type=...)`` (Alpa's form, without ``reductions``)
works as well: every parameter after ``mark_type`` has a default.
"""

from __future__ import annotations

from typing import Any, Literal

import jax

from . import _compat

MarkType = Literal["start", "end", "jvp_start", "jvp_end", "boundary", "grad", "params", "hook"]
MARK_TYPES = ("start", "end", "jvp_start", "jvp_end", "boundary", "grad", "params", "hook")
Reduction = Literal["mean", "sum", "auto"]
REDUCTIONS = ("mean", "sum", "auto")
"""``auto``: decided from the traced program (``combine.resolve``) before anything runs."""

# The primitive ---------------------------------------------------------------------------------
pipeline_p = _compat.Primitive("pipeline_marker")
pipeline_p.multiple_results = True


# User-facing functions -------------------------------------------------------------------------
def pipeline_marker(*values, name: str, mark_type: MarkType, reductions: tuple = ()):
    """Identity on ``values`` that records a marker of ``mark_type`` in the traced program.

    ``reductions`` (``grad`` markers only): per value, how micro-batches combine it.
    """
    if mark_type not in MARK_TYPES:
        raise ValueError(f"mark_type ({mark_type!r}) must be one of {MARK_TYPES}.")
    if not isinstance(name, str):
        raise TypeError(f"name ({name!r}) must be a str.")
    reductions = tuple(reductions)
    if reductions and len(reductions) != len(values):
        raise ValueError(
            f"reductions has {len(reductions)} entries for {len(values)} marked values; give "
            "one per value or none.")
    for r in reductions:
        _check_reduction(r, "reductions")
    return pipeline_p.bind(*values, name=name, mark_type=mark_type, reductions=reductions)


def mark_tree(tree: Any, *, name: str, mark_type: MarkType, reduction: Any = None):
    """Apply one marker to every array leaf of a pytree; non-array leaves pass through.

    ``reduction``: None, one reduction for every leaf, or a pytree prefix of ``tree`` of them.
    """
    leaves, treedef = jax.tree.flatten(tree)
    idx = [i for i, x in enumerate(leaves) if _is_array_like(x)]
    reductions = ()
    if reduction is not None:
        per_leaf = _per_leaf(reduction, tree)
        reductions = tuple(per_leaf[i] for i in idx)
    marked = pipeline_marker(*(leaves[i] for i in idx), name=name, mark_type=mark_type,
                             reductions=reductions)
    for i, m in zip(idx, marked, strict=True):
        leaves[i] = m
    return jax.tree.unflatten(treedef, leaves)


def mark_gradient(tree: Any, reduction: Any = "mean"):
    """Tag gradients (and aux values) so the part after the tag can run once per step.

    With gradient accumulation each marked leaf is combined over micro-batches by its
    ``reduction``: ``"mean"`` (gradients of a mean loss, the default), ``"sum"`` or ``"auto"``
    (from how the value is computed; see ``autoshard.combine``). Give one reduction, or a
    pytree prefix of ``tree`` with one per subtree.
    """
    return mark_tree(tree, name="grad", mark_type="grad", reduction=reduction)


def mark_parameters(tree: Any):
    """Tag the values a gradient is taken of (autoshard.grad does this for its argnums)."""
    return mark_tree(tree, name="params", mark_type="params")


def _check_reduction(r, what: str):
    if r not in REDUCTIONS:
        raise ValueError(f"{what} ({r!r}) must be one of {REDUCTIONS}.")


def _per_leaf(reduction, tree) -> list:
    if isinstance(reduction, str):
        _check_reduction(reduction, "reduction")
        return [reduction] * len(jax.tree.leaves(tree))
    try:
        full = jax.tree.map(lambda r, sub: jax.tree.map(lambda _: r, sub), reduction, tree,
                            is_leaf=lambda x: isinstance(x, str))
    except ValueError as e:
        raise ValueError(
            f"reduction must be 'mean', 'sum' or a pytree prefix of the marked values with "
            f"those strings as leaves; its structure does not match: {e}") from None
    out = jax.tree.leaves(full, is_leaf=lambda x: isinstance(x, str))
    for r in out:
        _check_reduction(r, "reduction")
    return out


def mark_pipeline_boundary():
    """Cut the program here into pipeline layers (a marker with no operands)."""
    pipeline_marker(name="boundary", mark_type="boundary")


def _is_array_like(x) -> bool:
    return isinstance(x, jax.Array) or hasattr(x, "shape") and hasattr(x, "dtype")


# Abstract evaluation and implementation --------------------------------------------------------
def _abstract_eval(*avals, name, mark_type, reductions=()):
    return list(avals)


def _impl(*values, name, mark_type, reductions=()):
    return list(values)


# Lowering: pure identity, no custom call -------------------------------------------------------
def _lowering(ctx, *values, name, mark_type, reductions=()):
    return list(values)


# Batching: the marker does not care about the batch dim ----------------------------------------
def _batching(values, dims, *, name, mark_type, reductions=()):
    return pipeline_p.bind(*values, name=name, mark_type=mark_type,
                           reductions=reductions), list(dims)


# JVP: primals keep the marker; non-zero tangents get the tangent copy of it --------------------
_TANGENT_TYPE = {"start": "jvp_start", "end": "jvp_end"}


def _jvp(primals, tangents, *, name, mark_type, reductions=()):
    primals_out = pipeline_p.bind(*primals, name=name, mark_type=mark_type,
                                  reductions=reductions)
    live = [i for i, t in enumerate(tangents) if not isinstance(t, _compat.Zero)]
    tangents_out = list(tangents)
    if live:
        marked = pipeline_p.bind(*(tangents[i] for i in live), name=name,
                                 mark_type=_TANGENT_TYPE.get(mark_type, mark_type),
                                 reductions=tuple(reductions[i] for i in live) if reductions
                                 else ())
        for i, t in zip(live, marked, strict=True):
            tangents_out[i] = t
    return primals_out, tangents_out


# Transpose: a layer's tangent start becomes the end of its backward layer, and vice versa ------
_TRANSPOSED_TYPE = {"jvp_start": "end", "jvp_end": "start", "start": "end", "end": "start"}


def _transpose(cts, *values, name, mark_type, reductions=()):
    live = [i for i, ct in enumerate(cts) if not isinstance(ct, _compat.Zero)]
    out = [
        _compat.Zero(v.aval) if _compat.is_undefined_primal(v) else None for v in values
    ]
    if live:
        marked = pipeline_p.bind(*(cts[i] for i in live), name=name,
                                 mark_type=_TRANSPOSED_TYPE.get(mark_type, mark_type),
                                 reductions=tuple(reductions[i] for i in live) if reductions
                                 else ())
        for i, ct in zip(live, marked, strict=True):
            out[i] = ct
    return out


# Registrations ---------------------------------------------------------------------------------
pipeline_p.def_abstract_eval(_abstract_eval)
pipeline_p.def_impl(_impl)
_compat.register_lowering(pipeline_p, _lowering)
_compat.primitive_batchers[pipeline_p] = _batching
_compat.primitive_jvps[pipeline_p] = _jvp
_compat.primitive_transposes[pipeline_p] = _transpose
