"""scripts/bench_calibration.py on CPU: stored heads' accuracy, both timing orders, every trial counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script


def _heads_dir(root: Path) -> Path:
    heads = root / "heads"
    heads.mkdir()
    acc = [[min(1.0, 0.5 + 0.05 * r - 0.1 * k) for r in range(10)] for k in range(3)]  # (K=3, 10)
    calibration = {
        "settings": {"tree_max_nodes": 6, "tree_topk": 3, "tree_latency_context": 16},
        "head_topk_accuracy": acc,
        "tree": {"best": {"nodes": 4}},
    }
    (heads / "calibration.json").write_text(json.dumps(calibration))
    return heads


def test_both_orders_pick_a_tree_every_trial(tiny_backbone_dir: Path, tmp_path: Path, capsys) -> None:
    bench = load_script("bench_calibration")
    out = tmp_path / "calibration.json"
    argv = ["--backbone", str(tiny_backbone_dir), "--heads", str(_heads_dir(tmp_path)), "--trials", "2"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["picks"]) == ["rounds", "one size after the other"]
    for name, picks in result["picks"].items():
        assert len(picks) == 2 and all(1 <= n <= 6 for n in picks)
        assert sum(result["counts"][name].values()) == 2
        # every timed size, N = 1 included, in each trial's curve
        assert all(set(curve) == {"1", "2", "3", "4", "5", "7"} for curve in result["latency_ms"][name])
    assert result["stored_pick"] == 4 and result["context_len"] == 16
    for name, per in result["tolerance_counts"].items():  # every default tolerance, every trial
        assert list(per) == ["0.0", "0.01", "0.02", "0.03", "0.05"]
        assert all(sum(counts.values()) == 2 for counts in per.values())
        assert per["0.0"] == result["counts"][name]  # tolerance 0 is the calibration's own pick
    assert "| rounds |" in capsys.readouterr().out


def test_heads_without_a_calibration_are_refused_in_one_line(tiny_backbone_dir: Path, tmp_path: Path) -> None:
    bench = load_script("bench_calibration")
    with pytest.raises(SystemExit, match="calibration.json not found"):
        bench.main(["--backbone", str(tiny_backbone_dir), "--heads", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main(["--backbone", str(tiny_backbone_dir), "--heads", str(tmp_path), "--trials", "0"])


def test_forwards_are_timed_with_the_attention_named(
    tiny_backbone_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """--attention: every calibration times its forwards with that tree attention, as the stage times
    eval.attention, and the result names it; SDPA by default."""
    from medusa_train.decoding import attention as attention_module
    from medusa_train.decoding import calibrate as calibrate_module
    from medusa_train.decoding.attention import function as attention_function
    from medusa_train.decoding.attention.sdpa import sdpa_tree_attention

    monkeypatch.setattr(attention_module, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(attention_function, "triton_tree_attention", sdpa_tree_attention)  # fast stand-in
    timed: list[str] = []  # the backend of each timed forward
    verify_forward = calibrate_module.verify_forward
    monkeypatch.setattr(
        calibrate_module, "verify_forward", lambda *args: timed.append(args[-1]) or verify_forward(*args)
    )
    bench = load_script("bench_calibration")
    heads = _heads_dir(tmp_path)
    argv = ["--backbone", str(tiny_backbone_dir), "--heads", str(heads), "--trials", "1"]
    result = bench.run(bench.parse_args([*argv, "--attention", "triton"]))
    assert timed and set(timed) == {"triton"} and result["machine"]["attention"] == "triton"
    timed.clear()
    result = bench.run(bench.parse_args(argv))
    assert timed and set(timed) == {"sdpa"} and result["machine"]["attention"] == "sdpa"
