"""Pipeline parallelism: layers, stages on sub-meshes, schedules and the runtime."""

from .layers import AutoLayerOption as AutoLayerOption
from .layers import ManualLayerOption as ManualLayerOption
from .method import PipeshardParallel as PipeshardParallel
from .schedules import Action as Action
from .schedules import Schedule as Schedule
from .schedules import get_schedule as get_schedule
from .simulate import simulate as simulate
from .stages import AutoStageOption as AutoStageOption
from .stages import ManualStageOption as ManualStageOption
from .stages import UniformStageOption as UniformStageOption

__all__ = ["Action", "AutoLayerOption", "AutoStageOption", "ManualLayerOption",
           "ManualStageOption", "PipeshardParallel", "Schedule", "UniformStageOption",
           "get_schedule", "simulate"]
