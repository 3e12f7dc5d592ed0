"""Memory the stores draw on, one concept a module: ``host_pool`` (the eager pinned pool and its
blocks), ``lazy_pool`` (one mapping pinned chunk by chunk in the background), ``link_model`` (the
host link's measured bandwidths and the strategy model), ``sysinfo`` (what the machine offers),
``factory`` (which pool a store gets, and the shared pools), ``node_lock`` (registrations
serialized across processes), ``device_arena`` (snapshot slots in CUDA virtual memory), ``disk``
(the disk tier behind host memory: snapshot files written behind and read ahead by I/O threads), ``peer_tier``
(tensors other ranks spilled here, moved in collective rounds of torch.distributed point-to-point).
"""
from torchckpt.memory.disk import DiskStats, DiskTier
from torchckpt.memory.factory import make_host_pool, release_shared_host_pools, shared_host_pool
from torchckpt.memory.host_pool import HostBlock, HostPool, HostPoolBase, HostPoolStats
from torchckpt.memory.lazy_pool import LazyHostPool
from torchckpt.memory.peer_tier import PeerTier

__all__ = ["DiskStats", "DiskTier", "HostBlock", "HostPool", "HostPoolBase", "HostPoolStats", "LazyHostPool",
           "PeerTier", "make_host_pool", "release_shared_host_pools", "shared_host_pool"]
