"""The token every operation returns: a pytree without leaves.

Ordering does not depend on it (operations run in program order anyway), so it can
cross `jax.jit` and `jax.vmap` boundaries freely, unlike a raw JAX token.
"""

from __future__ import annotations

import jax


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
    """Accepts None or a Token (mpi4jax users may pass a raw JAX token: also accepted)."""
    if token is None or isinstance(token, Token):
        return
    aval = getattr(token, "aval", None)
    if aval is not None and type(aval).__name__ == "AbstractToken":
        return
    raise TypeError(
        f"token must be an autoshard.mpi.Token returned by a previous operation or None, "
        f"got {type(token).__name__}. Pass the second result of the previous call."
    )
