"""stage=export: both layouts written atomically, loaded back with identical logits, tree + model card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from medusa_train.errors import UserError
from medusa_train.formats import MEDUSA_TRAIN_VERSION, VLLM_WEIGHTS_NAME, load_heads
from medusa_train.heads import MedusaHeads
from medusa_train.heads_layout import LEGACY_WEIGHTS_NAME, detect_layout
from medusa_train.report import write_model_card
from medusa_train.stages import export
from medusa_train.workdir import HEADS_WEIGHTS, Workdir
from tests.helpers.tiny_workdir import CHOICES, NUM_HEADS, make_workdir, tiny_cfg


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_workdir(tmp_path_factory.mktemp("export"))


def _logits(heads: MedusaHeads) -> torch.Tensor:
    hidden = torch.randn(1, 4, heads.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return heads(hidden.to(heads.proj(0).weight.dtype))  # (K, 1, 4, V)


def test_export_writes_both_layouts_with_identical_logits(workdir: Path) -> None:
    result = export.run(tiny_cfg(workdir, "stage=export"))
    out = workdir / "export"
    assert result["roundtrip_identical"] and result["num_heads"] == NUM_HEADS
    names = ["README.md", "calibration.json", "custom_generate", "medusa", "medusa_choices.json", "vllm"]
    assert sorted(p.name for p in out.iterdir()) == names
    assert detect_layout(out / "medusa") == "medusa" and detect_layout(out / "vllm") == "vllm"
    assert (out / "vllm" / VLLM_WEIGHTS_NAME).is_file()
    source = load_heads(workdir / "heads")
    for layout in ("medusa", "vllm"):
        assert torch.equal(_logits(load_heads(out / layout)), _logits(source))
    assert sorted(json.loads((out / "medusa_choices.json").read_text())) == sorted(CHOICES)
    # the training settings recorded by stage=train travel with the FasterDecoding config
    assert json.loads((out / "medusa" / "config.json").read_text())["training"]["mode"] == "medusa1"
    card = (out / "README.md").read_text()
    assert str(workdir / "base_model") in card
    assert "| 1 | t+2 | 0.800 | 0.950 |" in card  # head accuracy from calibration.json
    assert "speculative_config" in card and "text-generation-launcher" in card and "trtllm-build" in card
    assert not [p for p in workdir.iterdir() if p.name.startswith(".export")]  # no temp folder left
    assert not (out / "medusa" / LEGACY_WEIGHTS_NAME).exists()  # the pickle only on request
    assert "export.write_pickle=true" in card  # ... and the card says how to ask for it


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("training", ["medusa1", "medusa2"])
def test_exporting_the_same_heads_again_writes_the_same_bytes(
    training: str, tmp_path: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file of a second export is byte-identical to the first one's (the pickle included), with
    the workdir named another way (through a symlink, relative to another folder, with `..`); so is
    the card stage=eval rewrites (no eval report here) reached through the symlink. Medusa-2: the
    heads' trained backbone (here a copy of the base) is exported too, and named in the configs."""
    if training == "medusa2":
        workdir = make_workdir(tmp_path / "run")
        shutil.copytree(workdir / "base_model", workdir / "heads" / "backbone")
    export.run(tiny_cfg(workdir, "stage=export", "export.write_pickle=true"))
    first = _files(workdir / "export")
    assert {"medusa/medusa_lm_head.pt", "custom_generate/generate.py"} <= first.keys()
    assert ("backbone/model.safetensors" in first) == (training == "medusa2")
    (tmp_path / "link").symlink_to(workdir, target_is_directory=True)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    export.run(tiny_cfg(Path("../cwd/../link"), "stage=export", "export.write_pickle=true"))
    second = _files(workdir / "export")
    assert second.keys() == first.keys()
    assert [name for name in first if first[name] != second[name]] == []
    link = tmp_path / "link"
    write_model_card(link / "export", heads_dir=link / "heads", wd=Workdir(link))
    assert (workdir / "export" / "README.md").read_bytes() == first["README.md"]


