"""Differential fuzzer: random programs under every policy and store setting, bit for bit against
plain autograd.

Design (details and the rules the interpreter follows: tests/fuzz_programs.py, NOTE [ Fuzzer
semantics ]):

- **Programs.** hypothesis draws a ``Program``: 1-3 leaf inputs that require grad (float32 or
  float64, a few dozen elements each), up to ``TORCHCKPT_FUZZ_MAX_OPS`` ops, optional cuts into
  segments, a seed. Every value left at the end enters a scalar loss with fixed random weights.
- **Vocabulary.** views (view/reshape, transpose/permute/mT, slicing with steps, unbind, chunk,
  ``unsafe_chunk``/``unsafe_split``, split, expand, ``as_strided`` with and without overlap, dtype
  views: int round trips, float32 storage read as float64); in-place ops (add_, mul_, sigmoid_,
  tanh_, addcmul_, div_, clamp_, exp_, in-place dropout) on non-leaf tensors, on views of them
  (slices, ``unsafe_chunk`` pieces, transposes) and through ``.data`` (no version counter
  moves); gates split with ``unsafe_chunk`` and activated in place as ATen's LSTM/GRU cells do; complex values (``view_as_complex``, ``.real``/``.imag``,
  ``.conj()``, ``.conj().imag`` with its neg bit, products with conj views, ``m @ m.mH``,
  ``torch.fft.rfft``/``irfft`` as in a Fourier neural operator's spectral convolution);
  nn.GRUCell, nn.LSTMCell, nn.GRU, nn.LSTM (in the program's float32 or float64); casts to
  float64/float32/bfloat16/float16; ``F.scaled_dot_product_attention`` (causal or not, with
  dropout, or with ``dropout_p=0`` and now and then a dropout after it); batch norm
  (nn.BatchNorm1d and ``F.batch_norm``, train mode); dropout; unary, binary,
  matmul, linear, layer norm, softmax, logsumexp. Deliberately invalid programs (rarely): a
  tensor autograd saved is modified in place afterwards (``clobber``).
- **Settings** (``fuzz_programs.default_settings()``): ``torchckpt.offload(store)`` around the
  whole program with every store configuration; ``checkpoint(fn, *args, policy=...)`` per segment
  with ``Offload(store)``, ``Offload(store, tensors=...)`` (every other saved tensor, the planner's per-tensor
  decisions), ``Offload(store, codec=Identity())``, ``Recompute()``,
  ``Recompute(store=store)``, ``Recompute(reentrant=True)`` (the program's parameters handed over as a module's),
  ``Keep()``; ``Recompute(save=...)`` keeping matmul and attention outputs
  (the fused kernels with ``dropout_p=0``, each followed by a dropout now and then) or every op it can, through
  the store or not, and compressed on the way (``Recompute(codec=Identity())``); ``Recompute(parts=...)`` (one to
  three parts, alone, with a store, with ``save=``), bit for bit against torch's whole recomputation; nested: a
  Recompute block inside
  an ``offload()`` region and inside an ``Offload`` block, an Offload block inside a Recompute block; one
  policy per segment; ``torchckpt.checkpoint_chain`` (NOTE [ Fuzzer semantics ] Rule 10): the segments as
  nn.Modules run as a chain (each block's state the previous block's first output) with 1..n snapshots drawn from
  the program's seed, under ``Recompute()`` or a mix per block of ``Recompute()``, ``Recompute(save=...)`` and
  ``Recompute(parts=...)``; and programs that leave the chain (every value passed in order, or one state's
  version bumped or the state replaced by a view before a block), which must warn and still give the bits.
  Store configurations (``fuzz_programs.STORES``): resident (64 MiB
  budget), evicted (``gpu_bytes=0``), a budget of a few tensors (some evicted), ``min_bytes``
  that keeps the small ones, the identity codec (evicted and with a budget), prefetch off.
  Each store runs the program 3 times: step 1 records the trace, steps 2-3 follow the plan.
  A chain setting runs the program twice on one chain (the plain form) or once, and ``remove()`` at the end.
- **Comparison.** Every value, the loss and every gradient (inputs and parameters), compared as
  bytes (NaN and -0.0 included), with dtype, shape and conj/neg flags, against the setting's
  *twin* (the same layout with the store replaced by hooks that keep tensors by reference and
  check their version as autograd does). Each twin is checked against plain autograd: bit for
  bit, or, with a Recompute block, gradients within 1% of their largest magnitude, since
  torch.utils.checkpoint may sum gradient contributions in another order. When plain
  autograd raises "...modified by an inplace operation", the setting must raise that too
  (inside a Recompute block torch.utils.checkpoint recomputes and raises nothing; the twin
  says so). Batch norm's running statistics are not compared: the vocabulary's batch norm modules are not
  submodules of the wrapped blocks, whose buffers alone Recompute puts back (NOTE [ Buffers written in a
  forward ] Rule 4); tests/recompute/test_buffers.py compares them for every form of recomputation.
- **Leaks** (NOTE [ Fuzzer semantics ] Rule 11). After its steps, every setting runs the forward once more
  and drops it without a backward (a dropped loss, evaluation with grad enabled): every tensor that forward
  took or made (leaves, parameters, every value) must be freed once the last reference is gone (weak
  references; ``gc.collect()`` first if any is alive), and the setting's store must hold no entry. A pack hook that
  keeps an op's output with its ``grad_fn`` makes a cycle through C++ that is never freed (NOTE [ Saved
  tensor identity ] Rule 5); a backward would have broken it, so the steps alone never see it.

Running longer (the GPU machine)::

    TORCHCKPT_FUZZ_EXAMPLES=5000 TORCHCKPT_FUZZ_SEED=1 python -m pytest -q tests/test_fuzz.py

``TORCHCKPT_FUZZ_EXAMPLES`` (default 500: about 2 minutes on the 2-core CPU machine; on an H100
the CUDA test runs about 2.7 programs a second) sets the
number of programs per test, ``TORCHCKPT_FUZZ_SEED`` (default 0) picks another reproducible
stream, ``TORCHCKPT_FUZZ_MAX_OPS`` (default 8) the longest program. The CUDA test runs the same
programs with ``Store(device="cuda", ...)`` and tensors on the GPU.

Reproducing a failure: the assertion message holds the program's ``repr`` and the failing
settings, and a listing of the program as it ran; paste them back::

    import sys; sys.path.insert(0, "tests")
    from fuzz_programs import *
    print("\\n".join(check(Program(ops=(Op('conj', 0, 0, 2),)), settings=[Setting('ctx', 'resident')])))
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, note, seed, settings

import fuzz_programs as fz
import torchckpt
from fuzz_programs import Op, Program, Setting
from torchckpt.codecs import Identity
from torchckpt.recompute import chain, parts, selective
from torchckpt.store import identity

EXAMPLES = int(os.environ.get("TORCHCKPT_FUZZ_EXAMPLES", "500"))
SEED = int(os.environ.get("TORCHCKPT_FUZZ_SEED", "0"))
MAX_OPS = int(os.environ.get("TORCHCKPT_FUZZ_MAX_OPS", "8"))

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # reproducible: the stream depends only on the seed
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# The cases of issue 11 as programs: each failed on the store before its fix.
KNOWN = [
    Program(ops=(Op("rnn", 0, 0, 0),), dtype="float64"),  # nn.GRUCell: unsafe_chunk gates shared one entry
    Program(ops=(Op("rnn", 0, 0, 1),), dtype="float64"),  # nn.LSTMCell
    Program(ops=(Op("rnn", 0, 0, 2),), dtype="float64"),  # nn.GRU
    Program(ops=(Op("rnn", 0, 0, 3),), dtype="float64"),  # nn.LSTM
    Program(ops=(Op("lstm_cell", 0, 0, 0),)),  # gates activated in place, by hand
    Program(ops=(Op("conj", 0, 0, 2),)),  # x * w.conj(): the conj bit was lost on unpack
    Program(ops=(Op("conj", 0, 0, 3),)),  # x.conj().imag * y: the neg bit
    Program(ops=(Op("conj", 0, 0, 4),)),  # m @ m.mH
    Program(ops=(Op("clobber", 0, 0, 0),)),  # a saved tensor modified in place: no error was raised
    Program(ops=(Op("clobber", 0, 0, 2),)),  # ... through a detached int32 view
    Program(ops=(Op("clobber", 0, 0, 3),)),  # ... an unsafe_chunk piece
    # Rows saved, other rows written through .data (no counter moves), then saved: the second save
    # shared the first one's whole-storage entry and came back stale once evicted (torchdiffeq).
    Program(ops=(Op("binary", 0, 0, 0), Op("slice", 0, 0, 4), Op("unary", 0, 0, 0), Op("inplace", 2, 0, 49),
                 Op("slice", 4, 0, 28), Op("unary", 0, 0, 0))),
    # Recompute(save=...) (issue 13): each failed before its fix. A kept view (chunk) or a kept output sharing an
    # input's memory (unsafe_chunk of an as_strided view) stood in for one made from the recomputed input.
    Program(ops=(Op("clobber", 0, 0, 0), Op("chunk", 0, 0, 0), Op("slice", 0, 0, 0), Op("inplace", 0, 0, 1, clobber=True))),
    Program(ops=(Op("clobber", 0, 0, 0), Op("as_strided", 0, 0, 0), Op("unsafe_chunk", 2, 0, 0),
                 Op("inplace", 0, 0, 1, clobber=True))),
    # An attention kernel with dropout_p=0 kept by Recompute(save=...) (compressed, in rec_save_codec), then a
    # dropout: the recomputation must draw the forward's mask (NOTE [ Fuzzer semantics ] Rules 7-8).
    Program(ops=(Op("sdpa", 0, 0, 5), Op("matmul", 0, 0, 2)), dtype="float64"),
    # checkpoint_chain (NOTE [ Fuzzer semantics ] Rule 10): four blocks, dropout in block 0 and a kept attention kernel
    # in block 1; seed 10 draws one snapshot for the chain form (blocks 1-2's inputs rebuilt from block 0's), parts and
    # save= in chain_mixed.
    Program(ops=(Op("dropout", 0, 0, 1), Op("sdpa", 0, 0, 5), Op("unary", 0, 0, 1), Op("matmul", 0, 0, 2)),
            dtype="float64", cuts=(1, 2, 3), seed=10),
    # checkpoint_chain bug 1 (found by the fuzzer's chain_break_alias setting): a chain state modified in place after
    # its block ran was handed to the block's recomputation with no version check. Block 1 returns a view of its
    # input, whose version is bumped before block 2; per-block Recompute() raises "modified by an inplace
    # operation", the chain raised nothing (and with a real write, v2.mul_(2), gave wrong gradients). Fixed by
    # NOTE [ Chain of blocks ] Rule 10; test_chain_bug_1_stays_fixed runs it under chain_break_alias.
    Program(ops=(Op("unary", 0, 0, 0), Op("slice", 0, 0, 0), Op("unary", 1, 0, 0), Op("unary", 1, 0, 1)), cuts=(1, 3)),
    # tanh saves its output; under the min_bytes store it is kept by reference, and was held with its grad_fn: a
    # forward not followed by a backward was never freed (NOTE [ Saved tensor identity ] Rule 5;
    # NOTE [ Fuzzer semantics ] Rule 11).
    Program(ops=(Op("unary", 0, 0, 1),)),
    # Plain autograd's own leak (NOTE [ Fuzzer semantics ] Rule 11, seed 7): batch norm's input written in place after
    # it was saved; the forward-only check had blamed Keep(), which runs it as plain autograd does.
    Program(ops=(Op("clobber", 0, 0, 0), Op("batch_norm", 0, 0, 0), Op("inplace", 1, 0, 0, clobber=True))),
]


def _check(prog: Program, device: str) -> None:
    note(repr(prog))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # casts of complex to real, checkpoint's notices
        problems = fz.check(prog, device=device)
    if problems:
        raise AssertionError(fz.report(prog, problems, device))


def _with_known(test):  # type: ignore[no-untyped-def]
    for prog in KNOWN:
        test = example(prog=prog)(test)
    return test


@seed(SEED)
@FUZZ
@_with_known
@given(prog=fz.programs(max_ops=MAX_OPS))
def test_fuzz_cpu(prog: Program) -> None:
    _check(prog, "cpu")


@pytest.mark.cuda
@seed(SEED)
@FUZZ
@_with_known
@given(prog=fz.programs(max_ops=MAX_OPS))
def test_fuzz_cuda(prog: Program) -> None:
    _check(prog, "cuda")


# -- the fuzzer can fail --------------------------------------------------------------------------
def test_fuzzer_catches_a_wrong_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that gives back one wrong element is reported for every setting that uses it."""
    unpack = torchckpt.Store.unpack

    def bad_unpack(self, h):  # type: ignore[no-untyped-def]
        t = unpack(self, h)
        if t.is_floating_point() and t.numel() > 1 and not isinstance(h, torch.Tensor):
            t = t.clone()
            t.view(-1)[0] += 1
        return t

    monkeypatch.setattr(torchckpt.Store, "unpack", bad_unpack)
    problems = fz.check(Program(ops=(Op("unary", 0, 0, 0), Op("unary", 0, 0, 1)), shapes=((4, 6),)))
    failing = {p.split(" step")[0] for p in problems if p.startswith("Setting(")}
    assert "Setting('ctx', 'evicted')" in failing and "Setting('off', 'resident')" in failing
    assert not any(p.startswith("Setting('rec',") or p.startswith("Setting('keep',") for p in problems)


