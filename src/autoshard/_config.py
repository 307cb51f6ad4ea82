"""Configuration read from the environment, in one place, validated."""

from __future__ import annotations

import os
import re
from typing import Literal

Backend = Literal["local", "distributed", "ray"]
"""How ``autoshard.init(cluster=...)`` runs processes (not ``autoshard.Cluster``, the hardware a
plan is costed for)."""
BACKENDS = ("local", "distributed", "ray")


def required_cluster() -> Backend:
    """The cluster a launcher told this process to join (AUTOSHARD_CLUSTER), default local."""
    value = os.environ.get("AUTOSHARD_CLUSTER", "local")
    if value not in BACKENDS:
        raise ValueError(
            f"The environment variable AUTOSHARD_CLUSTER ({value!r}) must be one of {BACKENDS}.")
    return value


DEFAULT_MAX_EXECUTABLES = 32
"""Executables a parallelized function keeps (least recently used ones are dropped)."""

RECOMPILE_WARNING_AFTER = 3
"""Warn when a function recompiles more than this many times only because a static value changed."""


def max_executables() -> int:
    """Per-function executable cache size: AUTOSHARD_MAX_EXECUTABLES, default 32."""
    value = os.environ.get("AUTOSHARD_MAX_EXECUTABLES", str(DEFAULT_MAX_EXECUTABLES))
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(
            f"The environment variable AUTOSHARD_MAX_EXECUTABLES ({value!r}) must be a positive "
            "integer (executables kept per parallelized function).")
    return size


def audit_on_first_call() -> bool:
    """AUTOSHARD_AUDIT=1: audit each new executable and warn where it diverges from its plan."""
    value = os.environ.get("AUTOSHARD_AUDIT", "") or "0"
    if value not in ("0", "1"):
        raise ValueError(
            f"The environment variable AUTOSHARD_AUDIT ({value!r}) must be 0 or 1 (1 audits "
            "each new executable at its first call and warns where the compiled program "
            "diverges from the plan).")
    return value == "1"


# -- Multi-process settings (autoshard.distributed) ------------------------------------------------
# Variables that autoshard.launch sets in every process it starts; init(cluster="distributed")
# reads them, then Slurm's and Open MPI's.
LAUNCH_VARS = ("AUTOSHARD_COORDINATOR_ADDRESS", "AUTOSHARD_NUM_PROCESSES", "AUTOSHARD_PROCESS_ID")


def _int_var(name: str, value: str, what: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(
            f"The environment variable {name} ({value!r}) must be a non-negative integer ({what}).")
    return number


def detected_processes() -> tuple[str, dict] | None:
    """Where this process's place in a multi-process job comes from, and the settings.

    Returns ``(source, settings)`` with source ``"autoshard.launch"``, ``"slurm"`` or
    ``"openmpi"`` and settings among ``coordinator_address``, ``num_processes``,
    ``process_id``; ``None`` when no launcher's variables are set.
    """
    env = os.environ
    if all(name in env for name in LAUNCH_VARS):
        return "autoshard.launch", {
            "coordinator_address": env["AUTOSHARD_COORDINATOR_ADDRESS"],
            "num_processes": _int_var("AUTOSHARD_NUM_PROCESSES", env["AUTOSHARD_NUM_PROCESSES"],
                                      "processes in the job"),
            "process_id": _int_var("AUTOSHARD_PROCESS_ID", env["AUTOSHARD_PROCESS_ID"],
                                   "this process's rank")}
    coordinator = env.get("AUTOSHARD_COORDINATOR_ADDRESS") or env.get("JAX_COORDINATOR_ADDRESS")
    if all(name in env for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")):
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if coordinator is None and nodes:
            port = _int_var("SLURM_JOB_ID", env["SLURM_JOB_ID"], "the job id") % 4096 + 61440
            coordinator = f"{first_slurm_host(nodes)}:{port}"
        return "slurm", {
            "coordinator_address": coordinator,
            "num_processes": _int_var("SLURM_NTASKS", env["SLURM_NTASKS"], "tasks in the step"),
            "process_id": _int_var("SLURM_PROCID", env["SLURM_PROCID"], "this task's rank")}
    if "OMPI_COMM_WORLD_SIZE" in env and "OMPI_COMM_WORLD_RANK" in env:
        if coordinator is None and "OMPI_MCA_orte_hnp_uri" in env:
            coordinator = _openmpi_coordinator(env["OMPI_MCA_orte_hnp_uri"])
        return "openmpi", {
            "coordinator_address": coordinator,
            "num_processes": _int_var("OMPI_COMM_WORLD_SIZE", env["OMPI_COMM_WORLD_SIZE"],
                                      "ranks in MPI_COMM_WORLD"),
            "process_id": _int_var("OMPI_COMM_WORLD_RANK", env["OMPI_COMM_WORLD_RANK"],
                                   "this process's rank")}
    return None


def first_slurm_host(nodes: str) -> str:
    """The first host of a Slurm node list: 'node[001-004],gpu7' -> 'node001' (as JAX parses it)."""
    head = re.split(r"[,\[]", nodes, maxsplit=1)[0]
    if len(head) < len(nodes) and nodes[len(head)] == "[":
        return head + re.split(r"[,\-\]]", nodes[len(head) + 1:], maxsplit=1)[0]
    return head


def _openmpi_coordinator(uri: str) -> str | None:
    """Open MPI 4's launcher address plus a port derived from its job id (as JAX derives it)."""
    match = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    if match is None:
        return None
    job_id = int(uri.split(".", maxsplit=1)[0]) // 4096 if uri.split(".")[0].isdigit() else 0
    return f"{next(g for g in match.groups() if g is not None)}:{job_id % 4096 + 61440}"


def launch_parent_pid() -> int | None:
    """The process that ``autoshard.launch`` runs in (AUTOSHARD_PARENT_PID): a worker whose
    parent is gone exits instead of lingering as an orphan."""
    value = os.environ.get("AUTOSHARD_PARENT_PID")
    return None if value is None else _int_var("AUTOSHARD_PARENT_PID", value, "a process id")
