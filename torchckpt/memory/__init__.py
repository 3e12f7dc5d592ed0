"""Memory the stores draw on: pinned host pools (eager and lazy), the device arena, the
node-wide lock that shares pinning among processes, and what the machine offers.
"""
from torchckpt.memory.host_pool import HostBlock, HostPool, HostPoolStats
from torchckpt.memory.lazy_pool import LazyHostPool, make_host_pool, release_shared_host_pools, shared_host_pool

__all__ = ["HostBlock", "HostPool", "HostPoolStats", "LazyHostPool", "make_host_pool", "release_shared_host_pools",
           "shared_host_pool"]