def test_fuzzer_catches_a_missing_version_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that keeps tensors by reference without their version check is reported."""
    monkeypatch.setattr(torchckpt.Store, "pack", lambda self, t, *a, **k: t.detach())
    monkeypatch.setattr(torchckpt.Store, "unpack", lambda self, t: t)
    problems = fz.check(Program(ops=(Op("clobber", 0, 0, 0),)), settings=[Setting("ctx", "resident")])
    assert any("raised nothing where the reference raised" in p for p in problems), problems


def test_fuzzer_catches_a_graph_held_by_a_kept_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor kept by reference held as the op's output itself, not detached (the bug NOTE [ Saved tensor
    identity ] Rule 5 fixed): the forward run without a backward is never freed, reported for the settings that keep
    tensors by reference (min_bytes keeps the small ones, off_some every other one) and no other; every value and
    gradient still agrees."""
    init = identity.Kept.__init__

    def leaky_init(self, t):  # type: ignore[no-untyped-def]
        init(self, t)
        self.tensor = t  # the saved tensor itself: its grad_fn holds the packed value, which holds it

    prog = Program(ops=(Op("unary", 0, 0, 1), Op("unary", 0, 0, 1)))  # tanh saves its output (96 bytes: small)
    settings = [Setting("ctx", "min_bytes"), Setting("off_some", "evicted"), Setting("ctx", "evicted"),
                Setting("rec"), Setting("keep")]
    assert not fz.check(prog, settings=settings)
    monkeypatch.setattr(identity.Kept, "__init__", leaky_init)
    problems = fz.check(prog, settings=settings)
    failing = {p.split(" step")[0] for p in problems if p.startswith("Setting(")}
    assert failing == {"Setting('ctx', 'min_bytes')", "Setting('off_some', 'evicted')"}, problems
    assert all(" step 4 (forward only): " in p for p in problems if p.startswith("Setting(")), problems
    assert any("v2 (TanhBackward0 float32[4, 6])" in p for p in problems), problems


