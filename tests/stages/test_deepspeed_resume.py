"""A stage=train run under DeepSpeed (ZeRO-2, ZeRO-3 with every parameter partitioned; one process,
the stage's own rendezvous) killed after a checkpoint resumes to the uninterrupted run's result.

Medusa-1 (its frozen backbone held outside the module; from the hidden-state cache under ZeRO-2),
Medusa-2 full tuning (a heads-only phase and a linear lambda0 warm-up: the checkpoint lies after the
heads-only phase, where the backbone's Adam state has fewer steps than the heads', and inside the
warm-up) and Medusa-2 LoRA, over the tied-embedding backbone of tests/helpers/train_workdir.py,
against an uninterrupted run without DeepSpeed; LoRA in bf16 (ZeRO-2, fp32 master weights) against
an uninterrupted bf16 run. 4-bit QLoRA is tested the same way in test_medusa2.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from medusa_train.errors import UserError
from medusa_train.formats import load_heads
from medusa_train.stages import train
from medusa_train.workdir import HEADS_WEIGHTS
from tests.helpers.train_workdir import (
    make_train_workdir,
    run_killed_at_step,
    train_cfg,
    zero3_partitioning_everything,
)
from tests.stages.test_medusa2 import TUNING, _assert_same_training, _bf16_on_cpu

NO_DROPOUT = ("training.lora_dropout=0",)
"""As test_medusa2's PER_RANK: every rank would draw its own masks; a Medusa-2 option (Medusa-1 refuses it)."""
RECIPES = {
    "medusa1": (),
    "full": ("training=medusa2", *TUNING["full"], *NO_DROPOUT),
    "lora": ("training=medusa2", *TUNING["lora"], *NO_DROPOUT),
}
COMMON = ("training.per_device_batch_size=2", "training.gradient_accumulation_steps=2")
CACHED = ("training.cache_hidden_states=true",)
"""Medusa-1 only (Medusa-2 refuses the cache); the cache's heads equal online ones (test_train.py)."""


def _partitioned(deepspeed: str, monkeypatch) -> contextlib.AbstractContextManager:
    """ZeRO-3 with every parameter partitioned; nothing for another ``deepspeed``."""
    return zero3_partitioning_everything(monkeypatch) if deepspeed == "zero3" else contextlib.nullcontext()


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Callable[[str], Path]:
    """The workdir of a recipe's uninterrupted run without DeepSpeed (each run once, when first asked)."""
    runs: dict[str, Path] = {}

    def reference(recipe: str) -> Path:
        if recipe not in runs:
            root = make_train_workdir(tmp_path_factory.mktemp(f"plain_{recipe}"), tie=True)
            train.run(train_cfg(root, *RECIPES[recipe], *COMMON))
            runs[recipe] = root
        return runs[recipe]

    return reference


@pytest.mark.parametrize(
    ("recipe", "zero", "extra"),
    [
        pytest.param("medusa1", "zero2", CACHED, id="medusa1-cached-zero2"),
        pytest.param("medusa1", "zero3", (), id="medusa1-zero3"),
        pytest.param("full", "zero2", (), id="full-zero2"),
        pytest.param("full", "zero3", (), id="full-zero3"),
        pytest.param("lora", "zero2", (), id="lora-zero2"),
        pytest.param("lora", "zero3", (), id="lora-zero3"),
    ],
)
def test_deepspeed_run_killed_and_resumed_equals_plain(
    plain, tmp_path: Path, monkeypatch, recipe: str, zero: str, extra: tuple[str, ...]
) -> None:
    """Killed at step 4, resumed from checkpoint-3 (DeepSpeed's: the module, FreezableAdamW's state
    and param groups, the lr scheduler, the RNG; the data order from the step count): 6 steps, and the
    heads (Medusa-2: and the trained backbone or LoRA adapter) of the uninterrupted run within 1e-5."""
    ref = plain(recipe)
    root = make_train_workdir(tmp_path, tie=True)
    with _partitioned(zero, monkeypatch):
        cfg = train_cfg(root, *RECIPES[recipe], *COMMON, *extra, f"deepspeed={zero}")
        run_killed_at_step(cfg, monkeypatch, step=4)
        assert not (root / "heads").exists()
        result = train.run(cfg)
    assert result["resumed_from"].endswith("checkpoint-3") and result["steps"] == 6
    if recipe == "medusa1":
        heads, want = load_heads(root / "heads").state_dict(), load_heads(ref / "heads").state_dict()
        assert heads.keys() == want.keys()
        for name, expected in want.items():
            torch.testing.assert_close(heads[name], expected, atol=1e-5, rtol=1e-5, msg=name)
    else:
        _assert_same_training(root, ref, recipe)


