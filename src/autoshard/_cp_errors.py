"""Exceptions raised in custom_partitioning's callbacks while XLA compiles, re-raised as themselves.

XLA calls ``partition``, ``infer_sharding_from_operands``, ``propagate_user_sharding`` and the
tracing of ``lower_fn`` while it compiles, and turns a Python exception raised there into
``JaxRuntimeError: INTERNAL: custom_partitioner: Traceback ...``. Those callbacks record what
they raise here; a handler of JAX's compilation errors, registered on the first call of an
``autoshard.custom_partitioning`` operation, replaces such a runtime error by the recorded
exception (JAX raises it ``from`` the runtime error). Any other compilation error passes through
untouched. Only the last few exceptions are kept.
"""

from __future__ import annotations

import collections
import functools

from .ir._compat import add_compile_error_handler

_RAISED: collections.deque[BaseException] = collections.deque(maxlen=8)
_REGISTERED = False


def raised_in_xla(exc: BaseException) -> None:
    """Record ``exc``, about to be raised inside an XLA callback."""
    _RAISED.append(exc)


def surfaced(callback):
    """``callback``, recording what it raises."""

    @functools.wraps(callback)
    def run(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except Exception as exc:
            raised_in_xla(exc)
            raise

    return run


def reraise_callback_error(err: Exception) -> BaseException | None:
    """The recorded exception XLA's error ``err`` carries, or None (``err`` stands)."""
    text = str(err)
    if "custom_partitioner" not in text:
        return None
    for exc in reversed(_RAISED):
        if (str(exc) or type(exc).__name__) in text:
            _RAISED.remove(exc)
            return exc
    return None


def register_handler() -> None:
    global _REGISTERED
    if not _REGISTERED:
        add_compile_error_handler(reraise_callback_error)
        _REGISTERED = True
