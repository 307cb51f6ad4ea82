"""autoshard: run JAX programs on many devices without writing shardings."""

from typing import TYPE_CHECKING

from . import markers as markers
from ._api import Executable as Executable
from ._api import ParallelizedFunc as ParallelizedFunc
from ._api import clear_executable_cache as clear_executable_cache
from ._api import init as init
from ._api import parallelize as parallelize
from ._api import shutdown as shutdown
from ._grad import grad as grad
from ._grad import value_and_grad as value_and_grad
from ._plan_api import plan as plan
from ._program import register_state_type as register_state_type
from .checkpoint import restore_checkpoint as restore_checkpoint
from .checkpoint import save_checkpoint as save_checkpoint
from .cluster import Cluster as Cluster
from .custom_partitioning import custom_partitioning as custom_partitioning
from .data import DataLoader as DataLoader
from .distributed import WorkerError as WorkerError
from .distributed import launch as launch
from .markers import mark_gradient as mark_gradient
from .markers import mark_parameters as mark_parameters
from .markers import mark_pipeline_boundary as mark_pipeline_boundary
from .methods._methods import DataParallel as DataParallel
from .methods._methods import ManualShardingOption as ManualShardingOption
from .methods._methods import ParallelMethod as ParallelMethod
from .methods._methods import ShardParallel as ShardParallel
from .methods._methods import Zero2Parallel as Zero2Parallel
from .methods._methods import Zero3Parallel as Zero3Parallel
from .sharding.options import AutoShardingOption as AutoShardingOption
from .sharding.plan import ShardingPlan as ShardingPlan

__version__ = "0.1.0"

# The pipeline (layers, stages, schedules, its runtime) loads on first use of one of its names,
# so that ``import autoshard`` costs little beyond ``import jax``.
_PIPELINE = ("AutoLayerOption", "AutoParallel", "AutoStageOption", "ManualLayerOption", "ManualStageOption",
             "PipeshardParallel", "UniformStageOption")

if TYPE_CHECKING:
    from .pipeline import AutoLayerOption as AutoLayerOption
    from .pipeline import AutoStageOption as AutoStageOption
    from .pipeline import ManualLayerOption as ManualLayerOption
    from .pipeline import ManualStageOption as ManualStageOption
    from .pipeline import PipeshardParallel as PipeshardParallel
    from .pipeline import UniformStageOption as UniformStageOption
    from .pipeline.auto import AutoParallel as AutoParallel


def __getattr__(name: str):
    if name in _PIPELINE:
        from . import pipeline
        from .pipeline import auto

        value = getattr(auto if name == "AutoParallel" else pipeline, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PIPELINE))

__all__ = [
    "AutoLayerOption",
    "AutoParallel",
    "AutoShardingOption",
    "DataLoader",
    "AutoStageOption",
    "Cluster",
    "DataParallel",
    "Executable",
    "ManualLayerOption",
    "ManualShardingOption",
    "ManualStageOption",
    "ParallelMethod",
    "ParallelizedFunc",
    "PipeshardParallel",
    "ShardParallel",
    "ShardingPlan",
    "UniformStageOption",
    "WorkerError",
    "Zero2Parallel",
    "Zero3Parallel",
    "clear_executable_cache",
    "custom_partitioning",
    "grad",
    "init",
    "launch",
    "mark_gradient",
    "mark_parameters",
    "mark_pipeline_boundary",
    "markers",
    "parallelize",
    "plan",
    "register_state_type",
    "restore_checkpoint",
    "save_checkpoint",
    "shutdown",
    "value_and_grad",
]
