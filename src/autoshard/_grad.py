"""``autoshard.grad`` and ``value_and_grad``: jax's, with a gradient marker on what they return."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax

from .markers import mark_gradient


def _marked(transform, fun, argnums, has_aux, holomorphic, allow_int) -> Callable:
    g = transform(fun, argnums=argnums, has_aux=has_aux, holomorphic=holomorphic,
                  allow_int=allow_int)

    @functools.wraps(fun)
    def marked(*args, **kwargs):
        return mark_gradient(g(*args, **kwargs))
    return marked


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False) -> Callable:
    """``jax.grad`` whose gradients (and aux values) carry a gradient marker."""
    return _marked(jax.grad, fun, argnums, has_aux, holomorphic, allow_int)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   holomorphic: bool = False, allow_int: bool = False) -> Callable:
    """``jax.value_and_grad`` whose value, aux and gradients carry a gradient marker."""
    return _marked(jax.value_and_grad, fun, argnums, has_aux, holomorphic, allow_int)
