"""Export layouts: exact key names the engines read, identical logits after a round trip, detection."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_train.backbone import recorded_base
from medusa_train.errors import HeadsFormatError
from medusa_train.formats import (
    MEDUSA_FORBIDDEN_KEYS,
    MEDUSA_TRAIN_VERSION,
    VLLM_WEIGHTS_NAME,
    is_hub_id,
    load_heads,
    portable_base_model,
    save_medusa,
    save_vllm,
    vllm_config,
)
from medusa_train.heads import MedusaHeads
from medusa_train.heads_layout import (
    LEGACY_WEIGHTS_NAME,
    MEDUSA,
    VLLM,
    check_heads_directory,
    check_heads_folder,
    detect_layout,
)
from medusa_train.safetensors_check import safetensors_shapes
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
    hidden = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1)).to(heads.dtype)
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
        "base_model_name_or_path": "tiny/base",  # vLLM does not read it; our loader and card do
    }
    # vLLM's MedusaConfig renames every key with "num" + "heads"/"layers": only ours may contain "num".
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]


def test_vllm_layout_says_which_heads_and_backbone_in_keys_vllm_does_not_read(tmp_path: Path) -> None:
    """An export's vLLM config carries the heads' fingerprint, the backbone's identity and the medusa_train
    version that trained them beside the base model (vLLM keeps unknown keys as config attributes and
    reads none of them): read back by our loader and by ``recorded_base``, for the layout folder and the
    export folder holding it. Keys vLLM reads or renames are never taken from the extra config."""
    heads = _random_heads()
    identity = {"name_or_path": "tiny/base", "fingerprint": "abc123", "revision": "v1"}
    extra = {"heads_fingerprint": heads.fingerprint(), "backbone": identity, MEDUSA_TRAIN_VERSION: "0.1.0"}
    hostile = {"logit_scale": 3.0, "original_lm_head": True, "num_heads": 99, "medusa_num_heads": 99}
    save_vllm(heads, tmp_path / "export" / VLLM, extra_config={**extra, **hostile})
    config = json.loads((tmp_path / "export" / VLLM / HEADS_CONFIG).read_text())
    assert config == {**vllm_config(heads), **extra}
    assert set(config) - set(VLLM_KEYS_READ) == {"base_model_name_or_path", *extra}
    assert not [k for k in set(config) - set(VLLM_KEYS_READ) if "num" in k]  # MedusaConfig renames those
    back = load_heads(tmp_path / "export")
    assert back.base_model_name_or_path == "tiny/base" and torch.equal(_logits(back), _logits(heads))
    for folder in (tmp_path / "export" / VLLM, tmp_path / "export"):
        assert recorded_base(folder) == identity


@pytest.mark.parametrize("scale", [1, 1.0, 2.0, 0.5, -1.0, None, "1.0", True])
def test_vllm_logit_scale_is_read_or_refused_in_one_line(tmp_path: Path, scale: object) -> None:
    """vLLM multiplies the heads' logits by ``logit_scale`` (default 1.0): 1.0 reads back with the same
    logits as the heads written; any other value (or a non-number, which vLLM cannot use either) is one
    HeadsFormatError naming the file and what to do, never heads silently computing other logits."""
    heads = _random_heads()
    save_vllm(heads, tmp_path)
    config = json.loads((tmp_path / HEADS_CONFIG).read_text())
    (tmp_path / HEADS_CONFIG).write_text(json.dumps({**config, "logit_scale": scale}))
    if scale == 1.0 and not isinstance(scale, bool):
        assert torch.equal(_logits(load_heads(tmp_path)), _logits(heads))
        save_vllm(load_heads(tmp_path), tmp_path / "again")  # and round-trips
        assert torch.equal(_logits(load_heads(tmp_path / "again")), _logits(heads))
        return
    with pytest.raises(HeadsFormatError) as err:
        load_heads(tmp_path)
    message = str(err.value)
    assert "\n" not in message and f"{tmp_path / HEADS_CONFIG} has logit_scale=" in message
    assert "set logit_scale to 1.0" in message


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


@pytest.mark.parametrize("fc_bias", [False, None], ids=["false", "absent"])
def test_vllm_without_medusa_fc_bias_reads_stored_biases_as_zeros(
    tmp_path: Path, fc_bias: bool | None, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM builds its blocks with ``bias=medusa_fc_bias`` (default false) and skips weights it has no
    parameter for: biases stored beside such a config are not used, so our reading (what eval measures)
    must not use them either."""
    heads = _random_heads()
    save_vllm(heads, tmp_path)
    config = {k: v for k, v in vllm_config(heads).items() if k != "medusa_fc_bias"}
    if fc_bias is not None:
        config["medusa_fc_bias"] = fc_bias
    (tmp_path / HEADS_CONFIG).write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="medusa_train.formats"):
        back = load_heads(tmp_path)
    assert "read as zeros" in caplog.text
    with torch.no_grad():
        for h in range(K):
            for block in heads.blocks(h):
                block.linear.bias.zero_()  # what vLLM computes with
    assert torch.equal(_logits(back), _logits(heads))


