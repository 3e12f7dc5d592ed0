"""torchckpt.integrations: the planner under transformers' Trainer (a tiny Llama built from a config) and PyTorch
Lightning (a LightningModule whose training_step calls its model), on the CPU.

A Trainer with ``PlanCallback`` trains the same weights, bit for bit, as the same Trainer without it, at a budget
where the plan recomputes (with dropout); the plan is taken off when training ends. The frameworks are not torchckpt
dependencies: each test skips where its framework is missing.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from torchckpt.planner import plans


def _hf() -> Any:
    """transformers, with accelerate (its Trainer needs it); skips without them."""
    pytest.importorskip("accelerate")
    return pytest.importorskip("transformers")

V, S = 64, 16


class _Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, V, (S,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _model() -> torch.nn.Module:
    transformers = _hf()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=V, max_position_embeddings=S,
                                   attention_dropout=0.1)
    return transformers.LlamaForCausalLM(cfg)


def _train(model: torch.nn.Module, callbacks: list, tmp_path) -> torch.nn.Module:  # noqa: ANN001
    transformers = _hf()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache turned off while planned (NOTE [ Mutating forwards ] Rule 6)
        transformers.Trainer(model=model, args=args, train_dataset=_Data(), callbacks=callbacks).train()
    return model


def test_trainer_with_plan_callback_trains_the_same_weights(tmp_path) -> None:  # noqa: ANN001
    _hf()
    from torchckpt.integrations.hf_trainer import PlanCallback

    base = _model()
    batch = _Data()[0]
    probe = copy.deepcopy(base)
    top = plans(probe, batch["input_ids"].repeat(4, 1), labels=batch["input_ids"].repeat(4, 1),
                budgets=[1 << 40])[1 << 40]
    budget = (top.floor_bytes + top.none_peak_bytes) // 2
    plain = _train(copy.deepcopy(base), [], tmp_path / "plain")
    cb = PlanCallback(budget=budget)
    planned = _train(copy.deepcopy(base), [cb], tmp_path / "planned")
    assert cb.plan is not None and any(b.mode == "recompute" for b in cb.plan.blocks)
    for (n, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not any("forward" in layer.__dict__ for layer in planned.model.layers)  # taken off at the end


def test_plan_callback_checks_its_budget_at_the_call() -> None:
    _hf()
    from torchckpt.integrations.hf_trainer import PlanCallback

    with pytest.raises((TypeError, ValueError), match="^torchckpt: .*PlanCallback"):
        PlanCallback(budget="lots")


# -- PyTorch Lightning -------------------------------------------------------------------------------------------
def _lightning() -> Any:
    try:
        import pytorch_lightning as pl
    except ImportError:
        pl = pytest.importorskip("lightning.pytorch")
    return pl


def _lit_module(pl: Any) -> Any:
    class Blk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.drop = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32), torch.nn.Dropout(0.2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Sequential(*[Blk() for _ in range(4)], torch.nn.Linear(32, 1))

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(0)
    return Lit()


def _fit(pl: Any, lit: Any, callbacks: list) -> Any:
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g))
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and log intervals
        trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=16))
    return lit


def test_lightning_with_plan_callback_trains_the_same_weights() -> None:
    pl = _lightning()
    from torchckpt.integrations.pl_callback import PlanCallback as LitPlan

    base = _lit_module(pl)
    x = torch.randn(16, 32)
    top = plans(copy.deepcopy(base.model), x, budgets=[1 << 40])[1 << 40]
    budget = (top.floor_bytes + top.none_peak_bytes) // 2
    plain = _fit(pl, copy.deepcopy(base), [])
    cb = LitPlan(budget=budget, module="model")
    planned = _fit(pl, copy.deepcopy(base), [cb])
    assert cb.plan is not None and any(b.mode == "recompute" for b in cb.plan.blocks)
    for (n, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not any("forward" in blk.__dict__ for blk in planned.model)  # taken off at the end


def test_lightning_plan_callback_names_a_missing_module() -> None:
    pl = _lightning()
    from torchckpt.integrations.pl_callback import PlanCallback as LitPlan

    with pytest.raises(ValueError, match="^torchckpt: PlanCallback\\(module='net'\\)"):
        _fit(pl, _lit_module(pl), [LitPlan(budget=1 << 30, module="net")])
