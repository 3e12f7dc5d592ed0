"""The planner: measure a model's chain of blocks, then decide keep / recompute / offload per saved tensor."""

from torchckpt.planner.costs import Block, Chain, CodecCost, Decision, Link, Prediction, simulate
from torchckpt.planner.optimize import PlanError, Search, search
from torchckpt.planner.plan import Applied, BlockPlan, Plan, plan, plans
from torchckpt.planner.trace import Profile, SavedTensor, find_blocks, profile

__all__ = [
    "Applied", "Block", "BlockPlan", "Chain", "CodecCost", "Decision", "Link", "Plan", "PlanError", "Prediction",
    "Profile", "SavedTensor", "Search", "find_blocks", "plan", "plans", "profile", "search", "simulate",
]
