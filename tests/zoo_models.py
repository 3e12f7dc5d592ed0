"""Models torchckpt's authors did not write, built tiny from configs with random weights (tests/test_zoo.py).

Each ``Zoo`` entry says how to build the model and a batch (nothing is downloaded), how to get
a loss from them, and which of the model's modules are its repeated blocks (what a user would
wrap with ``torchckpt.checkpoint``). The packages (transformers, timm, torchvision, torchdiffeq)
are not torchckpt dependencies: ``Zoo.package`` names the one the entry needs, and the tests
skip the entry when it is missing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

Batch = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Zoo:
    """One model of the zoo.

    Args:
        name: test id.
        package: the import the entry needs (skipped without it).
        build: ``build()`` -> a fresh model (seeded, on the CPU) and a batch.
        loss: ``loss(model, batch, use_cache)`` -> a scalar; ``use_cache`` is False under
            ``Recompute`` (transformers' KV cache would be written twice).
        blocks: ``blocks(model)`` -> the repeated blocks to wrap one by one.
        blocks_in_backward: the blocks save nothing in the forward and run again inside
            backward (``odeint_adjoint`` solves under no_grad, then differentiates the vector
            field during backward, where a store keeps what is saved: NOTE [ Store ] Rule 1).
        train: run in train mode (dropout, stochastic depth, batch statistics).
        hf: a transformers model, with its own gradient-checkpointing hook.
    """

    name: str
    package: str
    build: Callable[[], tuple[nn.Module, Batch]]
    loss: Callable[[nn.Module, Batch, bool], torch.Tensor]
    blocks: Callable[[Any], list[nn.Module]]  # Any: reads the model's own attributes
    blocks_in_backward: bool = False
    train: bool = True
    hf: bool = False


def _ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _image(batch: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(batch, 3, size, size, generator=g)


def _labels(batch: int, classes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, classes, (batch,), generator=g)


# -- transformers -------------------------------------------------------------------------
VOCAB, SEQ = 64, 16


def _gpt2() -> tuple[nn.Module, Batch]:
    import transformers

    torch.manual_seed(10)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )
    return transformers.GPT2LMHeadModel(cfg), {"ids": _ids(2, SEQ, VOCAB)}


def _llama() -> tuple[nn.Module, Batch]:
    import transformers

    torch.manual_seed(11)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, attention_dropout=0.1,
    )
    return transformers.LlamaForCausalLM(cfg), {"ids": _ids(2, SEQ, VOCAB)}


def _mixtral() -> tuple[nn.Module, Batch]:
    # Experts with a fused gate/up projection: SiLU and the product save the two halves of one storage from two
    # nodes (NOTE [ Saved tensor identity ] Rule 2c).
    import transformers

    torch.manual_seed(13)
    cfg = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
    )
    return transformers.MixtralForCausalLM(cfg), {"ids": _ids(2, SEQ, VOCAB)}


def _bert() -> tuple[nn.Module, Batch]:
    import transformers

    torch.manual_seed(12)
    cfg = transformers.BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ,
    )
    return transformers.BertForMaskedLM(cfg), {"ids": _ids(2, SEQ, VOCAB)}


def _causal_lm_loss(model: nn.Module, b: Batch, use_cache: bool) -> torch.Tensor:
    return model(input_ids=b["ids"], labels=b["ids"], use_cache=use_cache).loss


def _masked_lm_loss(model: nn.Module, b: Batch, use_cache: bool) -> torch.Tensor:
    return model(input_ids=b["ids"], labels=b["ids"]).loss


# -- timm ---------------------------------------------------------------------------------
def _vit() -> tuple[nn.Module, Batch]:
    import timm

    torch.manual_seed(20)
    m = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2,
        num_heads=2, num_classes=5, proj_drop_rate=0.1, drop_path_rate=0.1,
    )
    return m, {"x": _image(2, 32), "y": _labels(2, 5)}


def _swin() -> tuple[nn.Module, Batch]:
    import timm

    torch.manual_seed(21)
    m = timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, img_size=32, patch_size=4, window_size=4,
        embed_dim=16, depths=(2, 2), num_heads=(1, 2), num_classes=5, drop_path_rate=0.1,
    )
    return m, {"x": _image(2, 32), "y": _labels(2, 5)}


# -- torchvision --------------------------------------------------------------------------
def _resnet18() -> tuple[nn.Module, Batch]:
    import torchvision

    torch.manual_seed(30)
    return torchvision.models.resnet18(num_classes=5), {"x": _image(2, 16), "y": _labels(2, 5)}


def _mobilenet() -> tuple[nn.Module, Batch]:
    import torchvision

    torch.manual_seed(31)
    return torchvision.models.mobilenet_v3_small(num_classes=5), {"x": _image(2, 32), "y": _labels(2, 5)}


def _convnext() -> tuple[nn.Module, Batch]:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    torch.manual_seed(32)
    setting = [CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 2)]
    m = ConvNeXt(setting, stochastic_depth_prob=0.2, layer_scale=0.5, num_classes=5)
    return m, {"x": _image(2, 32), "y": _labels(2, 5)}


def _classify_loss(model: nn.Module, b: Batch, use_cache: bool) -> torch.Tensor:
    return nn.functional.cross_entropy(model(b["x"]), b["y"])


def _cnblocks(model: Any) -> list[nn.Module]:
    from torchvision.models.convnext import CNBlock

    return [m for m in model.modules() if isinstance(m, CNBlock)]


# -- torchdiffeq --------------------------------------------------------------------------
class VectorField(nn.Module):
    """dy/dt = f(t, y): a small MLP taking time as an input."""

    def __init__(self, d: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d + 1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, d))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([y, t.expand(*y.shape[:-1], 1)], -1))


class NeuralODE(nn.Module):
    """Integrates ``VectorField`` with torchdiffeq's ``odeint`` (or ``odeint_adjoint``)."""

    def __init__(self, adjoint: bool, method: str) -> None:
        super().__init__()
        self.func = VectorField()
        self.adjoint = adjoint
        self.method = method

    def forward(self, y0: torch.Tensor) -> torch.Tensor:
        import torchdiffeq

        t = torch.linspace(0.0, 0.5, 3, dtype=y0.dtype, device=y0.device)
        solve = torchdiffeq.odeint_adjoint if self.adjoint else torchdiffeq.odeint
        opts = {"step_size": 0.125} if self.method == "rk4" else {}
        return solve(self.func, y0, t, method=self.method, rtol=1e-5, atol=1e-7, options=opts)


def _ode(adjoint: bool, method: str) -> Callable[[], tuple[nn.Module, Batch]]:
    def build() -> tuple[nn.Module, Batch]:
        torch.manual_seed(40)
        m = NeuralODE(adjoint, method).double()
        g = torch.Generator().manual_seed(1234)
        return m, {"y0": torch.randn(8, 4, generator=g, dtype=torch.float64)}

    return build


def _ode_loss(model: nn.Module, b: Batch, use_cache: bool) -> torch.Tensor:
    return (model(b["y0"]) ** 2).mean()


ZOO: list[Zoo] = [
    Zoo("gpt2", "transformers", _gpt2, _causal_lm_loss, lambda m: list(m.transformer.h), hf=True),
    Zoo("llama", "transformers", _llama, _causal_lm_loss, lambda m: list(m.model.layers), hf=True),
    Zoo("mixtral", "transformers", _mixtral, _causal_lm_loss, lambda m: list(m.model.layers), hf=True),
    Zoo("bert", "transformers", _bert, _masked_lm_loss, lambda m: list(m.bert.encoder.layer), hf=True),
    Zoo("vit", "timm", _vit, _classify_loss, lambda m: list(m.blocks)),
    Zoo("swin", "timm", _swin, _classify_loss, lambda m: [b for layer in m.layers for b in layer.blocks]),
    Zoo("resnet18", "torchvision", _resnet18, _classify_loss, lambda m: [m.layer1, m.layer2, m.layer3, m.layer4]),
    Zoo("mobilenet_v3", "torchvision", _mobilenet, _classify_loss, lambda m: list(m.features)[1:]),
    Zoo("convnext", "torchvision", _convnext, _classify_loss, _cnblocks),
    Zoo("ode_dopri5", "torchdiffeq", _ode(False, "dopri5"), _ode_loss, lambda m: [m.func]),
    Zoo("ode_rk4", "torchdiffeq", _ode(False, "rk4"), _ode_loss, lambda m: [m.func]),
    Zoo("ode_adjoint", "torchdiffeq", _ode(True, "dopri5"), _ode_loss, lambda m: [m.func], blocks_in_backward=True),
]
BY_NAME: dict[str, Zoo] = {z.name: z for z in ZOO}


def available(z: Zoo) -> bool:
    """Whether ``z``'s package imports here."""
    try:
        importlib.import_module(z.package)
    except ImportError:
        return False
    return True


def to(batch: Batch, device: Any) -> Batch:
    return {k: v.to(device) for k, v in batch.items()}


@contextlib.contextmanager
def deterministic_cuda() -> Iterator[None]:
    """Plain autograd on the GPU reproducible run to run, so that ``torch.equal`` is meaningful."""
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old
