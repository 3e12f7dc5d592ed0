"""Finding a model's chain of blocks (NOTE [ Profiling step ] Rule 1 in planner/profiling.py)."""
from __future__ import annotations

from torch import nn

__all__ = ["block_kind", "find_blocks"]


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_BAND = 0.9  # NOTE [ Profiling step ] Rule 1: classes within 90% of the best coverage count as covering as much


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's chain of repeated blocks (NOTE [ Profiling step ] Rule 1), as ``(qualified name, module)``.

    Raises:
        ValueError: no module class with two or more instances that hold parameters through submodules.
    """
    total = sum(p.numel() for p in model.parameters())
    found: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, mod in model.named_modules():
        if mod is model or type(mod) in _CONTAINERS or next(mod.children(), None) is None:
            continue
        found.setdefault(type(mod), []).append((name, mod))
    options: list[tuple[int, int, list[tuple[str, nn.Module]]]] = []
    for cls, mods in found.items():
        outer = [(n, m) for n, m in mods if not any(n.startswith(o + ".") for o, _ in mods if o != n)]
        params = sum(p.numel() for _, m in outer for p in m.parameters())
        if len(outer) >= 2 and params > 0:
            options.append((params, len(outer), outer))
    if not options:
        return _container_chain(model)
    best = max(p for p, _, _ in options)
    near = [o for o in options if o[0] >= _BAND * best and o[0] * 2 >= total]
    chosen = max(near or options, key=lambda o: (o[1], o[0]))
    return chosen[2]


def _container_chain(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """NOTE [ Profiling step ] Rule 1's fallback, for blocks that are plain containers themselves (an ``nn.Sequential``
    of ``nn.Sequential``): the children of the container whose children hold the most parameters,
    among those with two children of one class."""
    best: tuple[int, int, str, nn.Module] | None = None
    for name, mod in model.named_modules():
        if type(mod) not in _CONTAINERS:
            continue
        kids = list(mod.children())
        counts: dict[type, int] = {}
        for k in kids:
            counts[type(k)] = counts.get(type(k), 0) + 1
        if len(kids) < 2 or max(counts.values()) < 2:
            continue
        params = sum(p.numel() for k in kids for p in k.parameters())
        if params > 0 and (best is None or (params, len(kids)) > best[:2]):
            best = (params, len(kids), name, mod)
    if best is None:
        raise ValueError(
            f"torchckpt: found no chain of blocks in {type(model).__name__}: no module class has two or more instances "
            "holding parameters through submodules, and no container holds two modules of one class; pass "
            "blocks=[...] (the modules to plan, in forward order)."
        )
    prefix = f"{best[2]}." if best[2] else ""
    return [(f"{prefix}{n}", k) for n, k in best[3].named_children()]


def block_kind(module: nn.Module) -> str:
    """Blocks of one class whose parameters have the same shapes share a kind."""
    shapes = ",".join("x".join(map(str, p.shape)) for p in module.parameters())
    return f"{type(module).__qualname__}[{shapes}]"
