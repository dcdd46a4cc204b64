"""scripts/bench_decode.py runs end to end on CPU (the --llama8b-shape path at a tiny shape)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_decode")


def test_random_run_reports_everything(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = [
        "--random",
        "--num-prompts",
        "2",
        "--prompt-len",
        "8",
        "--max-new-tokens",
        "12",
        "--repeats",
        "1",
        "--attention",
        "auto",
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    results = json.loads(out.read_text())
    gen = results["generation"]
    assert gen["greedy_mismatches"] == 0 and gen["tau"] >= 1 and gen["speedup"] > 0
    assert 0 <= gen["overhead_fraction"] < 1
    assert gen["forward_ms"] > 0 and gen["overhead_ms"] >= 0
    assert set(results["overhead"]["forward"]["auto"]["8"]) == {"1", "4", "8", "16", "32", "64"}
    assert results["overhead"]["timed"] == {"auto": {"8": "sdpa"}}  # the decoders' auto on a CPU
    assert "| N tree tokens |" in capsys.readouterr().out


def test_llama8b_shape_path_at_tiny_shape(bench):
    args = bench.parse_args(["--llama8b-shape", "--repeats", "1", "--contexts", "16", "32"])
    tiny = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=300)  # fmt: skip
    results = bench.run(args, config_overrides=tiny)
    assert "generation" not in results
    assert set(results["overhead"]["forward"]["sdpa"]) == {"16", "32"}
    assert results["overhead"]["forward"]["sdpa"]["32"]["1"]["relative"] == 1.0
    decoder = results["decoder"]["sdpa"]
    assert decoder["tokens"] == args.max_new_tokens and 0 <= decoder["overhead_fraction"] < 1
    assert "| N tree tokens |" in bench.markdown(results)


def test_llama8b_shape_compares_attentions_in_rounds(bench):
    """Several --attention choices: one model, each timed in every round, medians reported."""
    argv = ["--llama8b-shape", "--repeats", "3", "--contexts", "16", "--max-new-tokens", "6", "--skip-overhead",
            "--attention", "sdpa", "auto"]  # fmt: skip
    tiny = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=300)  # fmt: skip
    results = bench.run(bench.parse_args(argv), config_overrides=tiny)
    assert list(results["decoder"]) == ["sdpa", "auto"]
    for r in results["decoder"].values():
        assert len(r["ms_per_step_rounds"]) == 3 and min(r["ms_per_step_rounds"]) <= r["ms_per_step"]
        assert r["tokens"] == 6
    assert "| auto |" in bench.markdown(results)
    with pytest.raises(SystemExit):  # several attentions only where the decoder table is made
        bench.parse_args(["--random", "--attention", "sdpa", "triton"])


def test_overhead_table_times_the_chosen_tree_attention(bench, monkeypatch):
    """The N-tree-tokens table times each --attention as the decoders run it (a kernel inside
    tree_step, auto resolved at the context: SDPA on a CPU), one column per attention and context."""
    from medusa_train.decoding import attention as attention_module
    from medusa_train.decoding import calibrate as calibrate_module
    from medusa_train.decoding.attention import function as attention_function
    from medusa_train.decoding.attention.sdpa import sdpa_tree_attention

    monkeypatch.setattr(attention_module, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel_calls: list[int] = []  # tree nodes of each Triton call; SDPA stands in for the interpreter
    monkeypatch.setattr(
        attention_function,
        "triton_tree_attention",
        lambda query, *args, **kwargs: (
            kernel_calls.append(query.shape[2]) or sdpa_tree_attention(query, *args, **kwargs)
        ),
    )
    timed: list[str] = []  # the backend of each forward the table times
    verify_forward = calibrate_module.verify_forward
    monkeypatch.setattr(
        calibrate_module, "verify_forward", lambda *args: timed.append(args[-1]) or verify_forward(*args)
    )
    tiny = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=300)  # fmt: skip
    model, heads = bench.build_random(bench.llama8b_config(**tiny), 4, "cpu", torch.float32)
    result = bench.bench_overhead(model, heads, [16], sizes=(1, 4), repeats=1, attentions=["triton", "auto"])
    assert timed == ["triton"] * 6 + ["sdpa"] * 6  # 2 warm-up rounds + 1 timed, 2 sizes, each attention
    assert sorted(set(kernel_calls)) == [1, 4]
    assert result["timed"] == {"triton": {"16": "triton"}, "auto": {"16": "sdpa"}}
    assert set(result["forward"]["triton"]["16"]) == {"1", "4"}
    table = bench.markdown({"overhead": result})
    assert "triton, ctx 16: ms (x N=1)" in table and "auto (sdpa), ctx 16: ms (x N=1)" in table


def test_llama8b_shape_path_bfloat16(bench):
    args = bench.parse_args(
        [
            "--llama8b-shape",
            "--dtype",
            "bfloat16",
            "--repeats",
            "1",
            "--contexts",
            "16",
            "--max-new-tokens",
            "8",
        ]
    )
    tiny = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=300)  # fmt: skip
    results = bench.run(args, config_overrides=tiny)
    assert results["decoder"]["sdpa"]["tokens"] == 8


def test_prompts_from_jsonl(bench, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": [1, 2, 3, 4]}\n{"input_ids": [5, 6]}\n')
    args = bench.parse_args(
        ["--random", "--prompts", str(prompts), "--max-new-tokens", "6", "--repeats", "1"]
    )
    results = bench.run(args)
    assert results["generation"]["prompts"] == 2 and results["generation"]["greedy_mismatches"] == 0


def test_cli_rejects_ambiguous_source(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--random", "--llama8b-shape"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "x"])


def test_batch_size_table(bench, capsys):
    """--batch-sizes: plain batched generate vs batched Medusa, every row identical, same tokens."""
    argv = ["--random", "--num-prompts", "3", "--prompt-len", "6", "--max-new-tokens", "10", "--repeats", "2",
            "--batch-sizes", "1", "2", "--skip-overhead", "--threads", "1"]  # fmt: skip
    results = bench.run(bench.parse_args(argv))
    rows = results["batches"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rows_differing"] == 0 and r["tau"] >= 1
        assert r["plain_tokens_per_s"] > 0 and r["medusa_tokens_per_s"] > 0
        assert r["speedup_min"] <= r["speedup"] * 1.0001 and r["speedup"] <= r["speedup_max"] * 1.0001
    assert "overhead" not in results
    assert "| batch | plain tokens/s |" in bench.markdown(results)


def test_reference_decodes_prompts_that_contain_the_pad_id(bench):
    """The plain reference is greedy decoding of the whole prompt: a prompt token equal to the pad id
    must not be masked out (without an explicit mask `generate` infers one from the pad id)."""
    import torch

    from medusa_train.decoding import MEDUSA_63

    model, heads = bench.build_random(bench.random_run_config(), 4, "cpu", torch.float32)
    prompts = bench.read_prompts(None, model, 8, 32)
    for p in prompts:
        p[0, ::5] = 0  # (1, T): the pad id bench_generation uses without an EOS (--random runs)
    gen = bench.bench_generation(model, heads, prompts, MEDUSA_63, 24, None)
    assert gen["greedy_mismatches"] == 0
