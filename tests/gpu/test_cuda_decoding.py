"""Every decoding path on a CUDA device: greedy parity in fp32, the identical fraction in bf16/fp16, tree
logits against sequential decoding, calibration's timing and stage=eval. Skipped without CUDA.

bf16/fp16 parity is reported, not asserted exact: a tree forward and a one-token forward run different
attention kernels (a masked memory-efficient kernel against flash), which round differently, and a
near-tie between two tokens can then flip. With ``MEDUSA_GPU_REPORT=<file>`` each test appends its
figures there as JSON lines (``scripts/gpu_check.sh`` sets it and folds them into its summary).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from medusa_train.decoding import (
    MEDUSA_63,
    measure_forward_latency,
    medusa_generate,
    medusa_generate_batch,
    verify_forward,
)
from medusa_train.decoding.static import StaticDecoder
from medusa_train.decoding.tree import TreeBuffers, chain_tree
from medusa_train.hf_compat import cache_kwargs
from tests.helpers.models import random_heads, random_tree, tiny_model

DEVICE = os.environ.get("MEDUSA_GPU_TEST_DEVICE", "cuda")
"""``cpu`` dry-runs these tests on a machine without a GPU (``scripts/gpu_check.sh --device cpu``)."""

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]
TREES = {"chain4": chain_tree(4), "medusa63": MEDUSA_63, "random": random_tree(1)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NEW_TOKENS = 40


def _record(**figures) -> None:
    path = os.environ.get("MEDUSA_GPU_REPORT")
    print(json.dumps(figures))
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(figures) + "\n")


def _model(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    # Wider than the CPU tests' models (64 wide, 4 layers): the GPU kernels' tiling then matters.
    return tiny_model(arch, seed=30 + ARCHS.index(arch), hidden=64, layers=4, max_pos=256).to(DEVICE, dtype)


def _prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (3 + 7 * i % 23,), generator=gen).to(DEVICE) for i in range(n)]


def _plain(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    out = model.generate(
        prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_fp32(arch, tree_name):
    model = _model(arch, torch.float32)
    heads = random_heads(model.cpu(), seed=1).to(DEVICE)
    model.to(DEVICE)
    for prompt in _prompts(4):
        expected = _plain(model, prompt, NEW_TOKENS)
        out = medusa_generate(model, heads, prompt[None], max_new_tokens=NEW_TOKENS, tree=TREES[tree_name])
        assert out.tokens.tolist() == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_parity_fp32(arch):
    model = _model(arch, torch.float32)
    heads = random_heads(model.cpu(), seed=1).to(DEVICE)
    model.to(DEVICE)
    prompts = _prompts(6, seed=3)
    expected = [_plain(model, p, NEW_TOKENS) for p in prompts]
    out = medusa_generate_batch(model, heads, prompts, max_new_tokens=NEW_TOKENS, tree=MEDUSA_63)
    assert [r.tokens.tolist() for r in out.rows] == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_parity_is_reported(arch, dtype):
    """The identical fraction and where rows first differ, batch 1 and batched; a row may differ only at a
    near-tie of plain decoding."""
    model = _model(arch, torch.float32)
    heads = random_heads(model.cpu(), seed=1)
    model = model.to(DEVICE, DTYPES[dtype])
    heads = heads.to(DEVICE, DTYPES[dtype])
    prompts = _prompts(8, seed=5)
    expected = [_plain(model, p, NEW_TOKENS) for p in prompts]
    single = [
        medusa_generate(model, heads, p[None], max_new_tokens=NEW_TOKENS, tree=MEDUSA_63).tokens.tolist()
        for p in prompts
    ]
    batched = [
        r.tokens.tolist()
        for r in medusa_generate_batch(model, heads, prompts, max_new_tokens=NEW_TOKENS, tree=MEDUSA_63).rows
    ]
    figures = {}
    for name, got in (("batch1", single), ("batched", batched)):
        same = [g == e for g, e in zip(got, expected, strict=True)]
        firsts = [
            (p, e, g, _first_difference(g, e))
            for p, g, e in zip(prompts, got, expected, strict=True)
            if g != e
        ]
        figures[name] = {
            "identical": sum(same) / len(same),
            "first_difference_at": [d for *_, d in firsts],
            "logit_gap_at_difference": [_near_tie_gap(model, p, e, g, d) for p, e, g, d in firsts],
        }
    _record(test="half_precision_parity", arch=arch, dtype=dtype, new_tokens=NEW_TOKENS, **figures)
    # Where a row differs, it is at a near-tie of plain decoding: the token Medusa chose is within
    # rounding of plain's choice there (a wrong tree, mask or cache would pick far worse tokens).
    gaps = figures["batch1"]["logit_gap_at_difference"] + figures["batched"]["logit_gap_at_difference"]
    assert all(gap <= NEAR_TIE[dtype] for gap in gaps), gaps


NEAR_TIE = {"bfloat16": 0.25, "float16": 0.05}
"""Largest logit gap (plain's choice minus Medusa's, in plain's own logits at the first differing
position) that half-precision rounding of two attention kernels can explain: a few units in the last
place of logits of order 10 (bf16 keeps 8 bits of mantissa, fp16 11)."""


def _near_tie_gap(model, prompt: torch.Tensor, expected: list[int], got: list[int], at: int | None) -> float:
    """Plain decoding's logit of its own token minus that of Medusa's token at the first difference."""
    if at is None:  # one output is a prefix of the other: a length difference, not a token choice
        return 0.0
    seq = torch.cat([prompt, torch.tensor(expected[:at], device=prompt.device, dtype=prompt.dtype)])
    with torch.inference_mode():
        logits = model(input_ids=seq[None]).logits[0, -1].float()  # (V,)
    return float(logits[expected[at]] - logits[got[at]])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_tree_logits_match_sequential_decoding(dtype):
    """verify_forward's logits for a chain equal one-token-at-a-time decoding within the dtype's rounding."""
    model = _model("llama", DTYPES[dtype])
    prompt = _prompts(1, seed=7)[0][None]  # (1, T)
    chain = torch.randint(1, 128, (6,), device=DEVICE)  # (M,)
    tree = TreeBuffers.from_choices(chain_tree(5)).to(DEVICE)
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=prompt, use_cache=True, **cache_kwargs(model, cache))
        tree_logits, _ = verify_forward(model, cache, chain, tree, prompt.shape[1])  # (M, V)
        seq = model(input_ids=torch.cat([prompt, chain[None]], 1)).logits[0, prompt.shape[1] :]  # (M, V)
    tol = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}[dtype]
    err = (tree_logits.float() - seq.float()).abs().max().item() / seq.float().abs().max().item()
    _record(test="tree_vs_sequential", dtype=dtype, max_relative_error=err)
    assert err < tol


def test_calibration_latency_runs_on_cuda():
    model = _model("llama", torch.bfloat16)
    timings = measure_forward_latency(model, [1, 8, 64], context_len=64, warmup=1, repeats=3)
    assert set(timings) == {1, 8, 64} and all(t["seconds"] > 0 for t in timings.values())


def test_eval_stage_on_cuda(tmp_path: Path):
    pytest.importorskip("hydra")
    from medusa_train.stages import eval as eval_stage
    from tests.helpers.tiny_workdir import make_workdir, tiny_cfg

    workdir = make_workdir(tmp_path / "wd")
    report = eval_stage.run(
        tiny_cfg(workdir, "stage=eval", f"model.device={DEVICE}", "eval.batch_sizes=[1,2]")
    )
    _record(test="eval_stage", tau=report["tau"], greedy_identical=report["greedy_identical"])
    assert report["greedy_identical"] == 1.0
    if DEVICE == "cuda":
        assert report["machine"]["device"] == torch.cuda.get_device_name()
        assert report["tree_fit"]["recalibrated"]  # the workdir's tree was calibrated on the CPU
    assert all(row["identical"] == 1.0 for row in report["batch_sizes"])


@pytest.mark.parametrize("attention", ["sdpa", "auto"])
def test_generate_with_the_static_cache_captures_the_step(tmp_path: Path, attention):
    """``model.generate``'s Medusa path with ``cache_implementation="static"``: the static decoder, its
    step a CUDA graph on CUDA, kept on the model for the next call; greedy identical in fp32, one prompt
    and a left-padded batch."""
    from medusa_train.custom_generate import _STATIC_ATTR, generate, release
    from medusa_train.formats import save_medusa

    model = _model("llama", torch.float32)
    save_medusa(random_heads(model.cpu(), seed=1), tmp_path / "medusa")
    model.to(DEVICE)
    args = dict(
        medusa_heads=str(tmp_path), medusa_choices=[list(p) for p in MEDUSA_63], medusa_attention=attention,
        cache_implementation="static", max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
    )  # fmt: skip
    prompts = _prompts(3, seed=5)
    for _ in range(2):  # the second round replays the decoder the first one captured
        for prompt in prompts:
            out = generate(
                model, input_ids=prompt[None], attention_mask=torch.ones_like(prompt[None]), **args
            )
            assert out[0, len(prompt) :].tolist() == _plain(model, prompt, NEW_TOKENS)
    (decoder,) = vars(model)[_STATIC_ATTR].values()
    assert decoder.capture == ("cuda_graph" if DEVICE == "cuda" else "eager")
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    out = generate(model, input_ids=ids, attention_mask=mask, **args)
    for i, p in enumerate(prompts):
        expected = _plain(model, p, NEW_TOKENS)
        assert out[i, width : width + len(expected)].tolist() == expected
    _record(test="generate_static", attention=attention, capture=decoder.capture, identical=True)
    release(model)


def test_the_repetition_penalty_and_minimum_length_in_the_captured_step():
    """generate's repetition penalty and min_new_tokens inside the captured step (each row's token set,
    EOS ids and bound are state the graph reads and updates): every row identical to ``generate`` with
    the same settings in fp32, two calls on one capture."""
    from medusa_train.decoding.static import StaticDecoder

    model = _model("llama", torch.float32)
    heads = random_heads(model.cpu(), seed=2)
    model.to(DEVICE)
    heads.to(DEVICE)
    capture = "cuda_graph" if DEVICE == "cuda" else "eager"
    prompts = _prompts(3, seed=7)
    eos = _plain(model, prompts[0], NEW_TOKENS)[3]  # plain greedy would stop row 0 at its fourth token
    settings = dict(repetition_penalty=1.3, min_new_tokens=NEW_TOKENS // 2)
    decoder = StaticDecoder(model, heads, MEDUSA_63, 192, batch_size=3, capture=capture, **settings)
    for _ in range(2):
        out = decoder.generate_batch([p[None] for p in prompts], max_new_tokens=NEW_TOKENS, eos_token_id=eos)
        for row, p in zip(out.rows, prompts, strict=True):
            expected = model.generate(
                p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=eos, pad_token_id=0, **settings,
            )[0, len(p) :].tolist()  # fmt: skip
            expected = expected[: expected.index(eos) + 1] if eos in expected else expected
            assert row.tokens.tolist() == expected
    _record(test="static_processors", capture=capture, identical=True)


@pytest.mark.parametrize("capture", ["cuda_graph", "eager"])
def test_static_sampling_distribution_on_the_device(capture):
    """Exact sampling in the static step on the device: the draws of a replayed CUDA graph must be fresh
    on every replay (the generator's offset advances), else the sequences would not fit the joint."""
    if capture == "cuda_graph" and DEVICE != "cuda":
        pytest.skip("a CUDA graph needs a CUDA device")
    from tests.unit.decoding.test_decoding_sampling import check_static_sampling

    check_static_sampling(torch.device(DEVICE), capture, temperature=1.0, top_p=0.9)
    # a seed repeats a call, also the one after the decoder was built (and captured) under that seed
    model = _model("llama", torch.float32)
    heads = random_heads(model.cpu(), seed=1).to(DEVICE)
    model.to(DEVICE)
    prompt = _prompts(1, seed=9)[0][None]
    torch.manual_seed(3)
    decoder = StaticDecoder(
        model, heads, MEDUSA_63, 128, capture=capture, acceptance="sample", temperature=1.0
    )
    first = decoder.generate(prompt, max_new_tokens=20).tokens
    torch.manual_seed(3)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=20).tokens, first)
    _record(test="static_sampling", capture=capture, fits_the_joint=True, seed_repeats=True)