def test_fuzzer_catches_a_lossy_codec_on_kept_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recompute(save=..., codec=Identity()) sends the kept outputs through the codec: an identity codec that gives
    back one wrong element is reported for those settings, not for the ones that keep them uncompressed."""
    decompress = Identity.decompress

    def bad_decompress(self, p, out=None, stream=None):  # type: ignore[no-untyped-def]
        t = decompress(self, p, out, stream)
        if t.is_floating_point() and t.numel() > 1:
            t.view(-1)[0] += 1
        return t

    monkeypatch.setattr(Identity, "decompress", bad_decompress)
    settings = [Setting("rec_save", "evicted"), Setting("rec_save_codec", "evicted"),
                Setting("rec_save_all_codec", "evicted")]
    problems = fz.check(Program(ops=(Op("sdpa", 0, 0, 0), Op("matmul", 0, 0, 2)), dtype="float64"), settings=settings)
    failing = {p.split(" step")[0] for p in problems if p.startswith("Setting(")}
    assert failing == {"Setting('rec_save_codec', 'evicted')", "Setting('rec_save_all_codec', 'evicted')"}, problems


def test_fuzzer_catches_a_wrong_rng_replay_around_a_kept_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recomputation that moves the generator where it hands back a kept attention output (as a kernel that drew
    in the forward would) draws another dropout mask after it: reported against plain autograd."""
    reuse = selective._Reusing.op

    def bad_op(self, k, func, args, kwargs):  # type: ignore[no-untyped-def]
        if k in self.cache and func in fz.ATTN_OPS:
            torch.rand(1)
        return reuse(self, k, func, args, kwargs)

    prog = Program(ops=(Op("sdpa", 0, 0, 4),), dtype="float64")  # dropout_p=0, then a dropout
    assert not fz.check(prog, settings=[Setting("rec_save")])
    monkeypatch.setattr(selective._Reusing, "op", bad_op)
    problems = fz.check(prog, settings=[Setting("rec_save")])
    assert any("vs plain autograd: grad of input0" in p for p in problems), problems