def test_fasterdecoding_pickle_and_export_root(tmp_path: Path) -> None:
    heads = _random_heads()
    legacy = tmp_path / "legacy"
    save_medusa(heads, legacy)
    torch.save(load_file(str(legacy / HEADS_WEIGHTS)), legacy / LEGACY_WEIGHTS_NAME)
    (legacy / HEADS_WEIGHTS).unlink()
    assert torch.equal(_logits(load_heads(legacy)), _logits(heads))
    save_medusa(heads, tmp_path / "export" / MEDUSA)  # workdir/export itself loads its medusa/ folder
    assert torch.equal(_logits(load_heads(tmp_path / "export")), _logits(heads))


def test_export_root_with_only_the_vllm_layout(tmp_path: Path) -> None:
    """An export of truncated heads has vllm/ only (export.formats=[vllm]): workdir/export itself
    loads it, as eval.heads_dir= and export.heads_dir= name it."""
    torch.manual_seed(0)
    heads = MedusaHeads(D, V, K, L, "tiny/base", head_projection="truncated", token_map=torch.arange(3, V, 2))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    save_vllm(heads, tmp_path / "export" / VLLM)
    back = load_heads(tmp_path / "export")
    assert back.head_projection == "truncated" and torch.equal(back.token_map, heads.token_map)
    assert torch.equal(_logits(back), _logits(heads))


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


@pytest.mark.parametrize(
    "text", ['{"medusa_num_heads": 3,', "[1, 2]", "[" * 100_000 + "]" * 100_000], ids=["cut", "list", "deep"]
)
def test_every_check_of_a_heads_folder_says_the_same_of_a_damaged_config(tmp_path: Path, text: str) -> None:
    """config.json is read by the layout check, the check before training from ``training.init_heads``,
    the check of a heads option and the loader: a damaged one is told in one wording by each."""
    save_medusa(_random_heads(), tmp_path)
    (tmp_path / HEADS_CONFIG).write_text(text)
    lines = set()
    for read in (detect_layout, check_heads_directory, check_heads_folder, load_heads):
        with pytest.raises(HeadsFormatError) as err:
            read(tmp_path)
        lines.add(str(err.value))
    assert len(lines) == 1, lines
    assert lines.pop().startswith(f"{tmp_path / HEADS_CONFIG} is ")


@pytest.mark.parametrize("layout", [MEDUSA, VLLM])
def test_a_safetensors_header_nested_too_deep_is_a_damaged_file(tmp_path: Path, layout: str) -> None:
    """A damaged or hostile weights file whose header nests deeper than the JSON parser goes is the
    one-line damaged-file error, not a RecursionError traceback."""
    (save_medusa if layout == MEDUSA else save_vllm)(_random_heads(), tmp_path)
    header = b"[" * 100_000 + b"]" * 100_000
    weights = tmp_path / (HEADS_WEIGHTS if layout == MEDUSA else VLLM_WEIGHTS_NAME)
    weights.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(HeadsFormatError, match=f"cannot read .*{weights.name}: .*header does not parse"):
        safetensors_shapes(weights)
    with pytest.raises(HeadsFormatError, match=f"cannot read .*{weights.name}"):
        load_heads(tmp_path)


