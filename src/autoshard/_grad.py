"""``autoshard.grad`` and ``value_and_grad``: jax's, with a gradient marker on what they return."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax

from .markers import Reduction, mark_gradient, mark_parameters


def _marked(transform, fun, argnums, has_aux, holomorphic, allow_int, reductions) -> Callable:
    g = transform(fun, argnums=argnums, has_aux=has_aux, holomorphic=holomorphic,
                  allow_int=allow_int)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fun)
    def marked(*args, **kwargs):
        args = list(args)
        for i in nums:
            if -len(args) <= i < len(args):
                args[i] = mark_parameters(args[i])
        return mark_gradient(g(*args, **kwargs), reductions(has_aux))
    return marked


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False, *,
         reduction: Reduction = "mean", aux_reduction: Reduction = "sum") -> Callable:
    """``jax.grad`` whose gradients (and aux values) carry a gradient marker.

    With ``num_micro_batches > 1`` the gradients are combined over micro-batches by
    ``reduction`` (``"mean"``: the gradient of a mean loss over the whole batch) and aux
    values by ``aux_reduction`` (``"sum"``: counts add up; use ``"mean"`` for averages).
    """
    def reductions(aux):
        return (reduction, aux_reduction) if aux else reduction
    return _marked(jax.grad, fun, argnums, has_aux, holomorphic, allow_int, reductions)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   holomorphic: bool = False, allow_int: bool = False, *,
                   reduction: Reduction = "mean", aux_reduction: Reduction = "sum") -> Callable:
    """``jax.value_and_grad`` whose value, aux and gradients carry a gradient marker.

    With ``num_micro_batches > 1`` the value and gradients are combined over micro-batches by
    ``reduction`` (``"mean"`` by default) and aux values by ``aux_reduction`` (``"sum"``).
    """
    def reductions(aux):
        return ((reduction, aux_reduction), reduction) if aux else reduction
    return _marked(jax.value_and_grad, fun, argnums, has_aux, holomorphic, allow_int, reductions)
