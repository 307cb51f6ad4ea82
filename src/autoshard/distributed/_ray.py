"""The Ray backend: Ray starts and supervises the processes, JAX's runtime connects them.

Each process of the job is one Ray actor. Rank 0 picks a free port on its node for JAX's
coordinator; every actor then joins with ``autoshard.init(cluster="ray")`` and runs the
function. Ray carries only the function, its arguments and the results; the arrays move over
JAX's own collectives (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import os
import sys
import time

from . import _worker
from ._process import WorkerError, free_port, raise_worker_error, worker_env


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError(
            "The Ray backend needs Ray: pip install 'autoshard[ray]' (or 'ray[default]').") from None
    return ray


def in_ray_worker() -> bool:
    """True inside a process that Ray started (an actor or task), False in a driver."""
    try:
        import ray
    except ImportError:
        return False
    if not ray.is_initialized():
        return False
    return ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def connect(kwargs: dict) -> bool:
    """Connect this driver to Ray (``address`` etc. as for ``ray.init``); True if it started Ray."""
    ray = _ray()
    if ray.is_initialized():
        return False
    ray.init(**kwargs)
    return True


def disconnect() -> None:
    _ray().shutdown()


class _Process:
    """One process of the job (a Ray actor)."""

    def coordinator_address(self) -> str:
        import ray

        host = ray.util.get_node_ip_address()
        return f"{host}:{free_port(host)}"

    def run(self, payload: bytes, env: dict) -> bytes:
        os.environ.update(env)
        ok, outcome = _worker.run_payload(payload, cluster="ray")
        if ok:
            import autoshard

            autoshard.shutdown()
        return outcome


def launch(payload: bytes, *, num_processes: int, devices_per_process: int | None,
           ray_address: str | None, timeout_s: float | None, fn_name: str) -> list:
    ray = _ray()
    started = not ray.is_initialized()
    if started:
        # A new local cluster when ray_address is None; "auto" or "host:port" joins one.
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    actors = []
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        local = _on_this_machine(ray)
        for rank in range(num_processes):
            env = {k: v for k, v in worker_env(rank, num_processes, "", devices_per_process,
                                               base={}).items()
                   if k == "XLA_FLAGS"}
            if local:  # the actors can import what this process imports (fn by reference)
                env["PYTHONPATH"] = os.pathsep.join(
                    os.path.abspath(p or os.getcwd()) for p in sys.path)
            options = {"num_cpus": 1, "runtime_env": {"env_vars": env}}
            if gpus:
                options["num_gpus"] = devices_per_process or 1
            actors.append(ray.remote(_Process).options(**options).remote())
        coordinator = ray.get(actors[0].coordinator_address.remote(),
                              timeout=_remaining(deadline))
        refs = {actors[rank].run.remote(payload, {
            "AUTOSHARD_COORDINATOR_ADDRESS": coordinator,
            "AUTOSHARD_NUM_PROCESSES": str(num_processes),
            "AUTOSHARD_PROCESS_ID": str(rank)}): rank for rank in range(num_processes)}
        return _supervise(ray, refs, num_processes, deadline, timeout_s, fn_name)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"launch: {fn_name} did not start within timeout_s={timeout_s} s on Ray (are there "
            f"{num_processes} free CPUs in the cluster?); its actors were stopped.") from None
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if started:
            ray.shutdown()


def _supervise(ray, refs: dict, n: int, deadline, timeout_s, fn_name) -> list:
    results: dict[int, object] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=_remaining(deadline))
        if not ready:
            running = sorted(refs[r] for r in pending)
            raise TimeoutError(
                f"launch: {fn_name} did not finish within timeout_s={timeout_s} s; process(es) "
                f"{running} of {n} were still running and have been stopped. A process waiting "
                "in a collective for a peer that never came is the usual cause; otherwise raise "
                "timeout_s.")
        rank = refs[ready[0]]
        try:
            outcome = _worker.loads(ray.get(ready[0]))
        except ray.exceptions.RayActorError as e:
            raise WorkerError(
                f"process {rank} of {n} running {fn_name} died (its Ray actor is gone); the "
                f"other processes were stopped. Ray says: {e}", rank=rank) from None
        if outcome[0] != "ok":
            raise_worker_error(outcome, rank, n, fn_name)
        results[rank] = outcome[1]
    return [results[r] for r in range(n)]


def _on_this_machine(ray) -> bool:
    here = ray.util.get_node_ip_address()
    return all(node["NodeManagerAddress"] == here for node in ray.nodes() if node["Alive"])


def _remaining(deadline) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