def test_bf16_lora_zero2_run_killed_and_resumed_equals_uninterrupted(tmp_path: Path, monkeypatch) -> None:
    """Under bf16 DeepSpeed trains a bf16 copy of the module and keeps the fp32 master weights in its
    optimizer's state (the CPU put into bf16 as in test_medusa2.py): the resumed run takes the
    masters from the checkpoint, not from the module's bf16 copy, so its published heads and LoRA
    adapter (the masters) are those of the uninterrupted bf16 run within 1e-5 (masters taken
    from the bf16 copy end up to 5e-4 away)."""
    _bf16_on_cpu(monkeypatch)
    overrides = (*RECIPES["lora"], *COMMON, "deepspeed=zero2", "tree.max_nodes=1", "tree.latency_context=4")
    ref, root = (make_train_workdir(tmp_path / name, tie=True) for name in ("ref", "killed"))
    train.run(train_cfg(ref, *overrides))
    run_killed_at_step(train_cfg(root, *overrides), monkeypatch, step=4)
    assert train.run(train_cfg(root, *overrides))["resumed_from"].endswith("checkpoint-3")
    for name in (HEADS_WEIGHTS, "backbone/adapter_model.safetensors"):
        got, want = load_file(str(root / "heads" / name)), load_file(str(ref / "heads" / name))
        assert got.keys() == want.keys() and all(t.dtype == torch.float32 for t in got.values())
        for key, tensor in want.items():
            torch.testing.assert_close(got[key], tensor, atol=1e-5, rtol=1e-5, msg=f"{name}: {key}")


@pytest.mark.parametrize(("first", "then"), [("zero2", "none"), ("zero3", "zero2")])
def test_resuming_with_another_deepspeed_is_refused(
    tmp_path: Path, monkeypatch, first: str, then: str
) -> None:
    """DeepSpeed's checkpoints hold the optimizer state in its own files, laid out per ZeRO stage.
    Resumed without DeepSpeed the Trainer finds no optimizer.pt and would go on with fresh Adam
    moments, to other heads, without a word; across ZeRO stages DeepSpeed's load fails with a bare
    AssertionError. Refused before training, naming ``deepspeed`` and both values; the checkpoints
    are kept."""
    root = make_train_workdir(tmp_path)
    with _partitioned(first, monkeypatch):
        run_killed_at_step(train_cfg(root, f"deepspeed={first}"), monkeypatch, step=4)
    with (
        _partitioned(then, monkeypatch),
        pytest.raises(UserError, match=rf"differs in deepspeed \({first} -> {then}\)"),
    ):
        train.run(train_cfg(root, f"deepspeed={then}"))
    assert (root / "train" / "checkpoint-3" / "trainer_state.json").is_file()
    assert not (root / "heads").exists()


def test_a_run_json_from_before_the_preset_was_recorded_resumes(tmp_path: Path, monkeypatch) -> None:
    """A run.json written before ``deepspeed`` was recorded in it has nothing to compare: its
    checkpoints resume as they did then, and the file records the preset from then on."""
    root = make_train_workdir(tmp_path)
    run_killed_at_step(train_cfg(root), monkeypatch, step=4)
    info_path = root / "train" / "run.json"
    info = json.loads(info_path.read_text())
    del info["deepspeed"]
    info_path.write_text(json.dumps(info))
    result = train.run(train_cfg(root))
    assert result["resumed_from"].endswith("checkpoint-3") and result["steps"] == 6
    assert json.loads(info_path.read_text())["deepspeed"] == "none"
