"""What the processes of a launched job share with the launcher: their environment, errors."""

from __future__ import annotations

import os
import signal
import socket


class WorkerError(RuntimeError):
    """A process of a launched job failed; ``rank`` says which, ``remote_traceback`` how."""

    def __init__(self, message: str, *, rank: int, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


class RemoteTraceback(Exception):
    """The cause attached to a re-raised worker exception: the worker's own traceback."""

    def __str__(self):
        return self.args[0]


def worker_env(rank: int, num_processes: int, coordinator: str,
               devices_per_process: int | None, base: dict | None = None) -> dict:
    """The environment of process ``rank``: where the coordinator is, who it is, its devices."""
    env = dict(os.environ if base is None else base)
    env.update(AUTOSHARD_CLUSTER="distributed", AUTOSHARD_COORDINATOR_ADDRESS=coordinator,
               AUTOSHARD_NUM_PROCESSES=str(num_processes), AUTOSHARD_PROCESS_ID=str(rank))
    if devices_per_process is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(
            flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
        visible = env.get("CUDA_VISIBLE_DEVICES")
        gpus = (visible.split(",") if visible else
                [str(i) for i in range(num_processes * devices_per_process)])
        mine = gpus[rank * devices_per_process:(rank + 1) * devices_per_process]
        if mine:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def raise_worker_error(outcome, rank: int, n: int, fn_name: str):
    """Re-raise a worker's exception here: its own type, its traceback as the cause."""
    _, exc, text = outcome
    where = f"process {rank} of {n} (running {fn_name})"
    if isinstance(exc, BaseException) and not isinstance(exc, KeyboardInterrupt | SystemExit):
        if hasattr(exc, "add_note"):
            exc.add_note(f"Raised in {where}; its traceback is the cause above.")
        exc.autoshard_rank = rank
        raise exc from RemoteTraceback(f"\nTraceback in {where}:\n{text}")
    raise WorkerError(f"{where} failed:\n{text}", rank=rank, remote_traceback=text)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
