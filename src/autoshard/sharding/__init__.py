"""The automatic intra-operator planner: jaxpr -> graph -> strategies -> cost -> ILP -> plan."""

from .apply import apply_plan as apply_plan
from .options import AutoShardingOption as AutoShardingOption
from .plan import Collective as Collective
from .plan import LeafPlan as LeafPlan
from .plan import Objective as Objective
from .plan import ShardingPlan as ShardingPlan
from .planner import Outpriced as Outpriced
from .planner import plan_auto as plan_auto

__all__ = ["AutoShardingOption", "Collective", "LeafPlan", "Objective", "ShardingPlan",
           "apply_plan", "plan_auto"]