@pytest.mark.parametrize("value", ["two", [3]])
@pytest.mark.parametrize(
    ("layout", "key"),
    [(MEDUSA, "hidden_size"), (MEDUSA, "vocab_size"), (VLLM, "num_heads"), (VLLM, "truncated_vocab_size")],
)
def test_a_config_value_that_is_no_integer_is_a_heads_format_error(
    tmp_path: Path, layout: str, key: str, value: object
) -> None:
    """A damaged or foreign config.json (a string or a list where a size goes) is one clear
    HeadsFormatError, which the stages turn into one line and exit 2, not a TypeError traceback."""
    (save_medusa if layout == MEDUSA else save_vllm)(_random_heads(), tmp_path)
    config = json.loads((tmp_path / HEADS_CONFIG).read_text())
    (tmp_path / HEADS_CONFIG).write_text(json.dumps({**config, key: value}))
    with pytest.raises(HeadsFormatError, match=f"{HEADS_CONFIG}.* non-integer|non-integer .*{key}"):
        load_heads(tmp_path)


# -- what each consumer's loader reads (docs/pipeline.md, "What each engine's loader reads") -------------
# Written from reading the loaders (no engine is installed here); the sources and commits are cited in
# docs/pipeline.md. A change to our layout that breaks one of these breaks that engine.
#   TGI      server/text_generation_server/models/__init__.py, layers/speculative.py, layers/medusa.py
#   FD       medusa/model/medusa_model.py (MedusaConfig, MedusaModelABC.from_pretrained)
#   TRT-LLM  examples/medusa/convert_checkpoint.py, tensorrt_llm/models/medusa/weight.py
#   vLLM     vllm/transformers_utils/configs/medusa.py, vllm/model_executor/models/medusa.py
MEDUSA_FILES_READ = {
    "tgi": {HEADS_CONFIG, HEADS_WEIGHTS},
    "fasterdecoding": {HEADS_CONFIG, LEGACY_WEIGHTS_NAME},  # its head-only path opens nothing else
    "tensorrt_llm": {HEADS_CONFIG, HEADS_WEIGHTS},  # medusa_lm_head.pt instead when that exists
}
MEDUSA_KEYS_READ = {
    "tgi": {"medusa_num_heads", "medusa_num_layers", "base_model_name_or_path"},
    "fasterdecoding": {"medusa_num_heads", "medusa_num_layers", "base_model_name_or_path"},
    "tensorrt_llm": {"medusa_num_heads", "medusa_num_layers"},
}
VLLM_KEYS_READ = {
    "model_type",
    "architectures",
    "hidden_size",
    "vocab_size",
    "num_heads",
    "num_hidden_layers",
}
VLLM_KEYS_READ |= {"truncated_vocab_size", "medusa_fc_bias"}


def _medusa_names(num_heads: int, num_layers: int) -> set[str]:
    """``{h}.{l}.linear.weight|bias`` (l < L) and ``{h}.{L}.weight``: TGI's MedusaHeadV1 prefixes,
    TensorRT-LLM's ``load_medusa_hf`` keys and FasterDecoding's ``medusa_head`` state-dict names."""
    names = {
        f"{h}.{j}.linear.{p}" for h in range(num_heads) for j in range(num_layers) for p in ("weight", "bias")
    }
    return names | {f"{h}.{num_layers}.weight" for h in range(num_heads)}


