"""MPI collectives and point-to-point as native, zero-copy JAX operations.

Every operation returns ``(result, token)`` (``send`` and ``barrier`` return the token).
Operations run in program order whether or not tokens are threaded; see _lowering.py.
``token=`` accepts None, a returned Token or any JAX token.

Importing this package without MPI raises an ImportError naming the missing piece
(``python -m autoshard.mpi`` prints a diagnosis). Importing it changes nothing else in the
process: no JAX function and no ``sys.excepthook`` is replaced. To make an uncaught
exception on one rank abort the whole job, call ``abort_on_uncaught_exception()`` (or set
AUTOSHARD_MPI_ABORT=1); AUTOSHARD_MPI_DEBUG=1 (or mpi4jax's MPI4JAX_DEBUG=1) logs every MPI call, and
``set_logging(True)`` turns the log on at run time (see _native.py).
``autoshard.mpi.notoken`` offers the same operations with mpi4jax 0.8+'s token-free API:
``import autoshard.mpi.notoken as mpi4jax``.
Ranks that disagree on a call (operation, root, op, dtype, shape) get an error naming every
rank's call instead of MPI's undefined behaviour: each collective is checked the first time
a process makes it with its arguments, AUTOSHARD_MPI_CHECK=1 checks every call (see
_check.py). In a jit over several local devices a process makes one call on its whole
array, however it is sharded; a result keeps its operand's sharding (see _sharding.py).
Buffers of 4 MiB and more are advised onto transparent huge pages, as NumPy's arrays are,
for mpi4py's speed on large messages; AUTOSHARD_MPI_HUGE_PAGES=0 leaves them as XLA
allocated them (see PreferHugePages in _ffi.cc).
"""

from . import _install

if _install.diagnosing():
    # `python -m autoshard.mpi`: __main__.py reports what is present and what is missing, so
    # import nothing here that would fail without it.
    __all__ = []
else:
    from . import _config
    from ._native import MPI as _MPI  # noqa: F401  (fails first, with a clear ImportError)
    from ._native import get_logging as get_logging
    from ._native import set_logging as set_logging
    from ._runtime import abort_on_uncaught_exception as abort_on_uncaught_exception
    from ._token import Token as Token
    from .allgather import allgather as allgather
    from .allgatherv import allgatherv as allgatherv
    from .allreduce import allreduce as allreduce
    from .alltoall import alltoall as alltoall
    from .alltoallv import alltoallv as alltoallv
    from .barrier import barrier as barrier
    from .bcast import bcast as bcast
    from .gather import gather as gather
    from .recv import recv as recv
    from .reduce import reduce as reduce
    from .scan import scan as scan
    from .scatter import scatter as scatter
    from .send import send as send
    from .sendrecv import sendrecv as sendrecv

    if _config.abort_on_uncaught_exception():
        abort_on_uncaught_exception()

    __all__ = [
        "Token", "abort_on_uncaught_exception", "allgather", "allgatherv", "allreduce",
        "alltoall", "alltoallv", "barrier", "bcast", "gather", "get_logging", "recv", "reduce",
        "scan", "scatter", "send", "sendrecv", "set_logging",
    ]
