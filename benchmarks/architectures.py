"""The model zoo of ``benchmarks/zoo.py``: real architectures built from configs, with random weights.

Each builder takes a size and a device and returns a ``Built``: the model (seeded, nothing downloaded), the batch
it is called with (``model(*args, **kwargs)``), the loss of its output, its repeated blocks (what each library's own
checkpointing wraps: decoder layers, T5's encoder then decoder blocks, timm's ``blocks``, ConvNeXt's blocks across
stages, ResNet's Bottlenecks across layer1..layer4) and how to turn that library checkpointing on.

Sizes:
  train  one H100 80 GB, bf16 weights: a step without checkpointing holds >= 8 GiB of activations above its
         start and stays well under ~60 GiB in all (parameters, gradients, activations); each builder states
         its estimate.
  tiny   the CPU, fp32, a few MB of parameters, a step well under a second (tests).

The packages (transformers, timm, torchvision) are not torchckpt dependencies; ``PACKAGE`` names the one each
entry needs.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ARCHS", "PACKAGE", "Built", "build", "wrap_blocks"]

Undo = Callable[[], None]


@dataclasses.dataclass
class Built:
    """A model of the zoo, ready to train.

    Attributes:
        model: the model, in training mode, on its device.
        args / kwargs: the batch: ``model(*args, **kwargs)``.
        loss: the model's output -> a scalar loss.
        blocks: the repeated blocks, in forward order.
        library: turns the library's own checkpointing on; returns what turns it off.
        note: the configuration and batch in words.
    """

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss: Callable[[Any], torch.Tensor]
    blocks: list[nn.Module]
    library: Callable[[], Undo]
    note: str

    def step(self) -> None:
        """One training step: the loss's backward, then the gradients dropped (``zero_grad(set_to_none=True)``)."""
        self.loss(self.model(*self.args, **self.kwargs)).backward()
        self.model.zero_grad(set_to_none=True)

    def timed_steps(self, reps: int, warm: int) -> tuple[list[float], list[float], list[float]]:
        """``warm`` untimed steps, then ``reps`` timed ones (CUDA), each between two synchronisations: their wall
        times, and their forwards' and backwards' device times (CUDA events), in seconds."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        tot: list[float] = []
        fwd: list[float] = []
        bwd: list[float] = []
        for r in range(reps + warm):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ev[0].record()
            loss = self.loss(self.model(*self.args, **self.kwargs))
            ev[1].record()
            loss.backward()
            ev[2].record()
            del loss
            self.model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if r >= warm:
                tot.append(time.perf_counter() - t0)
                fwd.append(ev[0].elapsed_time(ev[1]) / 1e3)
                bwd.append(ev[1].elapsed_time(ev[2]) / 1e3)
        return tot, fwd, bwd


def wrap_blocks(blocks: list[nn.Module], make: Callable[[int, Callable[..., Any]], Callable[..., Any] | None]) -> Undo:
    """Replace each block's ``forward`` by ``make(index, forward)`` (``None``: left as it is); returns the undo,
    which puts every forward back as it was (an instance attribute or the class's)."""
    undo = []
    for i, m in enumerate(blocks):
        had, prev = "forward" in m.__dict__, m.__dict__.get("forward")
        new = make(i, m.forward)
        if new is None:
            continue
        object.__setattr__(m, "forward", new)
        undo.append((m, had, prev))

    def remove() -> None:
        for m, had, prev in reversed(undo):
            if had:
                object.__setattr__(m, "forward", prev)
            else:
                m.__dict__.pop("forward", None)
        undo.clear()

    return remove


def torch_checkpoint(forward: Callable[..., Any], context_fn: Any = None) -> Callable[..., Any]:
    """``forward`` under ``torch.utils.checkpoint`` (non-reentrant; with ``context_fn``: torch SAC)."""
    extra = {"context_fn": context_fn} if context_fn is not None else {}

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


# -- helpers -------------------------------------------------------------------------------
def _ids(batch: int, seq: int, vocab: int, device: torch.device, seed: int = 1234) -> torch.Tensor:
    g = torch.Generator("cpu").manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g, device="cpu").to(device)


