"""NOTE [ Mechanism costs ] Rules 12 and 15 under random chains and measurements: the byte term solved from the
floor's plan in parts makes that plan predict what it measured wherever a term may (more than 3% over a prediction
in its forward, or any excess at a backward), never moves a plan without parts, and is never lowered for an excess."""
from __future__ import annotations

import dataclasses

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from torchckpt.planner.calibrate import PARTS_FLOOR, calibrate, parts_floor
from torchckpt.planner.costs import predict
from torchckpt.planner.optimize import search, simple_policies

from test_optimize import _chain as parts_chain

MiB = 1 << 20


@settings(max_examples=80, deadline=None)
@given(n=st.integers(3, 7), other_mib=st.integers(0, 2000), bwd_mib=st.integers(0, 800),
       excess=st.floats(-0.15, 0.3), last_whole=st.booleans())
def test_the_parts_term_predicts_what_the_floor_measured(n: int, other_mib: int, bwd_mib: int, excess: float,
                                                         last_whole: bool) -> None:
    base = parts_chain(n, parts=True)
    chain = dataclasses.replace(base, other_saved_bytes=other_mib * MiB,
                                blocks=tuple(dataclasses.replace(b, bwd_bytes=bwd_mib * MiB) for b in base.blocks))
    plan = parts_floor(chain)
    assume(plan is not None)
    assert plan is not None
    if last_whole:  # a block recomputed whole among blocks in parts: the term does not act there
        plan = plan[:-1] + (dataclasses.replace(plan[-1], parts=()),)
    p = predict(chain, plan)
    measured = int(p.peak_bytes * (1 + excess))
    cal = calibrate(chain, simple_policies(chain), {PARTS_FLOOR: (measured, 0.0)})
    q = predict(cal, plan)
    tol = measured // 1000
    if excess > 0:
        assert cal.parts_bytes >= 0
    if excess > 0.031:  # far over: met, wherever the prediction's peak was
        assert abs(q.peak_bytes - measured) <= tol, (p.at, q.at, p.peak_bytes, q.peak_bytes, measured)
    if p.at.startswith("forward") and -0.029 < excess < 0.029:  # near a forward's prediction: left
        assert cal.parts_bytes == 0
    if excess > 0:
        assert q.peak_bytes <= measured + tol  # never past what was measured
    whole = [d for d, _ in search(chain).plans if not any(x.parts for x in d)][:20]
    assert all(predict(cal, d).peak_bytes == predict(chain, d).peak_bytes for d in whole)
