"""torch.distributed integration: ``capacity`` (every rank's overflow and spare memory exchanged, and the
peer-spill plan every rank computes alike, NOTE [ Capacity exchange ]).
"""
from torchckpt.distributed.capacity import DEFAULT_PEER_BANDWIDTH, SpillPlan, exchange

__all__ = ["DEFAULT_PEER_BANDWIDTH", "SpillPlan", "exchange"]
