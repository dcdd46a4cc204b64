"""Medusa-2 pieces: trainable backbone, LM loss (CE / KL to the frozen original), lambda0, LoRA."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

from medusa_train.heads import MedusaHeads
from medusa_train.training.model import MedusaTrainingModel

sys.path.insert(0, str(Path(__file__).parent))
from test_training_model import batch, tiny_llama  # noqa: E402


def _model(lm_loss: str, lora: bool = False) -> MedusaTrainingModel:
    backbone = tiny_llama()
    heads = MedusaHeads(32, 64, 2, 1)
    heads.init_from_lm_head(backbone.get_output_embeddings().weight)
    teacher = None
    if lora:
        from peft import LoraConfig, get_peft_model

        backbone = get_peft_model(
            backbone, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        )
    else:
        backbone.requires_grad_(True)
        teacher = copy.deepcopy(backbone).requires_grad_(False) if lm_loss == "kl" else None
    return MedusaTrainingModel(heads, backbone, mode="medusa2", lm_loss=lm_loss, teacher=teacher, lambda0=0.5)


@pytest.mark.parametrize(("lm_loss", "lora"), [("kl", False), ("ce", False), ("kl", True)])
def test_medusa2_trains_backbone_and_heads(lm_loss, lora):
    model = _model(lm_loss, lora)
    out = model(**batch())
    if lm_loss == "kl":  # student == teacher before any step: KL is 0
        assert abs(out["lm_loss"].item()) < 1e-5
    assert out["loss"].item() == pytest.approx(
        out["lm_loss"].item() + 0.5 * out["head_ce"][0].item() + 0.4 * out["head_ce"][1].item(), rel=1e-5
    )
    out["loss"].backward()
    trainable = [p for n, p in model.backbone.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in trainable)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.heads.parameters())
    if lora:
        assert all("lora_" in n for n, p in model.backbone.named_parameters() if p.requires_grad)


def test_heads_only_phase_gives_backbone_no_gradient():
    model = _model("ce")
    model.backbone_frozen = True
    out = model(**batch())
    assert "lm_loss" not in out
    out["loss"].backward()
    assert all(p.grad is None for p in model.backbone.parameters())