def _images(batch: int, size: int, classes: int, device: torch.device, dtype: torch.dtype,
            channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator("cpu").manual_seed(1234)
    x = torch.randn(batch, 3, size, size, generator=g, device="cpu").to(device, dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, classes, (batch,), generator=g, device="cpu").to(device)


def _place(model: nn.Module, device: torch.device, dtype: torch.dtype, channels_last: bool = False) -> Any:
    model = model.to(device, dtype)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return model.train()


def _hf(model: Any) -> Callable[[], Undo]:
    """transformers' own checkpointing, non-reentrant: ``activation_checkpointing_enable`` where it exists (5.x, the
    new name of ``gradient_checkpointing_enable``, which warns that it is deprecated), else the old name."""
    def on() -> Undo:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            return model.activation_checkpointing_disable  # type: ignore[no-any-return]
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.gradient_checkpointing_disable  # type: ignore[no-any-return]

    return on


def _timm(model: Any) -> Callable[[], Undo]:
    def on() -> Undo:
        model.set_grad_checkpointing(True)
        return lambda: model.set_grad_checkpointing(False)

    return on


def _per_block(blocks: list[nn.Module]) -> Callable[[], Undo]:
    """torchvision has no switch of its own: ``torch.utils.checkpoint`` on each block, as its users write it."""
    return lambda: wrap_blocks(blocks, lambda i, f: torch_checkpoint(f))


def _lm_loss(out: Any) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


def _ce(labels: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    return lambda out: nn.functional.cross_entropy(out.float(), labels)


def _causal_lm(model: nn.Module, layers: Any, ids: torch.Tensor, note: str) -> Built:
    return Built(model, (), {"input_ids": ids, "labels": ids, "use_cache": False}, _lm_loss, list(layers), _hf(model),
                 note)


# -- transformers decoders -----------------------------------------------------------------
# Estimates for the 2048-wide decoders at batch 4 x 2048 (8192 tokens, bf16): each layer saves ~55k values a token
# (norms with their fp32 copies, q/k/v, rotary, attention, the MLP's 4 x 5632), ~0.9 GiB a layer, 16 layers
# ~14 GiB, logits and their fp32 loss ~2.5 GiB: ~16-17 GiB of activations; ~1B parameters, 1.9 GiB in bf16, as
# much again for the gradients: ~21 GiB in all.
def llama(size: str, device: torch.device, dtype: torch.dtype) -> Built:
    from transformers import LlamaConfig, LlamaForCausalLM

    d, layers, heads, inter, vocab, b, s = (2048, 16, 16, 5632, 32000, 4, 2048) if size == "train" else \
        (64, 4, 4, 176, 256, 2, 32)
    cfg = LlamaConfig(  # type: ignore[call-arg]
        hidden_size=d, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=s,
        attn_implementation="sdpa")
    m = _place(LlamaForCausalLM(cfg), device, dtype)
    return _causal_lm(m, m.model.layers, _ids(b, s, vocab, device),
                      f"LlamaForCausalLM d{d} L{layers} h{heads} ff{inter} vocab {vocab}, batch {b}x{s}")


def qwen2(size: str, device: torch.device, dtype: torch.dtype) -> Built:
    """Qwen2: grouped-query attention (16 heads, 4 of keys and values), biases on q/k/v, a 32k+ vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d, layers, heads, kv, inter, vocab, b, s = (2048, 16, 16, 4, 5632, 32768, 4, 2048) if size == "train" else \
        (64, 4, 4, 2, 176, 256, 2, 32)
    cfg = Qwen2Config(  # type: ignore[call-arg]
        hidden_size=d, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=s, tie_word_embeddings=False,
        attn_implementation="sdpa")
    m = _place(Qwen2ForCausalLM(cfg), device, dtype)
    return _causal_lm(m, m.model.layers, _ids(b, s, vocab, device),
                      f"Qwen2ForCausalLM d{d} L{layers} h{heads} kv{kv} ff{inter} vocab {vocab}, batch {b}x{s}")


def gpt_neox(size: str, device: torch.device, dtype: torch.dtype) -> Built:
    """GPT-NeoX: LayerNorm, GELU, biases, parallel residual, partial rotary. Estimate (train): ~60k values a token a
    layer (4 x 2048 MLP with GELU in and out), ~0.95 GiB a layer, 16 layers ~15 GiB, logits of a 50k vocabulary and
    their fp32 loss ~4 GiB; 1.0B parameters: ~23 GiB in all."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    d, layers, heads, vocab, b, s = (2048, 16, 16, 50304, 4, 2048) if size == "train" else (64, 4, 4, 256, 2, 32)
    cfg = GPTNeoXConfig(  # type: ignore[call-arg]
        hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * d,
        vocab_size=vocab, max_position_embeddings=s, hidden_act="gelu", use_parallel_residual=True,
        attn_implementation="sdpa")
    m = _place(GPTNeoXForCausalLM(cfg), device, dtype)
    return _causal_lm(m, m.gpt_neox.layers, _ids(b, s, vocab, device),
                      f"GPTNeoXForCausalLM d{d} L{layers} h{heads} ff{4 * d} vocab {vocab}, batch {b}x{s}")


def moe(size: str, device: torch.device, dtype: torch.dtype) -> Built:
    """Mixtral-style mixture of experts: 8 experts, top 2, grouped-query attention. Estimate (train, 8192 tokens):
    each token's two experts save ~2 x (1024 + 4 x 2816) values, attention and norms ~12k: ~0.6 GiB a layer, 12
    layers ~7 GiB, logits and loss ~2.5 GiB: ~9.5 GiB of activations; 0.93B parameters (8 x 3 x 1024 x 2816 a
    layer): 1.7 GiB in bf16, as much for the gradients: ~13 GiB in all."""
    from transformers import MixtralConfig, MixtralForCausalLM

    d, layers, heads, kv, inter, vocab, b, s = (1024, 12, 16, 8, 2816, 32000, 4, 2048) if size == "train" else \
        (64, 4, 4, 2, 96, 256, 2, 32)
    cfg = MixtralConfig(  # type: ignore[call-arg]
        hidden_size=d, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, num_local_experts=8, num_experts_per_tok=2, vocab_size=vocab,
        max_position_embeddings=s, attn_implementation="sdpa")
    m = _place(MixtralForCausalLM(cfg), device, dtype)
    return _causal_lm(m, m.model.layers, _ids(b, s, vocab, device),
                      f"MixtralForCausalLM d{d} L{layers} h{heads} kv{kv} 8 experts top 2 of ff{inter}, "
                      f"vocab {vocab}, batch {b}x{s}")


def t5(size: str, device: torch.device, dtype: torch.dtype) -> Built:
    """T5 v1.1-large-like (gated GELU, d_ff 2816, dropout 0.1), encoder 8 x 1024 tokens, decoder 8 x 256. Estimate
    (train, transformers' SDPA attention with T5's position bias): an encoder layer saves ~45k values a token
    (the gated FF's tanh-GELU intermediates, dropout masks, norms in fp32), ~0.7 GiB for 8192 tokens, 12 layers
    ~8.5 GiB; a decoder layer (self and cross attention, 2048 tokens) ~0.25 GiB, 12 ~3 GiB: ~11.5 GiB of
    activations; 0.78B parameters: ~15 GiB in all."""
    from transformers import T5Config, T5ForConditionalGeneration

    d, layers, heads, ff, vocab, b, s_in, s_out = (1024, 12, 16, 2816, 32128, 8, 1024, 256) if size == "train" \
        else (64, 2, 4, 128, 256, 2, 32, 8)
    cfg = T5Config(  # type: ignore[call-arg]
        d_model=d, d_kv=d // heads, d_ff=ff, num_layers=layers, num_decoder_layers=layers, num_heads=heads,
        feed_forward_proj="gated-gelu", vocab_size=vocab, dropout_rate=0.1, tie_word_embeddings=False,
        decoder_start_token_id=0, pad_token_id=0)
    m = _place(T5ForConditionalGeneration(cfg), device, dtype)
    kwargs = {"input_ids": _ids(b, s_in, vocab, device), "labels": _ids(b, s_out, vocab, device, seed=4321),
              "use_cache": False}
    return Built(m, (), kwargs, _lm_loss, list(m.encoder.block) + list(m.decoder.block), _hf(m),
                 f"T5ForConditionalGeneration d{d} L{layers}+{layers} h{heads} ff{ff} gated-gelu, encoder {b}x{s_in}, "
                 f"decoder {b}x{s_out}")


# -- timm, torchvision -----------------------------------------------------------------------
def vit_l(size: str, device: torch.device, dtype: torch.dtype) -> Built:
    """timm ViT-L/16. Estimate (train, batch 96: 18.9k tokens): a block saves ~16k values a token (norms, q/k/v,
    fused attention, the 4 x 1024 MLP with GELU), ~0.6 GiB, 24 blocks ~14 GiB; 304M parameters: ~16 GiB in all."""
    import timm

    extra: dict[str, Any]
    b, extra = (96, {}) if size == "train" else (4, {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 4,
                                                      "num_heads": 4, "num_classes": 10})
    m = _place(timm.create_model("vit_large_patch16_224", pretrained=False, **extra), device, dtype)
    x, y = _images(b, 224 if size == "train" else 32, 1000 if size == "train" else 10, device, dtype, False)
    return Built(m, (x,), {}, _ce(y), list(m.blocks), _timm(m),
                 f"timm vit_large_patch16_224{' ' + str(extra) if extra else ''}, batch {b}")


def convnext(size: str, device: torch.device, dtype: torch.dtype) -> Built:
    """timm ConvNeXt-Base, channels_last. Estimate (train, batch 128 at 224): a block saves ~12 values per channel
    and pixel (depthwise conv, LayerNorm, the 4x MLP with GELU, layer scale): 56x56x128 x 3 blocks, 28x28x256 x 3,
    14x14x512 x 27, 7x7x1024 x 3: ~56M values an image, ~13.5 GiB at batch 128; 89M parameters: ~14 GiB in all."""
    import timm

    extra: dict[str, Any]
    b, r, extra = (128, 224, {}) if size == "train" else (2, 32, {"depths": (1, 1, 2, 1), "dims": (16, 32, 64, 128),
                                                                  "num_classes": 10})
    m = _place(timm.create_model("convnext_base", pretrained=False, **extra), device, dtype, channels_last=True)
    x, y = _images(b, r, 1000 if size == "train" else 10, device, dtype, True)
    return Built(m, (x,), {}, _ce(y), [blk for st in m.stages for blk in st.blocks], _timm(m),
                 f"timm convnext_base{' ' + str(extra) if extra else ''}, channels_last, batch {b}x{r}x{r}")


def resnet152(size: str, device: torch.device, dtype: torch.dtype) -> Built:
    """torchvision ResNet-152 (batch norm), channels_last. Estimate (train, batch 128 at 224): ~50 Bottlenecks saving
    ~6 of their widths per pixel each (conv, batch-norm, ReLU inputs): ~95 MiB an image in bf16, ~12 GiB at batch
    128; 60M parameters: ~12.5 GiB in all. Its blocks write their batch-norm statistics, so the planner never
    recomputes them (NOTE [ Profiling step ] Rule 7); torch.utils.checkpoint and Recompute() do, updating the
    statistics twice a step."""
    import torchvision
    from torchvision.models.resnet import Bottleneck

    if size == "train":
        b, r, m0 = 128, 224, torchvision.models.resnet152()
    else:
        b, r = 2, 32
        m0 = torchvision.models.resnet.ResNet(Bottleneck, [1, 1, 2, 1], num_classes=10, width_per_group=16)
    m = _place(m0, device, dtype, channels_last=True)
    x, y = _images(b, r, 1000 if size == "train" else 10, device, dtype, True)
    blocks = [blk for layer in (m.layer1, m.layer2, m.layer3, m.layer4) for blk in layer]
    return Built(m, (x,), {}, _ce(y), blocks, _per_block(blocks),
                 f"torchvision {'resnet152' if size == 'train' else 'ResNet(Bottleneck, [1,1,2,1])'}, channels_last, "
                 f"batch {b}x{r}x{r}")


ARCHS: dict[str, Callable[[str, torch.device, torch.dtype], Built]] = {
    "llama": llama, "qwen2": qwen2, "gpt_neox": gpt_neox, "moe": moe, "t5": t5,
    "vit_l": vit_l, "convnext": convnext, "resnet152": resnet152,
}
PACKAGE = {"llama": "transformers", "qwen2": "transformers", "gpt_neox": "transformers", "moe": "transformers",
           "t5": "transformers", "vit_l": "timm", "convnext": "timm", "resnet152": "torchvision"}


def build_here(name: str) -> tuple[Built, bool]:
    """``name`` at training size in bf16 on CUDA, or tiny in fp32 on the CPU, and whether CUDA is used."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    return build(name, "train" if cuda else "tiny", dev, torch.bfloat16 if cuda else torch.float32), cuda


def build(name: str, size: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Built:
    """``ARCHS[name]`` at ``size`` (``"train"`` or ``"tiny"``), seeded; the parameters are made on ``device`` (in
    fp32, then cast to ``dtype``), so that building a billion parameters takes seconds."""
    if name not in ARCHS:
        raise ValueError(f"unknown model {name!r}; one of {', '.join(ARCHS)}")
    if size not in ("train", "tiny"):
        raise ValueError(f"size is 'train' or 'tiny', got {size!r}")
    torch.manual_seed(seed)
    with torch.device(device):
        return ARCHS[name](size, device, dtype)

