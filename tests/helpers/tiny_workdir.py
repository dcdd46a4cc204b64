"""A tiny workdir for the export/eval stage tests: the shared random Llama + random heads, no training.

``make_workdir`` writes a backbone to base_model/ (with a chat-template tokenizer; ``model=hf`` points
there) and what stage=train would leave behind (heads/ in the FasterDecoding layout, calibration.json,
medusa_choices.json) in well under a second, so the export and eval stages run for real on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from medusa_train import __version__
from medusa_train.config import Config, compose_config
from medusa_train.decoding.calibrate import device_label
from medusa_train.formats import MEDUSA_TRAIN_VERSION
from medusa_train.heads import MedusaHeads
from tests.helpers.models import build_tiny_backbone

HIDDEN = 32
NUM_HEADS = 3
CHOICES = [[0], [0, 0], [1], [0, 0, 0], [0, 1]]
# Cumulative top-k accuracy (K, 10) as stage=train's calibration would measure it.
TOPK = [[0.8, 0.9] + [0.95] * 8, [0.6, 0.75] + [0.85] * 8, [0.4, 0.55] + [0.7] * 8]


def make_workdir(root: Path, *, calibration: bool = True, choices: bool = True) -> Path:
    """Create ``root`` as a workdir with base_model/ and heads/ (+ calibration files); returns ``root``."""
    backbone = build_tiny_backbone(root / "base_model")  # some replies end with EOS early
    model = LlamaForCausalLM.from_pretrained(backbone)
    vocab = model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(0)
    heads = MedusaHeads(HIDDEN, vocab, NUM_HEADS, 1, base_model_name_or_path=str(backbone))
    heads.init_from_lm_head(model.get_output_embeddings().weight)
    with torch.no_grad():
        for k in range(NUM_HEADS):  # small non-zero blocks, so every weight matters in a round trip
            heads.blocks(k)[0].linear.weight.normal_(0, 0.02)
            heads.blocks(k)[0].linear.bias.normal_(0, 0.02)
    extra = {
        "training": {"mode": "medusa1", "lr": 1e-3, "max_steps": 6},
        "backbone": {"name_or_path": str(backbone)},
        MEDUSA_TRAIN_VERSION: __version__,
    }
    heads.save_pretrained(root / "heads", extra_config=extra)
    if calibration:  # calibrated for this machine, as stage=train records it
        calibrated = {"head_topk_accuracy": TOPK, "tree": {"calibrated_for": device_label(model, "sdpa")}}
        (root / "heads" / "calibration.json").write_text(json.dumps(calibrated))
    if choices:
        (root / "heads" / "medusa_choices.json").write_text(json.dumps(CHOICES))
    return root


def tiny_overrides(workdir: Path, *overrides: str) -> list[str]:
    """The fast debug settings on ``workdir`` (tracking off, ``model=hf`` on its base_model/ in float32),
    plus ``overrides``: the CLI's arguments."""
    model = ["model=hf", f"model.name_or_path={workdir / 'base_model'}", "model.dtype=float32"]
    return [f"workdir={workdir}", "debug=fast", "tracking=disabled", *model, *overrides]


def tiny_cfg(workdir: Path, *overrides: str) -> Config:
    """:func:`tiny_overrides` composed into the typed config."""
    return compose_config(tiny_overrides(workdir, *overrides))
