"""Running one parallelized program over many processes and hosts.

JAX's own distributed runtime connects the processes (multi-controller SPMD: gloo collectives
on CPU, NCCL on GPU); ``launch`` starts them (local subprocesses or Ray actors) and supervises
them; ``agree_on_plan`` makes every process run process 0's plan for the same traced program.
"""

from ._process import WorkerError as WorkerError
from ._runtime import initialize as initialize
from ._runtime import shutdown as shutdown
from .launch import launch as launch
from .plan_sync import PlanMismatchError as PlanMismatchError
from .plan_sync import agree_on_plan as agree_on_plan
from .plan_sync import program_fingerprint as program_fingerprint

__all__ = [
    "PlanMismatchError",
    "WorkerError",
    "agree_on_plan",
    "initialize",
    "launch",
    "program_fingerprint",
    "shutdown",
]
