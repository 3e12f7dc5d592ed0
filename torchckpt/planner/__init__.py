"""The planner: measure a model's chain of blocks, then decide keep / recompute / offload per saved tensor."""

from torchckpt.planner.costs import Block, StepCosts, CodecCost, Decision, Link, Prediction, predict
from torchckpt.planner.optimize import PlanError, Search, search
from torchckpt.planner.autoplan import AutoPlan, auto
from torchckpt.planner.plan import Applied, BlockPlan, Measurement, Plan
from torchckpt.planner.verify import plan, plans
from torchckpt.planner.blocks import find_blocks
from torchckpt.planner.profiling import Profile, SavedTensor, profile

__all__ = [
    "Applied", "AutoPlan", "Block", "BlockPlan", "StepCosts", "CodecCost", "Decision", "Link", "Measurement", "Plan",
    "PlanError", "Prediction",
    "Profile", "SavedTensor", "Search", "auto", "find_blocks", "plan", "plans", "profile", "search", "predict",
]