def test_fuzzer_catches_parts_recomputed_without_the_rng_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recomputation in parts that does not restore the RNG state draws other dropout masks than the forward:
    reported for every parts setting against torch's whole recomputation."""
    replay = parts._Frame.replay

    def bad_replay(self, args, kwargs):  # type: ignore[no-untyped-def]
        self.fwd.preserve = False  # the captured RNG state (recompute/forward_state.py) is not restored
        return replay(self, args, kwargs)

    prog = Program(ops=(Op("matmul", 0, 0, 2), Op("dropout", 0, 0, 1), Op("unary", 0, 0, 0)), dtype="float64")
    settings = [Setting("rec_parts"), Setting("rec_parts_store", "evicted"), Setting("rec_parts_save", "budget")]
    assert not fz.check(prog, settings=settings)
    monkeypatch.setattr(parts._Frame, "replay", bad_replay)
    problems = fz.check(prog, settings=settings)
    failing = {p.split(" step")[0] for p in problems if p.startswith("Setting(")}
    assert failing == {repr(s) for s in settings}, problems


def _chain_seed(structure: str, nseg: int, snapshots: int) -> int:
    """A program seed for which ``Setting(structure)`` runs ``nseg`` blocks with ``snapshots``
    (NOTE [ Fuzzer semantics ] Rule 10)."""
    return next(seed for seed in range(1000)
                if Setting(structure).layout(None, nseg, twin=False, seed=seed)[0].snapshots == snapshots)


