"""Joining and leaving JAX's distributed runtime: where the settings come from, gloo on CPU.

``autoshard.init`` and ``autoshard.shutdown`` delegate here. A process joins a multi-process
job with ``jax.distributed.initialize``; its coordinator address, process count and rank come
from the caller's keyword arguments, else from the variables that ``autoshard.launch`` sets,
else from Slurm or Open MPI (``_config.detected_processes``). Leaving drops JAX's backends as
well, so the process can join again (a new job, or a purely local run).
"""

from __future__ import annotations

import ipaddress
import socket
import time

import jax

from .. import _config
from ..ir import _compat
from ._process import free_port

RUNTIME_KWARGS = ("coordinator_address", "num_processes", "process_id", "local_device_ids",
                  "initialization_timeout", "heartbeat_timeout_seconds",
                  "shutdown_timeout_seconds", "coordinator_bind_address")
"""Keyword arguments of ``init(cluster="distributed")``, passed on to jax.distributed.initialize."""

_REQUIRED = ("coordinator_address", "num_processes", "process_id")

_state = {"joined": False, "ray_started": False}


def initialize(cluster: str, kwargs: dict) -> None:
    """Join ``cluster`` ("local", "distributed" or "ray") with the keyword arguments of init."""
    if cluster == "local":
        if kwargs:
            raise TypeError(
                f"init(cluster='local') takes no keyword arguments, got {sorted(kwargs)}. "
                "Pass them with cluster='distributed' or cluster='ray'.")
        return
    if cluster == "ray":
        from . import _ray

        if not _ray.in_ray_worker():
            _state["ray_started"] = _ray.connect(kwargs)
            return  # the driver supervises; the processes Ray starts run the program
    join(kwargs, cluster=cluster)


def join(kwargs: dict, *, cluster: str = "distributed") -> None:
    """``jax.distributed.initialize`` with explicit settings, detected ones filling the gaps."""
    unknown = sorted(set(kwargs) - set(RUNTIME_KWARGS))
    if unknown:
        raise TypeError(
            f"init(cluster={cluster!r}) got unknown keyword argument(s) {unknown}; it takes "
            f"{', '.join(RUNTIME_KWARGS)}.")
    settings, source = resolve_settings(kwargs, cluster=cluster)
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "JAX's distributed runtime is already initialized in this process (by "
            "jax.distributed.initialize or an earlier autoshard.init). Call "
            "autoshard.shutdown() first, or drop the second initialization.")
    if _compat.backends_are_initialized():
        raise RuntimeError(
            f"init(cluster={cluster!r}) must come before the first JAX computation or device "
            "query (jax.devices(), jnp.ones(...), ...) in this process: JAX's backends already "
            "exist and cannot join a multi-process job. Move autoshard.init to the top of the "
            "program, before anything else uses JAX.")
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        # Without it, computations spanning CPU devices of several processes fail to compile.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _set_transfer_address(settings["coordinator_address"])
    try:
        jax.distributed.initialize(cluster_detection_method="deactivate", **settings)
    except (ValueError, RuntimeError, TypeError) as e:
        raise RuntimeError(
            f"init(cluster={cluster!r}) could not start JAX's distributed runtime with "
            f"{_describe(settings)} (from {source}): {e}. Check that every process got the same "
            "coordinator_address and num_processes, distinct process_id values, and that "
            "process 0 can listen on the coordinator port.") from e
    _state["joined"] = True
    _state["settings"] = settings


