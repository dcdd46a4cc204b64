"""Loading backbones: one code path for every model; identity follows the checkpoint, not the load."""

from __future__ import annotations

from pathlib import Path

import pytest

from medusa_train.backbone import backbone_identity, load_backbone
from medusa_train.errors import UserError
from tests.helpers.train_workdir import make_backbone


def test_identity_is_the_checkpoint_whatever_the_dtype(tmp_path: Path) -> None:
    make_backbone(tmp_path / "a", seed=0)
    make_backbone(tmp_path / "b", seed=1)
    a32, _ = load_backbone(str(tmp_path / "a"), dtype="float32")
    a16, _ = load_backbone(str(tmp_path / "a"), dtype="bfloat16")
    b32, _ = load_backbone(str(tmp_path / "b"), dtype="float32")
    ida = backbone_identity(a32, str(tmp_path / "a"))
    assert ida == backbone_identity(a16, str(tmp_path / "a"))
    assert ida["fingerprint"] != backbone_identity(b32, str(tmp_path / "b"))["fingerprint"]
    assert ida["hidden_size"] == 32 and ida["vocab_size"] == 64


def test_frozen_load_has_no_gradients(tmp_path: Path) -> None:
    make_backbone(tmp_path / "m")
    model, tok = load_backbone(str(tmp_path / "m"))
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tok.padding_side == "left" and tok.pad_token is not None


def test_missing_local_backbone_names_the_stage(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="stage=pretrain"):
        load_backbone(str(tmp_path / "runs" / "pretrain"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="config.json"):
        load_backbone(str(tmp_path / "empty"))
