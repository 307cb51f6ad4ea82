"""Markers in a traced step: the gradient marker (``mark_gradient``), parameters
(``mark_parameters``), pipeline boundaries (``mark_pipeline_boundary``) and the primitive that
carries them (``pipeline_p``, Alpa's ``pipeline_p.bind(*args, name=..., mark_type=...)``).
Implemented in ``ir/_markers``."""

from .ir._markers import MARK_TYPES as MARK_TYPES
from .ir._markers import REDUCTIONS as REDUCTIONS
from .ir._markers import MarkType as MarkType
from .ir._markers import Reduction as Reduction
from .ir._markers import mark_gradient as mark_gradient
from .ir._markers import mark_parameters as mark_parameters
from .ir._markers import mark_pipeline_boundary as mark_pipeline_boundary
from .ir._markers import mark_tree as mark_tree
from .ir._markers import pipeline_marker as pipeline_marker
from .ir._markers import pipeline_p as pipeline_p

__all__ = ["MARK_TYPES", "REDUCTIONS", "MarkType", "Reduction", "mark_gradient",
           "mark_parameters", "mark_pipeline_boundary", "mark_tree", "pipeline_marker",
           "pipeline_p"]