def test_export_carries_the_medusa_train_version_that_trained_the_heads(tmp_path: Path) -> None:
    """The version stage=train recorded travels into both layouts' config.json and onto the card (a vLLM-only
    export's card, rewritten by stage=eval, reads it from vllm/config.json, as it reads the heads'
    fingerprint); heads without one (trained by an earlier medusa_train) load and export the same,
    naming none."""
    root = make_workdir(tmp_path / "run")
    config_path, out = root / "heads" / "config.json", root / "export"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, MEDUSA_TRAIN_VERSION: "9.8.7"}))
    export.run(tiny_cfg(root, "stage=export"))
    for layout in ("medusa", "vllm"):
        assert json.loads((out / layout / "config.json").read_text())[MEDUSA_TRAIN_VERSION] == "9.8.7"
    assert "- medusa_train_version: `9.8.7`" in (out / "README.md").read_text()

    export.run(tiny_cfg(root, "stage=export", "export.formats=[vllm]"))
    config_path.write_text(json.dumps({**config, MEDUSA_TRAIN_VERSION: "0.0.1"}))  # heads_dir's is not theirs
    write_model_card(out, heads_dir=root / "heads", wd=Workdir(root))
    card = (out / "README.md").read_text()
    assert "- medusa_train_version: `9.8.7`" in card and "0.0.1" not in card

    config.pop(MEDUSA_TRAIN_VERSION)
    config_path.write_text(json.dumps(config))
    result = export.run(tiny_cfg(root, "stage=export"))
    assert result["roundtrip_identical"]
    for layout in ("medusa", "vllm"):
        assert MEDUSA_TRAIN_VERSION not in json.loads((out / layout / "config.json").read_text())
        assert torch.equal(_logits(load_heads(out / layout)), _logits(load_heads(root / "heads")))
    assert MEDUSA_TRAIN_VERSION not in (out / "README.md").read_text()


def test_export_names_the_base_model_absolutely_and_writes_the_pickle_on_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A relative base (as stage=train records `model.name_or_path`) becomes absolute, so TGI and
    FasterDecoding find it from any folder; export.write_pickle=true adds FasterDecoding's file."""
    root = make_workdir(tmp_path / "run")
    config_path = root / "heads" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "base_model_name_or_path": "run/base_model"}))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger="medusa_train.formats"):
        export.run(tiny_cfg(Path("run"), "stage=export", "export.write_pickle=true"))
    medusa = root / "export" / "medusa"
    assert json.loads((medusa / "config.json").read_text())["base_model_name_or_path"] == str(
        root / "base_model"
    )
    assert (medusa / LEGACY_WEIGHTS_NAME).is_file() and "pickle" in caplog.text
    pickled = torch.load(medusa / LEGACY_WEIGHTS_NAME, weights_only=True)
    assert pickled.keys() == load_file(str(medusa / HEADS_WEIGHTS)).keys()
    card = (root / "export" / "README.md").read_text()
    assert "is an absolute path on the machine that exported" in card
    assert f"--model-id {root / 'export' / 'medusa'} --tokenizer-config-path {root / 'base_model'}/" in card
    assert f"--num_medusa_heads {NUM_HEADS} " in card and "which this export has" in card
    assert f"heads {NUM_HEADS + 1}..5 stay random" in card and f"depth <= {NUM_HEADS}" in card
    # stage=eval's rewrite of the card (no eval report yet) says the same
    write_model_card(root / "export", heads_dir=root / "heads", wd=Workdir(root))
    assert (root / "export" / "README.md").read_text() == card
    config_path.write_text(json.dumps({**config, "base_model_name_or_path": "elsewhere/run/base_model"}))
    with pytest.raises(UserError, match="neither a folder"):
        export.run(tiny_cfg(Path("run"), "stage=export"))


def test_export_again_replaces_atomically_and_casts(workdir: Path) -> None:
    export.run(
        tiny_cfg(
            workdir,
            "stage=export",
            "export.formats=[vllm]",
            "export.dtype=bfloat16",
            "tree=chain",
            "tree.chain_depth=2",
        )
    )
    out = workdir / "export"
    assert not (out / "medusa").exists()  # the previous export was replaced, not merged
    heads = load_heads(out / "vllm")
    assert heads.proj(0).weight.dtype == torch.bfloat16
    assert torch.equal(_logits(heads), _logits(load_heads(workdir / "heads").to(torch.bfloat16)))
    assert json.loads((out / "medusa_choices.json").read_text()) == [[0], [0, 0]]
    assert not [p for p in workdir.iterdir() if p.name.startswith(".export")]


def test_export_errors_name_the_fix(tmp_path: Path, workdir: Path) -> None:
    with pytest.raises(UserError, match="stage=train"):
        export.run(tiny_cfg(tmp_path / "empty", "stage=export"))
    no_tree = make_workdir(tmp_path / "no_tree", choices=False)
    with pytest.raises(UserError, match="stage=train"):
        export.run(tiny_cfg(no_tree, "stage=export"))
    with pytest.raises(UserError, match="depth 4"):
        export.run(
            tiny_cfg(workdir, "stage=export", "tree=custom", "tree.choices=[[0],[0,0],[0,0,0],[0,0,0,0]]")
        )


