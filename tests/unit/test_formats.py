"""Export layouts: exact key names the engines read, identical logits after a round trip, detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_train.formats import (
    LEGACY_WEIGHTS_NAME,
    MEDUSA,
    VLLM,
    VLLM_WEIGHTS_NAME,
    detect_layout,
    load_heads,
    save_medusa,
    save_vllm,
    vllm_config,
)
from medusa_train.heads import HeadsFormatError, MedusaHeads
from medusa_train.workdir import HEADS_CONFIG, HEADS_WEIGHTS

D, V, K, L = 16, 40, 3, 2


def _random_heads(num_layers: int = L, dtype: torch.dtype = torch.float32) -> MedusaHeads:
    torch.manual_seed(0)
    heads = MedusaHeads(D, V, K, num_layers, base_model_name_or_path="tiny/base")
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()  # every tensor distinct, so a swapped name changes the logits
    return heads.to(dtype)


def _logits(heads: MedusaHeads) -> torch.Tensor:
    hidden = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1)).to(heads.proj(0).weight.dtype)
    with torch.no_grad():
        return heads(hidden)  # (K, 2, 5, V)


def test_medusa_key_names_are_what_tgi_and_fasterdecoding_read(tmp_path: Path) -> None:
    save_medusa(_random_heads(), tmp_path, extra_config={"training": {"lr": 1e-3}, "medusa_num_heads": 99})
    keys = set(load_file(str(tmp_path / HEADS_WEIGHTS)))
    expected = {f"{h}.{j}.linear.{p}" for h in range(K) for j in range(L) for p in ("weight", "bias")}
    expected |= {f"{h}.{L}.weight" for h in range(K)}
    assert keys == expected
    config = json.loads((tmp_path / HEADS_CONFIG).read_text())
    assert config["medusa_num_heads"] == K  # extra_config cannot override the layout keys
    assert (config["medusa_num_layers"], config["hidden_size"], config["vocab_size"]) == (L, D, V)
    assert config["base_model_name_or_path"] == "tiny/base"
    assert config["training"] == {"lr": 1e-3}


def test_vllm_key_names_are_what_vllm_medusa_model_reads(tmp_path: Path) -> None:
    save_vllm(_random_heads(), tmp_path)
    tensors = load_file(str(tmp_path / VLLM_WEIGHTS_NAME))
    expected = {f"blocks.{h}.layers.{j}.{p}" for h in range(K) for j in range(L) for p in ("weight", "bias")}
    expected |= {f"lm_heads.{h}.weight" for h in range(K)}
    assert set(tensors) == expected
    assert tensors["blocks.0.layers.0.weight"].shape == (D, D)
    assert tensors["blocks.0.layers.0.bias"].shape == (D,)
    assert tensors["lm_heads.0.weight"].shape == (V, D)
    config = json.loads((tmp_path / HEADS_CONFIG).read_text())
    assert config == {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": D,
        "vocab_size": V,
        "num_heads": K,
        "num_hidden_layers": L,
        "truncated_vocab_size": V,
        "medusa_fc_bias": True,
    }
    # vLLM's MedusaConfig renames every key with "num" + "heads"/"layers": only ours may contain "num".
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]


@pytest.mark.parametrize("num_layers", [0, 1, L])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [MEDUSA, VLLM])
def test_round_trip_gives_identical_logits(
    tmp_path: Path, layout: str, dtype: torch.dtype, num_layers: int
) -> None:
    heads = _random_heads(num_layers, dtype)
    (save_medusa if layout == MEDUSA else save_vllm)(heads, tmp_path)
    assert detect_layout(tmp_path) == layout
    back = load_heads(tmp_path)
    assert (back.num_heads, back.num_layers, back.hidden_size, back.vocab_size) == (K, num_layers, D, V)
    assert back.proj(0).weight.dtype == dtype
    assert torch.equal(_logits(back), _logits(heads))


def test_vllm_weights_map_to_the_same_tensors(tmp_path: Path) -> None:
    """Name by name: vLLM block l of head h is our ResBlock l of head h; lm_heads.h is our projection h."""
    heads = _random_heads()
    save_vllm(heads, tmp_path)
    tensors = load_file(str(tmp_path / VLLM_WEIGHTS_NAME))
    for h in range(K):
        for j in range(L):
            assert torch.equal(tensors[f"blocks.{h}.layers.{j}.weight"], heads.blocks(h)[j].linear.weight)
            assert torch.equal(tensors[f"blocks.{h}.layers.{j}.bias"], heads.blocks(h)[j].linear.bias)
        assert torch.equal(tensors[f"lm_heads.{h}.weight"], heads.proj(h).weight)


def test_vllm_prefixed_names_and_shared_lm_head(tmp_path: Path) -> None:
    """vLLM strips a ``medusa_heads.`` prefix and shares lm_heads.0 with ``original_lm_head``; so do we."""
    heads = _random_heads()
    with torch.no_grad():
        for h in range(1, K):
            heads.proj(h).weight.copy_(heads.proj(0).weight)
    save_vllm(heads, tmp_path)
    state = {f"medusa_heads.{k}": v for k, v in load_file(str(tmp_path / VLLM_WEIGHTS_NAME)).items()}
    state = {
        k: v
        for k, v in state.items()
        if not k.startswith(("medusa_heads.lm_heads.1", "medusa_heads.lm_heads.2"))
    }
    (tmp_path / VLLM_WEIGHTS_NAME).unlink()
    save_file(state, str(tmp_path / "weights.safetensors"))
    config = {**vllm_config(heads), "original_lm_head": True}
    (tmp_path / HEADS_CONFIG).write_text(json.dumps(config))
    assert torch.equal(_logits(load_heads(tmp_path)), _logits(heads))


def test_fasterdecoding_pickle_and_export_root(tmp_path: Path) -> None:
    heads = _random_heads()
    legacy = tmp_path / "legacy"
    save_medusa(heads, legacy)
    torch.save(load_file(str(legacy / HEADS_WEIGHTS)), legacy / LEGACY_WEIGHTS_NAME)
    (legacy / HEADS_WEIGHTS).unlink()
    assert torch.equal(_logits(load_heads(legacy)), _logits(heads))
    save_medusa(heads, tmp_path / "export" / MEDUSA)  # workdir/export itself loads its medusa/ folder
    assert torch.equal(_logits(load_heads(tmp_path / "export")), _logits(heads))


def test_wrong_directories_fail_with_a_clear_message(tmp_path: Path) -> None:
    with pytest.raises(HeadsFormatError, match="not a directory"):
        load_heads(tmp_path / "nowhere")
    with pytest.raises(HeadsFormatError, match="no config.json"):
        load_heads(tmp_path)
    backbone = tmp_path / "backbone"
    backbone.mkdir()
    (backbone / HEADS_CONFIG).write_text(json.dumps({"model_type": "llama", "hidden_size": D}))
    with pytest.raises(HeadsFormatError, match="backbone"):
        load_heads(backbone)
    no_weights = tmp_path / "no_weights"
    save_medusa(_random_heads(), no_weights)
    (no_weights / HEADS_WEIGHTS).unlink()
    with pytest.raises(HeadsFormatError, match=HEADS_WEIGHTS):
        load_heads(no_weights)
    mismatch = tmp_path / "mismatch"
    save_vllm(_random_heads(), mismatch)
    config = json.loads((mismatch / HEADS_CONFIG).read_text())
    (mismatch / HEADS_CONFIG).write_text(json.dumps({**config, "num_heads": K + 1}))
    with pytest.raises(HeadsFormatError, match="blocks.3.layers.0.weight"):
        load_heads(mismatch)
    wrong_shape = tmp_path / "wrong_shape"
    save_vllm(_random_heads(), wrong_shape)
    (wrong_shape / HEADS_CONFIG).write_text(json.dumps({**config, "hidden_size": D + 1}))
    with pytest.raises(HeadsFormatError, match="shape"):
        load_heads(wrong_shape)
    for layout, save, weights in (
        ("medusa", save_medusa, HEADS_WEIGHTS),
        ("vllm", save_vllm, VLLM_WEIGHTS_NAME),
    ):
        damaged = tmp_path / f"damaged_{layout}"
        save(_random_heads(), damaged)
        (damaged / weights).write_bytes((damaged / weights).read_bytes()[:100])  # cut short
        with pytest.raises(HeadsFormatError, match=f"cannot read .*{weights}"):
            load_heads(damaged)
