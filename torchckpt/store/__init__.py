"""The tiered store: a GPU cache backed by a host pool, with trace-planned prefetch."""
from torchckpt.store.gpu_cache import GpuCache
from torchckpt.store.host_pool import HostBlock, HostPool, HostPoolStats
from torchckpt.store.lazy_pool import LazyHostPool, make_host_pool, release_shared_host_pools, shared_host_pool
from torchckpt.store.plan import PrefetchPlan, plan_from_trace
from torchckpt.store.snapshots import SnapshotStats, SnapshotStore
from torchckpt.store.stats import Stats
from torchckpt.store.store import Store

__all__ = ["GpuCache", "HostBlock", "HostPool", "HostPoolStats", "LazyHostPool", "PrefetchPlan", "SnapshotStats",
           "SnapshotStore", "Stats", "Store", "make_host_pool", "plan_from_trace", "release_shared_host_pools",
           "shared_host_pool"]