def test_fuzzer_catches_a_wrong_rebuilt_chain_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain that rebuilds a block's input 1e-3 off is reported for the chain setting, against its twin (per-block
    Recompute()) and so against plain autograd, and for no other setting."""
    run_again = chain.ChainRuntime.run_again

    def bad_run_again(self, rec, x):  # type: ignore[no-untyped-def]
        y = run_again(self, rec, x)
        return y + 1e-3 if y.is_floating_point() else y

    prog = Program(ops=(Op("unary", 0, 0, 0), Op("matmul", 0, 0, 2), Op("unary", 0, 0, 1), Op("binary", 0, 1, 0)),
                   dtype="float64", cuts=(1, 2, 3), seed=_chain_seed("chain", 4, 1))
    settings = [Setting("chain"), Setting("rec"), Setting("rec_parts")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert not fz.check(prog, settings=settings)
        monkeypatch.setattr(chain.ChainRuntime, "run_again", bad_run_again)
        problems = fz.check(prog, settings=settings)
    failing = {p.split(" step")[0] for p in problems if p.startswith("Setting(")}
    assert failing == {"Setting('chain', None)"}, problems
    assert any("grad of input0" in p for p in problems), problems


def test_fuzzer_catches_a_chain_rebuilt_without_the_rng_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain that runs a block with dropout again without restoring the forward's RNG state rebuilds the next
    block's input with another mask: reported."""
    run_again = chain.ChainRuntime.run_again

    def bad_run_again(self, rec, x):  # type: ignore[no-untyped-def]
        rec.state.preserve = False  # the captured RNG state (recompute/forward_state.py) is not restored
        return run_again(self, rec, x)

    prog = Program(ops=(Op("dropout", 0, 0, 1), Op("unary", 0, 0, 0), Op("matmul", 0, 0, 2)), dtype="float64",
                   cuts=(1, 2), seed=_chain_seed("chain", 3, 1))  # block 1's input: block 0's dropout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert not fz.check(prog, settings=[Setting("chain")])
        monkeypatch.setattr(chain.ChainRuntime, "run_again", bad_run_again)
        problems = fz.check(prog, settings=[Setting("chain")])
    assert any(p.startswith("Setting('chain', None) step 1: grad of") for p in problems), problems


