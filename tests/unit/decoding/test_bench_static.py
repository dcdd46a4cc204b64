"""scripts/bench_static.py runs end to end on CPU (tiny shape): parity rows and every table row."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

from tests.helpers.models import tiny_model
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
    # each step's floor: the weights, then more heads as the tree deepens, more KV with more rows
    floors = {(r["batch"], r["decoder"].rsplit(", ", 1)[1]): r["step_floor_ms"] for r in rows if "batch" in r}
    assert floors[(1, "1 node")] >= results["floor_ms"] * 0.999
    assert floors[(1, "1 node")] < floors[(1, "4 nodes")] < floors[(1, "16 nodes")] <= floors[(1, "64 nodes")]
    assert floors[(1, "1 node")] < floors[(2, "1 node")]


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


def test_truncated_heads_are_recorded_and_timed(tmp_path, capsys):
    """``--head-projection truncated``: heads over the first --draft-vocab tokens, their size in the JSON
    and the table's header, every row timed."""
    bench = load_script("bench_static")
    out = tmp_path / "static.json"
    argv = ["--device", "cpu", "--tiny", "--contexts", "16", "--new-tokens", "6", "--batch-sizes", "1"]
    argv += [
        "--nodes",
        "1",
        "16",
        "--hf-static-contexts",
        "--parity-captures",
        "--head-projection",
        "truncated",
    ]
    assert bench.main(argv + ["--draft-vocab", "100", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    heads = results["heads"]
    assert heads["projection"] == "truncated" and heads["draft_vocab"] == 100
    assert heads["bytes"] == 4 * (100 * 64 + 64 * 64 + 64) * 4  # 4 fp32 heads: projection + one block
    rows = results["rows"]
    assert not [r for r in rows if "error" in r] and len(rows) == 3 and all(r["ms"] > 0 for r in rows)
    assert "truncated projections over 100 tokens" in capsys.readouterr().out


def test_a_context_the_model_cannot_hold_is_refused(capsys):
    """Context + new tokens + tree past the model's positions would time an empty decode: refused
    with one line and exit 2, before any model is built."""
    bench = load_script("bench_static")
    with pytest.raises(SystemExit) as done:
        bench.main(["--device", "cpu", "--contexts", "2048", "8192"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--contexts [8192]" in err and "8064" in err


def test_bench_linear_dry_run_times_every_weight_at_every_token_count(tmp_path):
    """scripts/bench_linear.py on a CPU (tiny shape): a row per weight and token count, the forward's
    sum per token count (layers counted), and the table."""
    bench = load_script("bench_linear")
    out = tmp_path / "linear.json"
    argv = ["--device", "cpu", "--quick", "--dtype", "float32", "--tokens", "1", "8", "--calls", "3"]
    assert bench.main(argv + ["--json", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert len(rows) == 6 * 2 and {r["tokens"] for r in rows} == {1, 8}
    assert all(r["ms"] > 0 and r["gb_s"] > 0 for r in rows)
    per_layer = {r["weight"]: r for r in rows if r["tokens"] == 8}
    layers = bench.TINY["layers"]
    expected = (
        2 * layers * (per_layer["q / o"]["ms"] + per_layer["k / v"]["ms"] + per_layer["gate / up"]["ms"])
    )
    expected += layers * per_layer["down"]["ms"] + per_layer["lm_head"]["ms"]
    forward = {f["tokens"]: f for f in results["forward"]}
    assert forward[8]["ms"] == pytest.approx(expected)
    assert "| tokens | ms | floor ms | x floor |" in results["table"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_bench_linear_refuses_cuda_without_a_device(capsys):
    bench = load_script("bench_linear")
    with pytest.raises(SystemExit) as done:
        bench.main(["--device", "cuda"])
    assert done.value.code == 2 and "--device cpu" in capsys.readouterr().err


def test_sampling_in_the_step_is_recorded_and_timed(tmp_path):
    """``--acceptance sample``: the rule and its settings in the JSON, in the rows' names, every row timed."""
    bench = load_script("bench_static")
    out = tmp_path / "static.json"
    argv = ["--device", "cpu", "--tiny", "--contexts", "16", "--new-tokens", "6", "--batch-sizes", "2"]
    argv += ["--nodes", "1", "16", "--hf-static-contexts", "--parity-captures", "--acceptance", "sample"]
    assert bench.main(argv + ["--top-p", "0.9", "--top-k", "5", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["acceptance"] == {"rule": "sample", "temperature": 0.7, "top_p": 0.9, "top_k": 5}
    rows = results["rows"]
    assert [r["decoder"] for r in rows] == [
        "plain eager generate",
        "static eager sample batch 2, 1 node",
        "static eager sample batch 2, 16 nodes",
    ]
    assert not [r for r in rows if "error" in r] and all(r["ms"] > 0 for r in rows)


def test_bench_sampling_times_every_setting_against_transformers(tmp_path, capsys):
    bench = load_script("bench_sampling")
    out = tmp_path / "sampling.json"
    assert bench.main(["--rows", "3", "--vocab", "300", "--repeats", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    settings = [(r["spread"], r["temperature"], r["top_p"], r["top_k"]) for r in results["results"]]
    assert settings == [(4.0, 0.6, 0.9, 50), (4.0, 0.6, 0.9, 0), (0.5, 0.6, 0.9, 0), (4.0, 1.0, 1.0, 50)]
    assert all(ms > 0 for r in results["results"] for ms in r["ms"].values())
    assert "| rows | spread | temperature |" in capsys.readouterr().out


def test_plain_generate_is_timed_per_decoding_step_without_the_prefill():
    """``generate_ms_per_token`` times the steps between the first and the last token: each step's 20 ms
    counts, the prompt's forward does not, however slow it is in one call and not in another (every
    other prompt forward takes 300 ms here: told apart by subtracting calls, ~100 ms per token, or less
    than zero)."""
    bench = load_script("bench_static")
    model = tiny_model("llama")
    forward, prompts = model.forward, []

    def busy_forward(input_ids=None, **kwargs):
        if input_ids.shape[1] > 1:  # a call's prompt
            prompts.append(1)
        time.sleep(0.3 if input_ids.shape[1] > 1 and len(prompts) % 2 == 0 else 0.02)
        return forward(input_ids=input_ids, **kwargs)

    model.forward = busy_forward
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    ms = bench.generate_ms_per_token(model, ids, 4, repeats=1, pad_token_id=0)
    assert 20 <= ms < 60, ms
    with pytest.raises(ValueError, match="2 new tokens"):
        bench.generate_ms_per_token(model, ids, 1)