def test_medusa_layout_has_every_file_and_key_tgi_and_tensorrt_llm_read(tmp_path: Path) -> None:
    heads = _random_heads()
    save_medusa(heads, tmp_path, extra_config={"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    files = {p.name for p in tmp_path.iterdir()}
    assert MEDUSA_FILES_READ["tgi"] <= files and MEDUSA_FILES_READ["tensorrt_llm"] <= files
    assert LEGACY_WEIGHTS_NAME not in files  # no pickle unless asked for
    config = json.loads((tmp_path / HEADS_CONFIG).read_text())
    assert MEDUSA_KEYS_READ["tgi"] | MEDUSA_KEYS_READ["tensorrt_llm"] <= set(config)
    # TGI: an `architectures` key sends the folder down the non-Medusa speculator path (Medusa silently
    # off); a `model_type` stops its router from taking the tokenizer from base_model_name_or_path.
    assert not set(MEDUSA_FORBIDDEN_KEYS) & set(config)
    # TGI (MedusaHeadV1 for i < medusa_num_heads, blocks for l < medusa_num_layers) and TensorRT-LLM
    # index the safetensors file by these names; a missing one makes TGI fall back to MedusaHeadV2,
    # which ignores the heads' own vocab projections.
    names = set(load_file(str(tmp_path / HEADS_WEIGHTS)))
    assert names == _medusa_names(config["medusa_num_heads"], config["medusa_num_layers"])


def _fasterdecoding_head_only_load(
    directory: Path, hidden_size: int, vocab_size: int
) -> tuple[torch.nn.Module, list]:
    """FasterDecoding's head-only path (``MedusaModelABC.from_pretrained``'s fallback), as that code reads
    the folder: ``MedusaConfig`` keys with their defaults, heads built for 5 whatever the config says,
    ``medusa_num_layers`` copies of ONE ResBlock (list multiplication), then a non-strict load of
    ``medusa_lm_head.pt``. Returns the heads and the missing keys it would ignore."""
    config = json.loads((directory / HEADS_CONFIG).read_text())
    num_layers = config.get("medusa_num_layers", 1)
    assert config.get("base_model_name_or_path", "lmsys/vicuna-7b-v1.3")  # it loads the base model from there

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(hidden_size, hidden_size)
            self.act = torch.nn.SiLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.act(self.linear(x))

    heads = torch.nn.ModuleList(
        [
            torch.nn.Sequential(
                *([Block()] * num_layers), torch.nn.Linear(hidden_size, vocab_size, bias=False)
            )
            for _ in range(5)  # base_model_config.medusa_num_heads = 5, whatever the file says
        ]
    )
    state = torch.load(directory / LEGACY_WEIGHTS_NAME, map_location="cpu", weights_only=True)
    missing, unexpected = heads.load_state_dict(state, strict=False)
    assert not unexpected or len(heads) < config["medusa_num_heads"]
    return heads, missing


@pytest.mark.parametrize("num_heads", [5, 4])
def test_write_pickle_gives_fasterdecoding_its_file_with_the_same_tensors(
    tmp_path: Path, num_heads: int, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    heads = MedusaHeads(D, V, num_heads, 1, base_model_name_or_path="tiny/base")
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    with caplog.at_level("WARNING", logger="medusa_train.formats"):
        save_medusa(heads, tmp_path, write_pickle=True)
    assert "pickle" in caplog.text and "run code" in caplog.text
    assert MEDUSA_FILES_READ["fasterdecoding"] <= {p.name for p in tmp_path.iterdir()}
    pickled = torch.load(tmp_path / LEGACY_WEIGHTS_NAME, map_location="cpu", weights_only=True)
    stored = load_file(str(tmp_path / HEADS_WEIGHTS))
    assert set(pickled) == set(stored) == _medusa_names(num_heads, 1)
    assert all(torch.equal(pickled[k], stored[k]) for k in stored)

    fd_heads, missing = _fasterdecoding_head_only_load(tmp_path, D, V)
    hidden = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = torch.stack([fd_heads[k](hidden) for k in range(num_heads)])  # (K, 2, 5, V)
    # Every head we trained loads and computes the same logits; the weights are bit-identical (above),
    # the products differ only in float summation order (our heads batch their projections).
    torch.testing.assert_close(theirs, _logits(heads), rtol=1e-5, atol=1e-5)
    # The trap the model card warns about: with fewer than 5 heads, head 5 stays random, silently.
    assert sorted(missing) == sorted(_medusa_names(5, 1) - _medusa_names(num_heads, 1))


def test_fasterdecoding_shares_one_block_across_layers(tmp_path: Path) -> None:
    """With medusa_num_layers > 1 FasterDecoding's heads hold one ResBlock L times: the last layer's
    weights overwrite the others, so its logits differ from ours (the model card says so)."""
    heads = _random_heads(num_layers=2)
    save_medusa(heads, tmp_path, write_pickle=True)
    fd_heads, _ = _fasterdecoding_head_only_load(tmp_path, D, V)
    hidden = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = torch.stack([fd_heads[k](hidden) for k in range(K)])
    assert not torch.allclose(theirs, _logits(heads))


def test_our_loaders_never_read_the_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    heads = _random_heads()
    save_medusa(heads, tmp_path, write_pickle=True)
    torch.save({"0.0.linear.weight": torch.zeros(1)}, tmp_path / LEGACY_WEIGHTS_NAME)  # a different pickle

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called: medusa_train read the pickle")

    monkeypatch.setattr(torch, "load", refuse)
    assert detect_layout(tmp_path) == MEDUSA
    assert torch.equal(_logits(load_heads(tmp_path)), _logits(heads))


def test_vllm_config_survives_vllm_medusa_config_renaming(tmp_path: Path) -> None:
    """vLLM's ``MedusaConfig.from_pretrained`` renames every key holding "num" and "heads" to
    ``num_heads`` ("num" and "layers" to ``num_hidden_layers``); ``model_type: medusa`` selects the
    Medusa method, ``architectures: [MedusaModel]`` the model class."""
    heads = _random_heads()
    save_vllm(heads, tmp_path)
    config = json.loads((tmp_path / HEADS_CONFIG).read_text())
    assert VLLM_KEYS_READ <= set(config)
    renamed = dict(config)
    for key in list(renamed):
        if "num" in key and "heads" in key:
            renamed["num_heads"] = renamed.pop(key)
        elif "num" in key and "layers" in key:
            renamed["num_hidden_layers"] = renamed.pop(key)
    assert renamed == config and (config["num_heads"], config["num_hidden_layers"]) == (K, L)
    assert config["model_type"] == "medusa" and config["architectures"][0] == "MedusaModel"
    # vLLM builds Linear(bias=medusa_fc_bias) and ParallelLMHead(truncated_vocab_size, hidden_size).
    tensors = load_file(str(tmp_path / VLLM_WEIGHTS_NAME))
    assert config["medusa_fc_bias"] is True and "blocks.0.layers.0.bias" in tensors
    assert tensors["lm_heads.0.weight"].shape == (config["truncated_vocab_size"], config["hidden_size"])


def test_portable_base_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "runs" / "default" / "pretrain").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert portable_base_model("runs/default/pretrain") == str(tmp_path / "runs" / "default" / "pretrain")
    assert portable_base_model("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert is_hub_id("meta-llama/Llama-3.1-8B") and not is_hub_id(str(tmp_path))
    assert portable_base_model("/nowhere/llama") == "/nowhere/llama"  # another machine's path
    with pytest.raises(HeadsFormatError, match="neither a folder"):
        portable_base_model("runs/other/pretrain")


# -- an exported backbone's config.json read by a transformers 4.x consumer ---------------------------
# The keys and defaults of transformers 4.x (4.45/4.46) LlamaConfig, Qwen2Config and MistralConfig
# __init__, and PretrainedConfig's `torch_dtype` kwarg, as their source reads them. Only what changes
# the math is listed.
_V4_DEFAULTS = {
    "llama": {
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "mistral": {
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096 * 32,
        "tie_word_embeddings": False,
    },
}


def _read_like_transformers_4(config: dict) -> dict:
    """The values a transformers 4.x consumer takes from ``config`` (the exported config.json)."""
    defaults = _V4_DEFAULTS[config["model_type"]]
    out = {key: config.get(key, default) for key, default in defaults.items()}
    out["hidden_size"], out["num_attention_heads"] = config["hidden_size"], config["num_attention_heads"]
    out["num_key_value_heads"] = config.get("num_key_value_heads") or config["num_attention_heads"]
    out["head_dim"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    out["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6)
    out["torch_dtype"] = config.get(
        "torch_dtype"
    )  # PretrainedConfig.__init__: kwargs.pop("torch_dtype", None)
    if out["rope_scaling"] is not None and "type" in out["rope_scaling"]:  # 4.x LlamaConfig's BC step
        out["rope_scaling"]["rope_type"] = out["rope_scaling"]["type"]
    return out


def _inv_freq_like_transformers_4(v4: dict) -> torch.Tensor:
    """RoPE inverse frequencies from the 4.x values: default RoPE, and the 'llama3' rule of 4.x's
    ``_compute_llama3_parameters``."""
    dim = v4["head_dim"]
    inv_freq = 1.0 / (v4["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = v4["rope_scaling"]
    if scaling is None:
        return inv_freq
    assert scaling["rope_type"] == "llama3"
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    ("model_type", "kwargs"),
    [
        (
            "llama",
            {"rope_parameters": {"rope_theta": 500000.0, **_LLAMA3_SCALING}, "max_position_embeddings": 256},
        ),
        ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
        (
            "qwen2",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": True},
        ),
        ("mistral", {}),
    ],
)
def test_backbone_config_reads_the_same_in_transformers_4(
    tmp_path: Path, model_type: str, kwargs: dict
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from medusa_train.transformers4 import add_legacy_config_keys

    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, num_key_value_heads=2, **sizes, **kwargs)
    ).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / HEADS_CONFIG).read_text())
    rope = model.config.rope_parameters
    if rope["rope_theta"] != _V4_DEFAULTS[model_type]["rope_theta"]:  # the bug: 4.x falls back to 10000
        assert _read_like_transformers_4(written)["rope_theta"] != rope["rope_theta"]

    add_legacy_config_keys(tmp_path)
    v4 = _read_like_transformers_4(json.loads((tmp_path / HEADS_CONFIG).read_text()))
    assert v4["rope_theta"] == rope["rope_theta"]
    expected_scaling = (
        None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    )
    assert v4["rope_scaling"] == expected_scaling
    assert v4["torch_dtype"] == "bfloat16"
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert v4["tie_word_embeddings"] == tied
    assert v4["max_position_embeddings"] == model.config.max_position_embeddings
    assert (v4["num_key_value_heads"], v4["head_dim"]) == (2, 8)
    assert v4["rms_norm_eps"] == model.config.rms_norm_eps
    # The RoPE a 4.x consumer computes from those values is the one our model runs.
    ours = type(model.model.rotary_emb)(model.config).inv_freq  # float32, from the in-memory config
    assert torch.allclose(_inv_freq_like_transformers_4(v4), ours, rtol=1e-6, atol=0)

    # transformers 5 reads the file with the added keys back to the same config and the same logits.
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert back.config.rope_parameters == rope
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)  # (1, 6, V)


def test_backbone_tokenizer_reads_in_transformers_4_and_the_same_in_5(
    tmp_path: Path, tiny_backbone_dir: Path
) -> None:
    """transformers 4.x resolves ``tokenizer_class`` by its 4.x names (``TokenizersBackend`` is
    unknown there), reads ``chat_template`` from tokenizer_config.json, and tokenizers < 0.20 reads
    BPE merges only as "a b" strings."""
    import shutil

    from transformers import AutoTokenizer

    from medusa_train.transformers4 import add_legacy_tokenizer_keys, save_tokenizer

    shutil.copytree(tiny_backbone_dir, tmp_path, dirs_exist_ok=True)
    before = AutoTokenizer.from_pretrained(tmp_path)
    assert (
        json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    )
    changed = add_legacy_tokenizer_keys(tmp_path)
    assert "tokenizer.json:merges" in changed
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == (tmp_path / "chat_template.jinja").read_text()
    merges = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"]
    assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)

    after = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "the heads draft"}, {"role": "assistant", "content": "ok!"}]
    for text in ("Medusa heads draft tokens; the backbone verifies them.", " spaces  and\nlines ?!"):
        assert after(text).input_ids == before(text).input_ids
    assert after.apply_chat_template(messages, tokenize=False) == before.apply_chat_template(
        messages, tokenize=False
    )
    assert after.get_vocab() == before.get_vocab() and add_legacy_tokenizer_keys(tmp_path) == []

    # save_tokenizer, through which every tokenizer the pipeline writes goes (stage=pretrain's too):
    # saved by transformers 5 and adapted in one step, read back the same.
    saved = tmp_path / "saved"
    assert set(save_tokenizer(before, saved)) >= {
        "tokenizer_config.json:tokenizer_class",
        "tokenizer.json:merges",
    }
    assert (
        json.loads((saved / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )
    assert add_legacy_tokenizer_keys(saved) == []
    again = AutoTokenizer.from_pretrained(saved)
    for text in ("Medusa heads draft tokens; the backbone verifies them.", " spaces  and\nlines ?!"):
        assert again(text).input_ids == before(text).input_ids
    assert again.get_vocab() == before.get_vocab()
