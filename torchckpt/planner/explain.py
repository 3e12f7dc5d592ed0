"""What ``Plan.explain`` prints: a header, one row per block, and with ``verbose`` each block's kept ops, parts and
tensors sent to host."""
from __future__ import annotations

from typing import Any

from torchckpt._errors import format_bytes, format_bytes_apart
from torchckpt.planner.costs import part_bytes

__all__ = ["summary"]

_SMALL_DIV = 100  # explain(verbose=True) sums a block's tensors sent to host under 1% of its largest one


def summary(plan: Any, verbose: bool = False) -> str:
    """What ``explain`` prints, as a string: a header, then one row per block (``verbose``: and per tensor)."""
    figures = [plan.budget, plan.peak_bytes, plan.none_peak_bytes, plan.floor_bytes]
    if plan.measured_peak_bytes is not None:
        figures.append(plan.measured_peak_bytes)
    budget, peak, none_peak, floor, *measured = format_bytes_apart(*figures)
    lines = [
        f"torchckpt plan on {plan.device}: budget {budget}, predicted peak "
        f"{peak}, step {plan.step_time * 1e3:.1f} ms "
        f"(no checkpointing{'' if plan.none_measured else ', predicted'}: {none_peak}, "
        f"{plan.none_step_time * 1e3:.1f} ms, "
        f"{plan.step_time / plan.none_step_time if plan.none_step_time else float('nan'):.2f}x); "
        f"floor {floor}"
        + (f"; measured peak {measured[0]}" if measured else "")
        + (f", step {plan.measured_step_time * 1e3:.1f} ms" if plan.measured_step_time is not None else ""),
        f"host link {plan.link[0] / 1e9:.1f} GB/s to host, {plan.link[1] / 1e9:.1f} GB/s back",
    ]
    if plan.measurements:
        lines.append(_measured(plan))
    if plan.turns:  # NOTE [ Applying a plan ] Rule 9
        a, b = plan.turns
        lines.append(f"measured in turns: {a.what} {a.step_time * 1e3:.1f} ms, {b.what} {b.step_time * 1e3:.1f} ms"
                     + ("" if b.fits else f" at {format_bytes(b.peak_bytes)}, over the budget") + f": took {a.what}")
    if plan.codec is not None:
        lines.append(f"codec {plan.codec}: " + (f"LOSSY, {plan.bound}" if plan.lossy else "lossless"))
    if plan.revolve:
        sched = plan.schedule()
        again = sum(b.revolve_s for b in plan.blocks)
        lines.append(f"block inputs: {sched!r} over the chain (checkpoint_chain): snapshots hold at most "
                     f"{format_bytes(plan.revolve)}, the others are rebuilt by running blocks again "
                     f"({again * 1e3:.1f} ms)")
    rows = []
    d2h = plan.link[0]
    for i, b in enumerate(plan.blocks):
        if b.mode == "offload":
            what = f"offload {len(b.offload)}/{sum(1 for t in b.tensors if t.nbytes)}" + (" compressed" if b.compress
                                                                                          else "")
            moved = b.saved_bytes - b.device_bytes
            cost = f"{moved / d2h * 1e3:.2f}"
            pre = f"at backward of {plan.blocks[i + 1].name}" if i + 1 < len(plan.blocks) else "end of forward"
        elif b.mode == "recompute":
            what, cost, pre = "recompute", f"{(max(0.0, b.fwd_s - b.keep_s) + b.parts_s) * 1e3:.2f}", "-"
            if b.keep_ops:
                what = f"recompute, keep {len(b.keep_ops)} ops"
            if b.parts:
                what = f"recompute in {len(b.parts) + 1} parts"
            if b.host:
                what += (", on host" + (" compressed" if b.compress else "")) if b.keep_ops else ", inputs host"
                pre = f"at backward of {plan.blocks[i + 1].name}" if i + 1 < len(plan.blocks) else "end of forward"
            if b.reentrant:
                what += ", reentrant"
            if b.revolve:
                what += ", input by Revolve"
                cost = f"{(b.fwd_s + b.parts_s + b.revolve_s) * 1e3:.2f}"
        else:
            what, cost, pre = "keep", f"{0:.2f}", "-"
        rows.append((b.name, what, *format_bytes_apart(b.saved_bytes, b.device_bytes), cost, pre))
    head = ("block", "decision", "saved", "on device", "cost ms", "prefetch")
    w = [max(len(r[c]) for r in [head, *rows]) for c in range(5)]
    for i, r in enumerate([head, *rows]):
        lines.append(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}  {r[4]:>{w[4]}}  {r[5]}")
        if verbose and i:
            lines.extend(_details(plan, plan.blocks[i - 1]))
    more = {what: None for b in plan.blocks for what, has in (("the kept ops", b.keep_ops), ("the parts", b.parts),
                                                               ("the tensors sent to host", b.offload)) if has}
    if more and not verbose:
        lines.append(f"explain(verbose=True) lists {', '.join(more)} of each block")
    return "\n".join(lines)

def _measured(plan: Any) -> str:
    """``summary``'s line on what verification measured (NOTE [ Applying a plan ] Rule 7)."""
    mine, *rest = plan.measurements
    took = bool(rest) and plan.simple == rest[0].what
    line = f"measured: plan{f' ({plan.simple})' if plan.simple and not took else ''} {mine.step_time * 1e3:.1f} ms"
    if not rest:
        return line + ("" if plan.simple else "; no simple policy fits the budget")
    s = rest[0]
    line += f", {s.what} {s.step_time * 1e3:.1f} ms"
    if not s.fits:
        line += f" at {format_bytes(s.peak_bytes)}, over the budget"
    return line + (f": took {s.what}" if took else ": kept the plan")

def _details(plan: Any, b: Any) -> list[str]:
    """``summary(verbose=True)``'s lines under block ``b``: its kept ops, its parts, its tensors sent to host."""
    lines = []
    if b.keep_ops:
        names = ", ".join(f"{n.replace('aten.', '').replace('.default', '')}#{k}"
                          for n, k in zip(b.keep_names, b.keep_ops))
        lines.append(f"    keeps {format_bytes(b.keep_bytes)} of op outputs{' on the host' if b.host else ''}"
                     f"{(' compressed' + (' (lossy)' if plan.lossy else '')) if b.compress else ''} "
                     f"instead of recomputing them ({b.keep_s * 1e3:.2f} ms): {names}")
    if b.parts:
        sizes = part_bytes([t.nbytes for t in b.tensors], b.parts)
        lines.append(f"    parts cut before saved tensors {', '.join(map(str, b.parts))}: "
                     f"{', '.join(format_bytes_apart(*sizes))}, one held at a time")
    if b.mode == "offload":
        moved = [(k, b.tensors[k]) for k in b.offload]
        small = max(t.nbytes for _, t in moved) / _SMALL_DIV  # smaller tensors: one line for all of them
        lossy = " (lossy)" if b.compress and plan.lossy else ""
        for k, t in moved:
            if t.nbytes >= small:
                lines.append(f"    tensor {k:<3} {str(list(t.shape)):<28} {t.dtype:<9} {format_bytes(t.nbytes):>10} "
                             f"to host{lossy}")
        rest = [t.nbytes for _, t in moved if t.nbytes < small]
        if rest:
            lines.append(f"    and {len(rest)} tensor{'s' if len(rest) > 1 else ''} under "
                         f"{format_bytes(small)} each: {format_bytes(sum(rest))} to host{lossy}")
    return lines
