"""The token every operation returns: a pytree without leaves.

Ordering does not depend on it (operations run in program order anyway), so it can
cross `jax.jit` and `jax.vmap` boundaries freely, unlike a raw JAX token.
"""

from __future__ import annotations

import jax

from ..ir._compat import is_jax_token


class Token:
    """Marks a point in the sequence of MPI operations; pass it on as ``token=``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "autoshard.mpi.Token()"

    def __eq__(self, other) -> bool:
        return isinstance(other, Token)

    def __hash__(self) -> int:
        return hash(Token)


jax.tree_util.register_pytree_node(Token, lambda _: ((), None), lambda _aux, _children: Token())


def check_token(token) -> None:
    """Accepts None, a Token, or any JAX token (concrete or traced), as mpi4jax does.

    The value is not used: operations are ordered in program order regardless.
    """
    if token is None or isinstance(token, Token) or is_jax_token(token):
        return
    raise TypeError(
        f"token must be None, an autoshard.mpi.Token returned by a previous operation, or a "
        f"JAX token (jax.lax.create_token()), got {type(token).__name__} {token!r}. Pass the "
        f"second result of the previous call, or omit token=."
    )
