"""scripts/bench_static.py runs end to end on CPU (tiny shape): parity rows and every table row."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.helpers.scripts import load_script


def test_tiny_cpu_run_reports_every_row(tmp_path, capsys):
    bench = load_script("bench_static")
    out = tmp_path / "static.json"
    argv = ["--device", "cpu", "--tiny", "--contexts", "32", "--new-tokens", "8", "--json", str(out)]
    argv += ["--hf-static-contexts", "32", "--parity-captures", "eager", "--batch-sizes", "1", "2"]
    assert bench.main(argv) == 0
    results = json.loads(out.read_text())
    assert [r["identical"] for r in results["parity"]] == ["3/3", "3/3"]
    assert results["attention"] == "sdpa"
    rows = results["rows"]
    assert not [r for r in rows if "error" in r]
    assert [r["decoder"] for r in rows] == [
        "plain eager generate",
        "plain generate static cache",
    ] + [
        f"static eager batch {b}, {n}" for b in (1, 2) for n in ("1 node", "4 nodes", "16 nodes", "64 nodes")
    ]
    assert all(r["ms"] > 0 for r in rows) and results["floor_ms"] > 0
    assert "| context | decoder |" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_tiny_cpu_run_with_the_triton_kernel(tmp_path):
    """``--attention triton`` on CPU (triton's interpreter): recorded in the JSON, every row timed."""
    bench = load_script("bench_static")
    out = tmp_path / "static.json"
    argv = ["--device", "cpu", "--tiny", "--attention", "triton", "--contexts", "16", "--new-tokens", "4"]
    argv += ["--batch-sizes", "2", "--nodes", "4", "--hf-static-contexts", "--parity-captures"]
    assert bench.main(argv + ["--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["attention"] == "triton" and results["parity"] == []
    rows = results["rows"]
    assert [r["decoder"] for r in rows] == ["plain eager generate", "static eager triton batch 2, 4 nodes"]
    assert not [r for r in rows if "error" in r] and all(r["ms"] > 0 for r in rows)


def test_a_context_the_model_cannot_hold_is_refused(capsys):
    """Context + new tokens + tree past the model's positions would time an empty decode: refused
    with one line and exit 2, before any model is built."""
    bench = load_script("bench_static")
    with pytest.raises(SystemExit) as done:
        bench.main(["--device", "cpu", "--contexts", "2048", "8192"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--contexts [8192]" in err and "8064" in err
