"""``autoshard.grad`` and ``value_and_grad``: jax's, with a gradient marker on what they return."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax

from .ir._markers import Reduction, mark_gradient, mark_parameters, pipeline_marker


def _marked(transform, fun, argnums, has_aux, holomorphic, allow_int, reductions) -> Callable:
    g = transform(_loss_marked(fun, has_aux), argnums=argnums, has_aux=has_aux,
                  holomorphic=holomorphic, allow_int=allow_int)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fun)
    def marked(*args, **kwargs):
        args = list(args)
        for i in nums:
            if -len(args) <= i < len(args):
                args[i] = mark_parameters(args[i])
        return mark_gradient(g(*args, **kwargs), reductions(has_aux))
    return marked


def _loss_marked(fun: Callable, has_aux: bool) -> Callable:
    """``fun`` with its loss through a ``loss`` marker of type ``end``: differentiated, its
    transpose (type ``start``) is the first equation of the backward, so a pipeline splits
    forward from backward exactly where they meet (Alpa's layer markers)."""
    @functools.wraps(fun)
    def marked(*args, **kwargs):
        out = fun(*args, **kwargs)
        pair = has_aux and isinstance(out, tuple | list) and len(out) == 2
        loss = out[0] if pair else out
        if has_aux and not pair or not isinstance(loss, jax.Array):
            return out  # jax.grad reports what is wrong with it
        (loss,) = pipeline_marker(loss, name="loss", mark_type="end")
        return (loss, out[1]) if pair else loss
    return marked


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False, *,
         reduction: Reduction = "mean", aux_reduction: Reduction = "auto") -> Callable:
    """``jax.grad`` whose gradients (and aux values) carry a gradient marker.

    With ``num_micro_batches > 1`` the gradients are combined over micro-batches by
    ``reduction`` (``"mean"``: the gradient of a mean loss over the whole batch) and aux
    values by ``aux_reduction``: ``"auto"`` (the default) averages means, sums sums and
    counts, and keeps shape-derived and batch-independent values as the whole-batch step
    returns them (``autoshard.combine``); ``"mean"``, ``"sum"`` or a pytree of them override.
    """
    def reductions(aux):
        return (reduction, aux_reduction) if aux else reduction
    return _marked(jax.grad, fun, argnums, has_aux, holomorphic, allow_int, reductions)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   holomorphic: bool = False, allow_int: bool = False, *,
                   reduction: Reduction = "mean", aux_reduction: Reduction = "auto") -> Callable:
    """``jax.value_and_grad`` whose value, aux and gradients carry a gradient marker.

    With ``num_micro_batches > 1`` the value and gradients are combined over micro-batches by
    ``reduction`` (``"mean"`` by default) and aux values by ``aux_reduction`` (``"auto"``:
    see ``autoshard.grad`` and ``autoshard.combine``).
    """
    def reductions(aux):
        return ((reduction, aux_reduction), reduction) if aux else reduction
    return _marked(jax.value_and_grad, fun, argnums, has_aux, holomorphic, allow_int, reductions)
