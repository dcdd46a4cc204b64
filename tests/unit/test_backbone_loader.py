"""Loading backbones: one code path for every model; identity follows the checkpoint, not the load."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from medusa_train.backbone import (
    backbone_for_heads,
    backbone_identity,
    checkpoint_fingerprint,
    load_backbone,
    resolve_device,
    resolve_dtype,
)
from medusa_train.config import ModelConfig, compose_config
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


def test_a_checkpoint_transformers_will_not_load_as_a_causal_lm_is_one_line(tmp_path: Path) -> None:
    """An encoder-decoder, an unknown architecture and custom code without model.trust_remote_code are
    a UserError (one line, exit 2), not transformers' ValueError traceback."""
    from transformers import T5Config

    T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=64).save_pretrained(tmp_path / "t5")
    with pytest.raises(
        UserError, match="Unrecognized configuration class .*T5Config.*must be a decoder-only"
    ):
        load_backbone(str(tmp_path / "t5"))
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    with pytest.raises(UserError, match="could not load backbone .*model type `no_such_architecture`"):
        load_backbone(str(tmp_path / "new"))
    remote = tmp_path / "remote"
    remote.mkdir()
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
    (remote / "config.json").write_text(json.dumps({"model_type": "x_custom", "auto_map": auto_map}))
    with pytest.raises(UserError, match="set model.trust_remote_code=true"):
        load_backbone(str(remote))


def test_backbone_for_heads_follows_the_recorded_base(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Medusa-2 heads bring their trained backbone when model.name_or_path is their base (by path or files)."""
    make_backbone(tmp_path / "base", seed=0)
    make_backbone(tmp_path / "other", seed=1)
    shutil.copytree(tmp_path / "base", tmp_path / "moved_base")
    record = {
        "name_or_path": str(tmp_path / "base"),
        "fingerprint": checkpoint_fingerprint(str(tmp_path / "base")),
    }
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "backbone": record}))

    def pick(name: str, heads_dir: Path = heads) -> Path | None:
        return backbone_for_heads(ModelConfig(name_or_path=str(tmp_path / name)), heads_dir)

    assert pick("base") is None  # Medusa-1 heads: no trained backbone beside them
    (heads / "backbone").mkdir()
    (heads / "backbone" / "config.json").write_text("{}")
    assert pick("base") == heads / "backbone"
    assert pick("moved_base") == heads / "backbone"  # same checkpoint files elsewhere
    with caplog.at_level(logging.WARNING, logger="medusa_train.backbone"):
        assert pick("other") is None  # another model asked for: used as asked, with a warning
    assert "another model than their base" in caplog.text
    export = tmp_path / "export"  # an export's layout folder finds export/backbone
    (export / "medusa").mkdir(parents=True)
    (export / "medusa" / "config.json").write_text(json.dumps({"backbone": record}))
    (export / "backbone").mkdir()
    (export / "backbone" / "config.json").write_text("{}")
    assert pick("base", export / "vllm") == export / "backbone"


def test_dtype_auto_is_float32_on_a_cpu_and_the_hf_presets_default() -> None:
    assert resolve_dtype("auto", "cpu") == "float32"  # bfloat16 only on a CUDA GPU that supports it
    assert resolve_dtype("float16", "cpu") == "float16"
    assert compose_config(["model=hf", "model.name_or_path=x"]).model.dtype == "auto"


@pytest.mark.parametrize(
    ("capability", "dtype"), [((7, 0), "float32"), ((7, 5), "float32"), ((8, 0), "bfloat16")]
)
def test_dtype_auto_is_bfloat16_only_where_the_gpu_computes_it(monkeypatch, capability, dtype) -> None:
    """V100/T4 (compute capability 7) report bf16 support (emulated, slow): ``auto`` loads them in fp32."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_dtype("auto", "cuda:0") == dtype


def test_cuda_under_a_launcher_is_this_ranks_gpu(monkeypatch) -> None:
    """With several ranks ``model.device=cuda`` (or auto) is ``cuda:LOCAL_RANK``; another rank's index is
    refused in one line (every rank would load onto that GPU); one process keeps what it asked for."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (
        resolve_device("cuda")
        == resolve_device("auto")
        == resolve_device("cuda:2")
        == torch.device("cuda", 2)
    )
    with pytest.raises(
        UserError, match="model.device=cuda:0 under a launcher would put every rank on one GPU"
    ):
        resolve_device("cuda:0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device("cuda:3") == torch.device("cuda", 3) and resolve_device("cuda") == torch.device(
        "cuda"
    )