def resolve_settings(kwargs: dict, *, cluster: str = "distributed") -> tuple[dict, str]:
    """The settings for jax.distributed.initialize and a description of where they came from."""
    detected = _config.detected_processes()
    source, found = detected if detected is not None else (None, {})
    settings = dict(kwargs)
    for name in _REQUIRED:
        if settings.get(name) is None and found.get(name) is not None:
            settings[name] = found[name]
    missing = [name for name in _REQUIRED if settings.get(name) is None]
    if missing:
        where = (f"the {source} environment gave no {', '.join(missing)}" if source
                 else "no launcher was detected (autoshard.launch, Slurm or Open MPI variables)")
        raise RuntimeError(
            f"init(cluster={cluster!r}) could not start JAX's distributed runtime: it needs "
            f"{', '.join(missing)} and {where}. Pass "
            "coordinator_address='host:port', num_processes=N and process_id=i (the same address "
            "and N in every process), set AUTOSHARD_COORDINATOR_ADDRESS, or start the "
            "processes with autoshard.launch, srun or mpirun.")
    for name in ("num_processes", "process_id"):
        value = settings[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} ({value!r}) must be a non-negative int.")
    if not settings["process_id"] < settings["num_processes"] or settings["num_processes"] < 1:
        raise ValueError(
            f"process_id ({settings['process_id']}) must be below num_processes "
            f"({settings['num_processes']}); ranks run from 0 to num_processes - 1.")
    address = settings["coordinator_address"]
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(
            f"coordinator_address ({address!r}) must be 'host:port', e.g. '10.0.0.1:1234' (the "
            "address of process 0 and a free port on it).")
    explicit = [n for n in _REQUIRED if kwargs.get(n) is not None]
    origin = ("keyword arguments" if len(explicit) == len(_REQUIRED)
              else f"{source or 'keyword arguments'}" + (
                  f" and keyword arguments ({', '.join(explicit)})" if explicit else ""))
    return settings, origin


def shutdown() -> None:
    """Leave the distributed runtime (if joined) and Ray (if this process started it)."""
    if jax.distributed.is_initialized():
        from . import plan_sync

        plan_sync.reset()
        jax.distributed.shutdown()
        # The backends were built for the job just left; drop them so init can run again.
        _compat.clear_backends()
        settings = _state.get("settings") or {}
        if settings.get("process_id"):
            _wait_until_closed(settings["coordinator_address"])
    _state["joined"] = False
    if _state.pop("transfer_address_set", False):  # a new job gets a new port
        jax.config.update(TRANSFER_FLAG, "")
    if _state["ray_started"]:
        from . import _ray

        _ray.disconnect()
        _state["ray_started"] = False


TRANSFER_FLAG = "jax_cross_host_transfer_socket_address"
"""JAX's setting that gives a process a transfer server for arrays sent between processes."""


def _set_transfer_address(coordinator: str) -> None:
    """Give this process an address for JAX's cross-process array transfers (unless set).

    ``jax.device_put`` of an array to devices of another process (pipeline stages owned by
    different processes) goes through a transfer server that the backend starts when this flag
    names a socket address; backends without native cross-host transfers (CPU) need it. The
    address is this host's, as seen from the coordinator's network, with a free port.
    """
    try:
        if jax.config.read(TRANSFER_FLAG):
            return  # the user's choice
    except AttributeError:  # a JAX without the flag
        return
    host = _local_address(coordinator.rpartition(":")[0].strip("[]"))
    jax.config.update(TRANSFER_FLAG, f"{host}:{free_port(host)}")
    _state["transfer_address_set"] = True


def _local_address(coordinator_host: str) -> str:
    """This host's address on the route to ``coordinator_host`` (loopback stays loopback)."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(coordinator_host)).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((coordinator_host, 9))  # no packet is sent; the kernel picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _wait_until_closed(address: str, limit_s: float = 2.0) -> None:
    """Wait (briefly) until process 0's coordinator of the job just left stops listening.

    Process 0 stops its coordinator service a moment after the others leave the shutdown
    barrier; a process that joins again at once could otherwise reach the old service on the
    same address and fail when it goes. Once the port refuses, or after ``limit_s`` (a new
    service is already up), joining again is safe.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=0.2):
                pass
        except OSError:
            return
        time.sleep(0.01)


def _describe(settings: dict) -> str:
    return ", ".join(f"{k}={settings[k]!r}" for k in _REQUIRED)
