"""The model card states only figures of the heads it describes; a damaged
Medusa-2 LoRA adapter is one line naming the file and the repair.

- export and eval's card rewrite take tau, speed-up and the distilled data's description from the
  workdir only when they belong to the exported heads (the eval report's heads fingerprint, the
  heads' recorded data key); heads from elsewhere (``export.heads_dir``) get "not measured"/"not
  known", an ``export.dtype`` cast of the workdir's own heads keeps its figures;
- a truncated ``heads/backbone/adapter_model.safetensors`` or a garbage ``adapter_config.json``
  stops export and eval with one line (exit code 2) naming the file and ``training=medusa2``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, LlamaForCausalLM

from medusa_train.__main__ import main
from medusa_train.data.distilled import data_key
from medusa_train.errors import DamagedArtefactError
from medusa_train.heads import MedusaHeads
from medusa_train.report import HEADS_FINGERPRINT, write_model_card
from medusa_train.stages import export
from medusa_train.workdir import Workdir
from tests.helpers.tiny_workdir import make_workdir, tiny_cfg

MANIFEST = {
    "settings": {"data": {"format": "embedded", "num_prompts": 7}},
    "counts": {"records": 7, "tokens": 321},
    "data": {"format": "embedded"},
    "backbone": {"name_or_path": "x", "fingerprint": "abc"},
}
TAU = "**2.47**"


def _measured_workdir(root: Path) -> Path:
    """A tiny workdir whose heads were trained on its distill/ and measured by its eval/ (tau 2.47)."""
    make_workdir(root)
    (root / "distill").mkdir()
    (root / "distill" / "manifest.json").write_text(json.dumps(MANIFEST))
    config_path = root / "heads" / "config.json"
    config = json.loads(config_path.read_text())
    config["training"]["distill"] = data_key(MANIFEST)
    config_path.write_text(json.dumps(config))
    heads = MedusaHeads.from_pretrained(root / "heads")
    report = {"tau": 2.47, "speedup": 1.8, "tree_size": 5, "num_prompts": 3, "greedy_identical": 1.0}
    (root / "eval").mkdir()
    (root / "eval" / "report.json").write_text(json.dumps({**report, HEADS_FINGERPRINT: heads.fingerprint()}))
    return root


def _other_heads(root: Path) -> Path:
    """Another workdir's heads: same shapes, other weights, no record of this workdir's data."""
    make_workdir(root)
    heads = MedusaHeads.from_pretrained(root / "heads")
    with torch.no_grad():
        heads.blocks(0)[0].linear.bias.add_(0.5)
    heads.save_pretrained(root / "heads", extra_config={"training": {"mode": "medusa1"}})
    return root / "heads"


def _card(root: Path) -> str:
    return (root / "export" / "README.md").read_text()


def test_card_states_figures_only_for_the_heads_they_were_measured_on(tmp_path: Path) -> None:
    root = _measured_workdir(tmp_path / "run")
    export.run(tiny_cfg(root, "stage=export"))
    own = _card(root)
    assert TAU in own and "records: `7`" in own and "not measured for these heads" not in own

    # heads of another workdir: neither this workdir's tau nor its distilled data
    export.run(tiny_cfg(root, "stage=export", f"export.heads_dir={_other_heads(tmp_path / 'other')}"))
    foreign = _card(root)
    assert TAU not in foreign and "records: `7`" not in foreign
    assert "not measured for these heads" in foreign and "- not known:" in foreign
    # eval's rewrite of the card (eval measured the workdir's own heads) keeps them apart too
    wd = Workdir(root)
    write_model_card(wd.export, heads_dir=wd.heads, wd=wd)
    assert TAU not in _card(root) and "not measured for these heads" in _card(root)

    # the workdir's own heads cast to float16: still the heads that were measured
    export.run(tiny_cfg(root, "stage=export", "export.dtype=float16"))
    assert TAU in _card(root) and "records: `7`" in _card(root)
    write_model_card(wd.export, heads_dir=wd.heads, wd=wd)
    assert TAU in _card(root) and "records: `7`" in _card(root)

    # the data distilled again since (other counts): the card no longer describes it as theirs
    (root / "distill" / "manifest.json").write_text(json.dumps({**MANIFEST, "counts": {"records": 9}}))
    export.run(tiny_cfg(root, "stage=export"))
    assert "records: `9`" not in _card(root) and "- not known:" in _card(root) and TAU in _card(root)


# -- a damaged Medusa-2 LoRA adapter ---------------------------------------------------------------
def _lora_workdir(root: Path) -> Path:
    """A tiny workdir whose heads ship a LoRA adapter in heads/backbone, as training=medusa2 lora leaves."""
    make_workdir(root)
    base = LlamaForCausalLM.from_pretrained(root / "base_model")
    lora = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(root / "heads" / "backbone")
    AutoTokenizer.from_pretrained(root / "base_model").save_pretrained(root / "heads" / "backbone")
    return root


def _cli_line(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


@pytest.mark.parametrize("damage", ["truncated_weights", "garbage_config"])
def test_damaged_lora_adapter_is_one_line(tmp_path: Path, capsys, damage: str) -> None:
    root = _lora_workdir(tmp_path / "run")
    adapter = root / "heads" / "backbone"
    export.run(tiny_cfg(root, "stage=export"))  # whole: merged and exported
    assert (root / "export" / "backbone" / "config.json").is_file()
    if damage == "truncated_weights":
        path = adapter / "adapter_model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path = adapter / "adapter_config.json"
        path.write_text("{ not json")
    with pytest.raises(DamagedArtefactError, match="training=medusa2 training.overwrite=true"):
        export.run(tiny_cfg(root, "stage=export"))
    overrides = [f"workdir={root}", "debug=fast", "tracking=disabled", "model=hf"]
    overrides += [f"model.name_or_path={root / 'base_model'}", "model.dtype=float32"]
    for stage in ("export", "eval"):
        line = _cli_line(capsys, [f"stage={stage}", *overrides])
        assert str(path) in line and "stage=train training=medusa2 training.overwrite=true" in line, line


def test_card_says_where_the_tree_was_calibrated_only_when_it_ships_the_calibrated_tree(
    tmp_path: Path,
) -> None:
    """calibration.json ships with every export; its device is the calibrated tree's, not a pinned one's
    (stage=export's card and eval's rewrite of it)."""
    root = make_workdir(tmp_path / "run")
    wd = Workdir(root)
    export.run(tiny_cfg(root, "stage=export"))
    assert "5 nodes, in `medusa_choices.json`, calibrated for " in _card(root)
    for pinned in (["tree=chain", "tree.chain_depth=2"], ["tree=custom", "tree.choices=[[0],[1]]"]):
        export.run(tiny_cfg(root, "stage=export", *pinned))
        assert (root / "export" / "calibration.json").is_file()
        assert "calibrated for" not in _card(root) and "2 nodes, in `medusa_choices.json`." in _card(root)
        write_model_card(wd.export, heads_dir=wd.heads, wd=wd)
        assert "calibrated for" not in _card(root) and "2 nodes, in `medusa_choices.json`." in _card(root)


def test_card_matches_the_calibration_to_the_exported_tree_by_its_paths(tmp_path: Path) -> None:
    """A calibration.json that records the paths it chose (``tree.choices``) describes the exported tree
    only when that tree has those paths: another tree of the same name and size gets no "calibrated
    for" (stage=export's card and eval's rewrite), the same paths do in any order and whatever
    ``tree=`` named them. One without the paths is matched by name and size."""
    root = make_workdir(tmp_path / "run")
    wd = Workdir(root)
    path = root / "heads" / "calibration.json"
    calibration = json.loads(path.read_text())
    shipped = json.loads((root / "heads" / "medusa_choices.json").read_text())
    other = [[rank] for rank in range(len(shipped))]  # as many nodes, other paths
    line = f"Tree: `calibrated`, {len(shipped)} nodes, in `medusa_choices.json`"

    path.write_text(json.dumps({**calibration, "tree": {**calibration["tree"], "choices": other}}))
    export.run(tiny_cfg(root, "stage=export"))
    assert f"{line}." in _card(root)
    write_model_card(wd.export, heads_dir=wd.heads, wd=wd)
    assert f"{line}." in _card(root)

    path.write_text(json.dumps({**calibration, "tree": {**calibration["tree"], "choices": shipped[::-1]}}))
    export.run(tiny_cfg(root, "stage=export"))
    assert f"{line}, calibrated for " in _card(root)
    pinned = json.dumps(shipped).replace(" ", "")
    export.run(tiny_cfg(root, "stage=export", "tree=custom", f"tree.choices={pinned}"))
    assert f"Tree: `custom`, {len(shipped)} nodes, in `medusa_choices.json`, calibrated for " in _card(root)

    path.write_text(json.dumps(calibration))  # no paths recorded: the name and the size decide
    export.run(tiny_cfg(root, "stage=export"))
    assert f"{line}, calibrated for " in _card(root)
    export.run(tiny_cfg(root, "stage=export", "tree=custom", f"tree.choices={pinned}"))
    assert "calibrated for" not in _card(root)


CALIBRATE_AGAIN = "run `python -m medusa_train stage=train` (same settings) to calibrate again"
EXPORT_AGAIN = (  # the export's copy: stage=export copies the heads' own again
    "run `python -m medusa_train stage=export` (same settings) to copy the heads' calibration.json into the "
    "export again (`python -m medusa_train stage=train` first, same settings, if the heads' own is damaged "
    "too)"
)
MEASURE_AGAIN = "run `python -m medusa_train stage=eval` to measure the heads again"


def test_a_damaged_file_the_card_reads_is_one_warning_line(tmp_path: Path, caplog) -> None:
    """calibration.json and eval/report.json with an entry the card reads of the wrong type (a JSON
    boolean for a number too), or missing (one speed-up quartile without the other too), or nested
    deeper than the parser goes, or not UTF-8: export, and eval's rewrite of the card, write it without
    that file, and one warning line names the file, what is wrong and what writes it again (no
    traceback): for the export's copy of calibration.json, stage=export, which copies the heads' own
    again; export does not ship a damaged calibration.json either."""
    root = _measured_workdir(tmp_path / "run")
    wd = Workdir(root)
    export.run(tiny_cfg(root, "stage=export"))
    calibration_path, report_path = wd.export / "calibration.json", root / "eval" / "report.json"
    calibration, report = json.loads(calibration_path.read_text()), json.loads(report_path.read_text())
    cases = [
        (
            calibration_path,
            {**calibration, "tree": [1, 2]},
            "'tree' is a JSON list where an object is expected",
        ),
        (
            calibration_path,
            {**calibration, "tree": {"calibrated_for": "H100"}},
            "'tree.calibrated_for' is a JSON string where an object is expected",
        ),
        (
            calibration_path,
            {**calibration, "tree": {"calibrated_for": {"dtype": "bfloat16"}}},
            "lacks 'tree.calibrated_for.device'",
        ),
        (
            calibration_path,
            {**calibration, "head_topk_accuracy": [[0.5, "x"]]},
            "'head_topk_accuracy[0][1]' is a JSON string where a number is expected",
        ),
        (
            calibration_path,
            {**calibration, "head_topk_accuracy": [[0.5, True]]},
            "'head_topk_accuracy[0][1]' is a JSON boolean where a number is expected",
        ),
        (
            calibration_path,
            {**calibration, "tree": {**calibration["tree"], "context_len": True}},
            "'tree.context_len' is a JSON boolean where a number is expected",
        ),
        (report_path, {**report, "tree_fit": "x"}, "'tree_fit' is a JSON string where an object is expected"),
        (report_path, {**report, "tau": None}, "'tau' is JSON null where a number is expected"),
        (report_path, {**report, "tau": False}, "'tau' is a JSON boolean where a number is expected"),
        (report_path, {**report, "speedup_q25": 1.5}, "has 'speedup_q25' without 'speedup_q75'"),
        (report_path, {**report, "speedup_q75": 2.1}, "has 'speedup_q75' without 'speedup_q25'"),
        (report_path, {**report, "vllm_chain": [{"num_speculative_tokens": 1}]}, "lacks 'vllm_chain[0].tau'"),
        (
            report_path,
            {**report, HEADS_FINGERPRINT: [1]},
            "'heads_fingerprint' is a JSON list where a string",
        ),
        (report_path, "[" * 100_000 + "]" * 100_000, "not valid JSON: RecursionError"),
        (report_path, b'{"tau": "\xff"}', "not valid JSON: UnicodeDecodeError"),
    ]

    def card_warnings(run) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="medusa_train.report"):
            run()
        return [r.getMessage() for r in caplog.records if r.name == "medusa_train.report"]

    for path, content, problem in cases:
        original = path.read_bytes()
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        lines = card_warnings(lambda: write_model_card(wd.export, heads_dir=wd.heads, wd=wd))
        repair = EXPORT_AGAIN if path == calibration_path else MEASURE_AGAIN
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert lines[0].startswith(f"{path} is damaged ({problem}"), lines[0]
        assert lines[0].endswith(f"): {repair}; the model card is written without it"), lines[0]
        if path == report_path:
            assert TAU not in _card(root) and "not measured for these heads" in _card(root)
        else:  # eval measured these heads: the heads' own calibration.json stands in
            assert TAU in _card(root) and "| 1 | t+2 |" in _card(root)
        path.write_bytes(original)

    # export reads the heads' own, and ships it only whole: stage=eval on the export would refuse it
    heads_calibration = wd.heads / "calibration.json"
    for damaged, problem in (
        ({**calibration, "tree": [1, 2]}, "'tree' is a JSON list where an object is expected"),
        (
            {**calibration, "tree": {"context_len": "4k"}},
            "'tree.context_len' is a JSON string where a number",
        ),
    ):
        heads_calibration.write_text(json.dumps(damaged))
        lines = card_warnings(lambda: export.run(tiny_cfg(root, "stage=export")))
        assert len(lines) == 1 and lines[0].startswith(f"{heads_calibration} is damaged ({problem}"), lines
        assert lines[0].endswith(
            f"): {CALIBRATE_AGAIN}; the export and its model card are written without it"
        )
        assert "head accuracy: not measured" in _card(root) and TAU in _card(root)
        assert not calibration_path.exists()
    heads_calibration.write_text(json.dumps(calibration))
    assert card_warnings(lambda: export.run(tiny_cfg(root, "stage=export"))) == []
    assert TAU in _card(root) and "| 1 | t+2 |" in _card(root)
    assert calibration_path.read_bytes() == heads_calibration.read_bytes()


def test_a_vllm_only_export_names_its_heads_and_backbone(tmp_path: Path) -> None:
    """export.formats=[vllm] (the only layout of truncated heads): vllm/config.json names the base
    model, the heads' fingerprint as trained and the backbone, so eval's rewrite of the card keeps the
    figures measured on these heads after an export.dtype cast, as the medusa layout's config lets it."""
    root = _measured_workdir(tmp_path / "run")
    wd = Workdir(root)
    source = MedusaHeads.from_pretrained(wd.heads)
    recorded = json.loads((wd.heads / "config.json").read_text())
    export.run(tiny_cfg(root, "stage=export", "export.formats=[vllm]", "export.dtype=bfloat16"))
    config = json.loads((wd.export / "vllm" / "config.json").read_text())
    assert config[HEADS_FINGERPRINT] == source.fingerprint()
    assert config["backbone"] == recorded["backbone"]
    assert config["base_model_name_or_path"] == str((root / "base_model").resolve())
    assert TAU in _card(root)
    write_model_card(wd.export, heads_dir=wd.heads, wd=wd)
    assert TAU in _card(root) and "not measured for these heads" not in _card(root)
