"""``autoshard.launch``: start the processes of a job, run a function in each, collect results.

The local backend starts ``num_processes`` Python subprocesses on this machine (each its own
process group), process 0 hosting JAX's coordinator on a free loopback port; the Ray backend
starts one Ray actor per process. Either way every process joins with
``autoshard.init(cluster=...)`` before ``fn(*args)`` runs, and the launcher supervises: the first
process to fail (an exception, or death by a signal) stops the others and its error is raised
here with its rank; ``timeout_s`` bounds the whole run. No process outlives the call.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

from . import _worker
from ._process import WorkerError, describe_exit, free_port, raise_worker_error, worker_env


def launch(fn: Callable, *args: Any, num_processes: int, devices_per_process: int | None = None,
           backend: Literal["local", "ray"] = "local", ray_address: str | None = None,
           timeout_s: float | None = None) -> list:
    """Run ``fn(*args)`` in ``num_processes`` processes of one JAX job; their results by rank.

    ``devices_per_process``: devices each process sees (CPU: that many virtual devices; GPU:
    that many GPUs of the host, consecutive per rank); None keeps this process's setting.
    ``backend``: ``"local"`` subprocesses, or ``"ray"`` actors (on the cluster at
    ``ray_address``, or a local one started for the call). ``fn`` and ``args`` are pickled
    (cloudpickle when installed) and must return picklable host values. A worker's exception is
    re-raised here with its rank and traceback; ``timeout_s`` (None: no limit) ends a stuck job
    with ``TimeoutError``.
    """
    _validate(fn, num_processes, devices_per_process, backend, ray_address, timeout_s)
    try:
        payload = _worker.dumps((fn, args))
    except Exception as e:
        raise TypeError(
            f"launch could not pickle fn ({getattr(fn, '__name__', fn)!r}) and its arguments to "
            f"send them to the processes: {e}. Define fn at module level and pass picklable "
            "arguments (numpy arrays rather than jax arrays), or install cloudpickle.") from e
    if backend == "ray":
        from . import _ray

        return _ray.launch(payload, num_processes=num_processes,
                           devices_per_process=devices_per_process, ray_address=ray_address,
                           timeout_s=timeout_s, fn_name=_name(fn))
    return _launch_local(payload, num_processes, devices_per_process, timeout_s, _name(fn))


def _validate(fn, num_processes, devices_per_process, backend, ray_address, timeout_s):
    if not callable(fn):
        raise TypeError(f"launch expects a function as fn, got {fn!r}.")
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise ValueError(f"num_processes ({num_processes!r}) must be a positive int.")
    if devices_per_process is not None and (
            not isinstance(devices_per_process, int) or isinstance(devices_per_process, bool)
            or devices_per_process < 1):
        raise ValueError(
            f"devices_per_process ({devices_per_process!r}) must be a positive int or None "
            "(keep the devices each process finds).")
    if backend not in ("local", "ray"):
        raise ValueError(f"backend ({backend!r}) must be 'local' or 'ray'.")
    if ray_address is not None and backend != "ray":
        raise ValueError(
            f"ray_address ({ray_address!r}) is only used with backend='ray'; pass "
            "backend='ray' or drop ray_address.")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(
            timeout_s, int | float) or timeout_s <= 0):
        raise ValueError(f"timeout_s ({timeout_s!r}) must be a positive number of seconds or None.")


_WORKER_MAIN = "import sys; from autoshard.distributed._worker import main; main(sys.argv[1:])"


def _launch_local(payload: bytes, num_processes: int, devices_per_process, timeout_s, fn_name):
    coordinator = f"127.0.0.1:{free_port()}"
    path = os.pathsep.join(os.path.abspath(p or os.getcwd()) for p in sys.path)
    with tempfile.TemporaryDirectory(prefix="autoshard-launch-") as tmp:
        payload_path = os.path.join(tmp, "payload.pkl")
        with open(payload_path, "wb") as f:
            f.write(payload)
        results = [os.path.join(tmp, f"result-{rank}.pkl") for rank in range(num_processes)]
        procs: list[subprocess.Popen] = []
        tails: list[deque] = []
        try:
            for rank in range(num_processes):
                env = worker_env(rank, num_processes, coordinator, devices_per_process)
                env["AUTOSHARD_PARENT_PID"] = str(os.getpid())
                env["PYTHONPATH"] = path  # so fn pickled by reference imports in the worker
                proc = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_MAIN, payload_path, results[rank]],
                    env=env, start_new_session=True,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                procs.append(proc)
                tails.append(_forward(proc, rank))
            return _supervise(procs, results, tails, timeout_s, fn_name)
        finally:
            stop(procs)


def _forward(proc: subprocess.Popen, rank: int, keep: int = 40) -> deque:
    """Copy the worker's output to ours, each line tagged with its rank; keep the last lines."""
    tail: deque = deque(maxlen=keep)

    def pump():
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            tail.append(line)
            sys.stderr.write(f"[rank {rank}] {line}")
        proc.stdout.close()

    threading.Thread(target=pump, name=f"autoshard-launch-out-{rank}", daemon=True).start()
    return tail


def _supervise(procs, results, tails, timeout_s, fn_name) -> list:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    n = len(procs)
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank = min(failed, key=lambda r: (not os.path.exists(results[r]), r))
            outcome = _read(results[rank])
            if outcome is not None:
                raise_worker_error(outcome, rank, n, fn_name)
            raise WorkerError(
                f"process {rank} of {n} running {fn_name} died ({describe_exit(codes[rank])}) "
                f"without reporting an error; the other processes were stopped. Its last "
                f"output:\n{''.join(tails[rank]) or '(none)'}", rank=rank)
        if all(c == 0 for c in codes):
            return [_result(results[r], r, n, fn_name) for r in range(n)]
        if deadline is not None and time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            raise TimeoutError(
                f"launch: {fn_name} did not finish within timeout_s={timeout_s} s; process(es) "
                f"{running} of {n} were still running and have been stopped. A process waiting "
                "in a collective for a peer that never came is the usual cause; otherwise raise "
                "timeout_s.")
        time.sleep(0.02)


def _read(path: str):
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return _worker.loads(f.read())


def _result(path, rank, n, fn_name):
    outcome = _read(path)
    if outcome is None:
        raise WorkerError(f"process {rank} of {n} running {fn_name} exited without a result.",
                          rank=rank)
    if outcome[0] != "ok":
        raise_worker_error(outcome, rank, n, fn_name)
    return outcome[1]


def stop(procs: list[subprocess.Popen], grace_s: float = 2.0) -> None:
    """Stop every process group still alive: SIGTERM, then SIGKILL after ``grace_s``."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in alive:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        _signal_group(p, signal.SIGKILL)  # the group: children the worker started go too
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _signal_group(p: subprocess.Popen, sig) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
