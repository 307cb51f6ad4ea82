"""MPI collectives and point-to-point as native, zero-copy JAX operations.

Every operation returns ``(result, token)`` (``send`` and ``barrier`` return the token).
Operations run in program order whether or not tokens are threaded; see _lowering.py.
Importing this package without MPI raises an ImportError naming the missing piece.
"""

from ._native import MPI as _MPI  # noqa: F401  (fails first, with a clear ImportError)
from ._runtime import install as _install
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

_install()

__all__ = [
    "Token", "allgather", "allgatherv", "allreduce", "alltoall", "alltoallv", "barrier", "bcast",
    "gather", "recv", "reduce", "scan", "scatter", "send", "sendrecv",
]