def test_chain_settings_run_the_chain() -> None:
    """The chain settings are not vacuous: the chain form rebuilds inputs (advances) and stays in the chain; the loose
    and break forms leave it with a RuntimeWarning; remove() puts the blocks' forwards back."""
    prog = Program(ops=(Op("unary", 0, 0, 0), Op("dropout", 0, 0, 1), Op("unary", 0, 0, 1), Op("binary", 0, 1, 0)),
                   cuts=(1, 2, 3), seed=_chain_seed("chain", 4, 1))
    clones = fz.resolve(prog)
    for structure in ("chain", "chain_loose", "chain_break"):
        layout = Setting(structure).layout(None, 4, twin=False, seed=prog.seed)
        run = layout[0]
        assert isinstance(run, fz.ChainRun)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = fz.run(prog, layout, clones)
            assert out.error is None, out.error
            assert run.chain is not None and not run.notes
            stats = run.chain.stats
            warned = any(issubclass(w.category, RuntimeWarning) and "checkpoint_chain" in str(w.message)
                         for w in caught)
            assert warned == (structure != "chain") == (stats.broken > 0), (structure, stats)
            if structure == "chain":
                assert stats.steps == 1 and stats.advances > 0 and stats.handed == 4, stats
        finally:
            run.close()
        assert all("forward" not in b.__dict__ for b in run.blocks)


def test_chain_bug_1_stays_fixed() -> None:
    """KNOWN's checkpoint_chain bug 1 under the setting that showed it (chain_break_alias bumps the version of a state
    that is a view's base; not among the defaults: on a multi-output view, chunk or split, autograd refuses the bump
    in the reference run itself)."""
    prog = KNOWN[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        problems = fz.check(prog, settings=[Setting("chain_break_alias")])
    assert not problems, fz.report(prog, problems)


def test_invalid_program_raises_in_plain_autograd() -> None:
    """A clobber program is invalid for plain autograd and its twins; a clone makes it valid."""
    p = Program(ops=(Op("clobber", 0, 0, 0),))
    out = fz.run(p, fz.PLAIN, fz.resolve(p))
    assert out.error is not None and fz.VERSION_PHRASE in out.error[1]
    p = Program(ops=(Op("unary", 0, 0, 2), Op("inplace", 0, 0, 3)))  # sigmoid, then mul_ of its result
    assert fz.resolve(p) == frozenset({1})
    assert fz.run(p, fz.PLAIN, fz.resolve(p)).error is None
    p = Program(ops=(Op("unary", 0, 0, 2), Op("inplace", 0, 0, 3, clobber=True)))
    err = fz.run(p, fz.PLAIN, fz.resolve(p)).error
    assert err is not None and fz.VERSION_PHRASE in err[1]


def test_program_repr_round_trips() -> None:
    p = Program(ops=(Op("rnn", 1, 2, 3), Op("inplace", 0, 0, 5, clobber=True)), dtype="float64",
                shapes=((4, 6), (8,)), cuts=(1,), seed=7)
    assert eval(repr(p), {"Program": Program, "Op": Op}) == p
