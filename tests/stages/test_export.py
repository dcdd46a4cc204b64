"""stage=export: both layouts written atomically, loaded back with identical logits, tree + model card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from medusa_train.errors import UserError
from medusa_train.formats import VLLM_WEIGHTS_NAME, detect_layout, load_heads
from medusa_train.heads import MedusaHeads
from medusa_train.stages import export
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
    names = ["README.md", "calibration.json", "medusa", "medusa_choices.json", "vllm"]
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
    assert str(workdir / "backbone") in card
    assert "| 1 | t+2 | 0.800 | 0.950 |" in card  # head accuracy from calibration.json
    assert "speculative_config" in card and "text-generation-launcher" in card and "trtllm-build" in card
    assert not [p for p in workdir.iterdir() if p.name.startswith(".export")]  # no temp folder left


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
