"""The planner: measure a model's chain of blocks, then decide keep / recompute / offload per saved tensor."""

from torchckpt.planner.costs import Block, Chain, CodecCost, Decision, Link, Prediction, simulate
from torchckpt.planner.optimize import PlanError, Search, search
from torchckpt.planner.plan import Applied, AutoPlan, BlockPlan, Plan, auto, plan, plans
from torchckpt.planner.chain import find_blocks
from torchckpt.planner.trace import Profile, SavedTensor, profile

__all__ = [
    "Applied", "AutoPlan", "Block", "BlockPlan", "Chain", "CodecCost", "Decision", "Link", "Plan", "PlanError", "Prediction",
    "Profile", "SavedTensor", "Search", "auto", "find_blocks", "plan", "plans", "profile", "search", "simulate",
]
