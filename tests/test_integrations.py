"""torchckpt.integrations: the planner under transformers' Trainer, on the CPU with a tiny Llama built from a config.

A Trainer with ``PlanCallback`` trains the same weights, bit for bit, as the same Trainer without it, at a budget
where the plan recomputes; the plan is taken off when training ends. The frameworks are not torchckpt
dependencies: each test skips where its framework is missing.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from torchckpt.integrations.hf_trainer import PlanCallback  # noqa: E402 - after the skips
from torchckpt.planner import plans  # noqa: E402

V, S = 64, 16


class _Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, V, (S,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=V, max_position_embeddings=S,
                                   attention_dropout=0.1)
    return transformers.LlamaForCausalLM(cfg)


def _train(model: torch.nn.Module, callbacks: list, tmp_path) -> torch.nn.Module:  # noqa: ANN001
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache turned off while planned (NOTE [ Mutating forwards ] Rule 6)
        transformers.Trainer(model=model, args=args, train_dataset=_Data(), callbacks=callbacks).train()
    return model


def test_trainer_with_plan_callback_trains_the_same_weights(tmp_path) -> None:  # noqa: ANN001
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
    with pytest.raises((TypeError, ValueError), match="^torchckpt: .*PlanCallback"):
        PlanCallback(budget="lots")