def test_export_refuses_truncated_heads_over_the_whole_vocabulary(tmp_path: Path) -> None:
    """Truncated heads with a draft vocabulary of all V tokens have no layout (vLLM ignores a token map
    unless truncated_vocab_size < vocab_size): a user error before any work, not an ExportError that
    blames the disk."""
    root = make_workdir(tmp_path / "wd")
    own = load_heads(root / "heads")
    heads = MedusaHeads(
        own.hidden_size,
        own.vocab_size,
        own.num_heads,
        own.num_layers,
        own.base_model_name_or_path,
        head_projection="truncated",
        token_map=torch.arange(own.vocab_size),
    )
    heads.heads.load_state_dict(own.heads.state_dict())
    heads.save_pretrained(root / "heads")
    with pytest.raises(UserError, match=f"all {own.vocab_size} tokens") as err:
        export.run(tiny_cfg(root, "stage=export", "export.formats=[vllm]"))
    assert "\n" not in str(err.value)
    assert not (root / "export").exists() and not [p for p in root.iterdir() if p.name.startswith(".export")]


@pytest.mark.parametrize(
    ("value", "overrides", "match"),
    [
        (float("nan"), (), "hold NaN or inf .*training.lr"),
        (1e6, ("export.dtype=float16",), "export.dtype=float16: 1.0.linear.weight exceed its range"),
    ],
    ids=["nan", "float16-overflow"],
)
def test_export_refuses_weights_that_are_not_finite(
    tmp_path: Path, value: float, overrides: tuple[str, ...], match: str
) -> None:
    """NaN weights (diverged training) or a cast past float16's range would read back unequal to
    themselves: one line that names the weights and the fix, not an ExportError that blames the disk."""
    root = make_workdir(tmp_path / "wd")
    heads = load_heads(root / "heads")
    with torch.no_grad():
        heads.blocks(1)[0].linear.weight[0, 0] = value
    heads.save_pretrained(root / "heads")
    with pytest.raises(UserError, match=match):
        export.run(tiny_cfg(root, "stage=export", *overrides))
    assert not (root / "export").exists() and not [p for p in root.iterdir() if p.name.startswith(".export")]


def _flip_last_bytes(path: Path) -> None:
    """Damage the last tensor's data in a safetensors file (its header stays valid)."""
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(b ^ 0x5A for b in data[-4:])
    path.write_bytes(bytes(data))


def test_roundtrip_check_sees_a_corrupted_file(tmp_path: Path) -> None:
    workdir = make_workdir(tmp_path / "wd")
    assert export.run(tiny_cfg(workdir, "stage=export"))["roundtrip_identical"] is True
    out, source = workdir / "export", load_heads(workdir / "heads")
    assert export.roundtrip_identical(source, out / "medusa") and export.roundtrip_identical(
        source, out / "vllm"
    )
    _flip_last_bytes(out / "vllm" / VLLM_WEIGHTS_NAME)
    assert not export.roundtrip_identical(source, out / "vllm")
    (out / "medusa" / "medusa_lm_head.safetensors").write_bytes(b"\x08\x00")  # truncated: unreadable
    assert not export.roundtrip_identical(source, out / "medusa")


def test_export_refuses_a_layout_that_reads_back_different(tmp_path: Path, monkeypatch) -> None:
    workdir = make_workdir(tmp_path / "wd")
    export.run(tiny_cfg(workdir, "stage=export"))
    before = {p.relative_to(workdir): p.read_bytes() for p in (workdir / "export").rglob("*") if p.is_file()}
    save_vllm = export.save_vllm

    def corrupting_save(heads: MedusaHeads, directory: Path, extra_config: dict | None = None) -> Path:
        save_vllm(heads, directory, extra_config)
        _flip_last_bytes(directory / VLLM_WEIGHTS_NAME)
        return directory

    monkeypatch.setattr(export, "save_vllm", corrupting_save)
    with pytest.raises(export.ExportError, match="vllm read back with other weights"):
        export.run(tiny_cfg(workdir, "stage=export", "tree=chain", "tree.chain_depth=2"))
    after = {p.relative_to(workdir): p.read_bytes() for p in (workdir / "export").rglob("*") if p.is_file()}
    assert after == before  # nothing published: the previous export is untouched
    assert not [p for p in workdir.iterdir() if p.name.startswith(".export")]