@pytest.mark.parametrize("projection", ["truncated", "shared"])
def test_head_variants_built_on_the_device(projection):
    """Heads over a draft vocabulary, or sharing the backbone's lm_head, built under
    ``with torch.device(DEVICE)`` (as bench_static builds them): both eager decoders and the captured
    step map their candidates on the device, greedy identical to ``generate`` in fp32. On one H100 the
    captured step once failed with truncated heads (their token map was left on the CPU)."""
    from medusa_train.heads import MedusaHeads

    model = _model("llama", torch.float32)
    vocab, d = model.config.vocab_size, model.config.hidden_size
    token_map = None
    if projection == "truncated":
        token_map = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: vocab // 2]
    torch.manual_seed(4)
    with torch.device(DEVICE):
        heads = MedusaHeads(d, vocab, num_heads=4, head_projection=projection, token_map=token_map).eval()
    if projection == "shared":
        heads.bind_lm_head(model.get_output_embeddings())
    capture = "cuda_graph" if DEVICE == "cuda" else "eager"
    prompts = _prompts(3, seed=11)
    expected = [_plain(model, p, NEW_TOKENS) for p in prompts]
    eager = [
        medusa_generate(model, heads, p[None], max_new_tokens=NEW_TOKENS, tree=MEDUSA_63) for p in prompts
    ]
    assert [o.tokens.tolist() for o in eager] == expected
    batched = medusa_generate_batch(model, heads, prompts, max_new_tokens=NEW_TOKENS, tree=MEDUSA_63)
    assert [r.tokens.tolist() for r in batched.rows] == expected
    decoder = StaticDecoder(model, heads, MEDUSA_63, 192, batch_size=3, capture=capture)
    out = decoder.generate_batch([p[None] for p in prompts], max_new_tokens=NEW_TOKENS)
    assert [r.tokens.tolist() for r in out.rows] == expected
    _record(test="head_variants_on_device", projection=projection, capture=capture, identical=True)
