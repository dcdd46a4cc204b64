"""Tree attention kernels against the SDPA reference with the dense mask, and greedy parity of the
decoders running them.

On a CPU the Triton kernel runs in triton's interpreter (``TRITON_INTERPRET=1``, set here before
triton is first imported; slow, so the shapes are tiny). The CUDA source is compile-checked with
``nvcc`` where it exists; the CUDA runs are ``gpu``-marked.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import transformers as tf  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import medusa_train.decoding.attention as attention_module  # noqa: E402
from medusa_train.decoding import (  # noqa: E402
    StaticDecoder,
    TreeBuffers,
    chain_tree,
    medusa_generate,
    medusa_generate_batch,
    verify_forward,
)
from medusa_train.decoding.attention import (  # noqa: E402
    AUTO_MIN_CONTEXT,
    AUTO_MIN_CONTEXT_CAPTURED,
    KERNEL_NAME,
    PACKED_SDPA_NAME,
    AttentionBackendError,
    TreeMask,
    TreeStep,
    chunk_refusal,
    hf_packed_sdpa_attention,
    hf_tree_attention,
    kernel_refusal,
    packed_sdpa,
    resolve_attention,
    tree_attention,
    tree_step,
)
from medusa_train.decoding.attention.cuda_kernel import SOURCE, cuda_tree_attention, nvcc_path  # noqa: E402
from medusa_train.decoding.attention.sdpa import PACKED_MAX_QUERIES, dense_tree_mask, packed_gqa_sdpa  # noqa: E402
from medusa_train.decoding.attention.triton_kernel import (  # noqa: E402
    LaunchConfig,
    candidate_configs,
    default_config,
    triton_available,
    triton_tree_attention,
    tuning_key,
)
from medusa_train.hf_compat import cache_kwargs  # noqa: E402
from tests.helpers.models import VOCAB, random_heads, random_tree, tiny_model  # noqa: E402
from tests.helpers.scripts import load_script  # noqa: E402

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (error relative to the reference's largest magnitude, elementwise relative error: one unit in the last
# place of the output dtype, which the last rounding may cost)
TOLERANCE = {torch.float32: (1e-5, 0.0), torch.bfloat16: (1e-3, 2**-7), torch.float16: (1e-3, 2**-10)}


def random_case(seed, tree, pasts, starts, hkv, group, head_dim, dtype, device=DEVICE):
    """Random q/k/v for rows with past lengths ``pasts`` and first visible columns ``starts``; the
    cache is 3 columns wider than the longest row (stale columns the kernel must not read)."""
    gen = torch.Generator().manual_seed(seed)
    mask = TreeMask.of(TreeBuffers.from_choices(tree).to(device))
    m = mask.num_nodes
    width = max(pasts) + m + 3
    bsz = len(pasts)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = rand(bsz, hkv * group, m, head_dim)  # (B, Hq, M, D)
    k, v = rand(bsz, hkv, width, head_dim), rand(bsz, hkv, width, head_dim)  # (B, Hkv, W, D)
    k[:, :, -3:] = v[:, :, -3:] = float("nan")  # stale columns: reading one poisons the output
    past = torch.tensor(pasts, device=device)
    start = torch.tensor(starts, device=device)
    return q, k, v, past, start, mask


def reference(q, k, v, past, start, mask, window=None):
    """SDPA with the dense boolean mask in fp32, NaN columns zeroed (SDPA multiplies them by 0)."""
    k, v = k.float().nan_to_num(), v.float().nan_to_num()
    return tree_attention(q.float(), k, v, past, start, mask, window=window, backend="sdpa")


def assert_matches(out, ref, dtype):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol * ref.abs().max().item(), rtol=rtol)


def test_dense_mask_is_the_tree_mask_shifted_to_each_row():
    """The reference's mask: padding and stale columns masked, the past visible, the tree's own mask
    at ``[past_b, past_b + M)``."""
    tree = TreeBuffers.from_choices(random_tree(2, nodes=9))
    mask = TreeMask.of(tree)
    m = mask.num_nodes
    dense = dense_tree_mask(torch.tensor([4, 0]), torch.tensor([1, 0]), mask.bits, mask.depth, 4 + m + 2)
    assert dense.shape == (2, 1, m, 4 + m + 2)
    assert not dense[0, 0, :, 0].any() and dense[0, 0, :, 1:4].all()
    assert torch.equal(dense[0, 0, :, 4 : 4 + m], tree.attn_mask)
    assert torch.equal(dense[1, 0, :, :m], tree.attn_mask) and not dense[:, 0, :, -2:].any()
    # A window of 2 positions: the root (position past) sees itself and one column before it.
    windowed = dense_tree_mask(torch.tensor([4]), torch.tensor([0]), mask.bits, mask.depth, 4 + m, window=2)
    assert windowed[0, 0, 0, :5].tolist() == [False, False, False, True, True]


def test_bitmasks_cover_trees_past_64_nodes():
    tree = TreeBuffers.from_choices(random_tree(3, nodes=150, max_depth=5, max_rank=40))
    mask = TreeMask.of(tree)
    assert mask.bits.shape == (151, 3) and mask.bits.dtype == torch.int64
    dense = dense_tree_mask(torch.tensor([0]), torch.tensor([0]), mask.bits, mask.depth, 151)
    assert torch.equal(dense[0, 0], tree.attn_mask)
    assert torch.equal(mask.prefix(40).bits, mask.bits[:40, :1])


# (tree, past lengths, first visible columns, KV heads, group, head dim, dtype, window)
KERNEL_CASES = {
    "chain-fp32-g1-d64": (chain_tree(4), [37], [0], 2, 1, 64, torch.float32, None),
    "rows-fp32-g4-d128": (random_tree(3, nodes=20), [5, 70, 33], [0, 10, 2], 1, 4, 128, torch.float32, None),
    "rows-bf16-g8-d64": (random_tree(4, nodes=30), [0, 17], [0, 3], 1, 8, 64, torch.bfloat16, None),
    "window-fp32-g2": (random_tree(5, nodes=10), [20, 17], [4, 3], 2, 2, 16, torch.float32, 6),
    "256-nodes-bf16-g4": (
        random_tree(6, nodes=255, max_depth=5, max_rank=60),
        [45],
        [0],
        1,
        4,
        64,
        torch.bfloat16,
        None,
    ),
    # Shapes of real models the ones above leave out: head dims 80 (Phi-2, StableLM), 96 and 256 (Gemma;
    # the CUDA kernel's CUDA-core path), GQA groups of 7 (Qwen2-7B's 28 / 4 heads) and 6 with one KV
    # head (MQA), one node, a row without past, trees of 64 and 65 nodes (one tile of the tree, and one
    # key more).
    "one-node-fp16-g7-d80": (chain_tree(0), [40, 0], [0, 0], 1, 7, 80, torch.float16, None),
    "mqa-bf16-g6-d96": (random_tree(7, nodes=9), [23], [2], 1, 6, 96, torch.bfloat16, None),
    "bf16-g2-d256": (random_tree(8, nodes=9), [30, 0], [0, 0], 2, 2, 256, torch.bfloat16, None),
    "64-nodes-fp16-g2-d128": (random_tree(9, nodes=63, max_depth=5, max_rank=30), [20], [0], 2, 2, 128,
                              torch.float16, None),
    "65-nodes-fp16-g2-d128": (random_tree(9, nodes=64, max_depth=5, max_rank=30), [20], [0], 2, 2, 128,
                              torch.float16, None),
}  # fmt: skip


@needs_triton
@pytest.mark.parametrize("name", list(KERNEL_CASES))
@pytest.mark.torch_only
def test_triton_kernel_matches_sdpa_reference(name):
    tree, pasts, starts, hkv, group, head_dim, dtype, window = KERNEL_CASES[name]
    q, k, v, past, start, mask = random_case(len(name), tree, pasts, starts, hkv, group, head_dim, dtype)
    out = tree_attention(q, k, v, past, start, mask, window=window, backend="triton")
    assert out.shape == q.shape and out.dtype == dtype
    assert_matches(out, reference(q, k, v, past, start, mask, window), dtype)


@needs_triton
@pytest.mark.parametrize(
    ("pasts", "starts", "window", "splits"),
    [([300, 129], [0, 50], None, 3), ([200, 200], [190, 0], None, 5), ([200], [0], 5, 5)],
)
@pytest.mark.torch_only
def test_triton_kernel_split_past_combines_exactly(pasts, starts, window, splits):
    """The past split over several programs (flash-decoding) gives the unsplit result, also where
    splits see no key of a row (left padding up to column 190, a window of 5: all but the last)."""
    q, k, v, past, start, mask = random_case(
        7, random_tree(8, nodes=6), pasts, starts, 1, 2, 32, torch.float32
    )
    args = (q, k, v, past.int(), start.int(), mask.bits_for(window), mask.depth, 32**-0.5)
    out = triton_tree_attention(*args, window=window, num_splits=splits, config=LaunchConfig(16, 16, 4, 1))
    assert_matches(out, reference(q, k, v, past, start, mask, window), torch.float32)


def chunk_rule(past: int, start: int, tree: TreeBuffers, width: int, chunk: int) -> torch.Tensor:
    """``(M, width)`` bool, written out key by key: node i (position ``past - start + depth_i``) sees a
    past column j in ``[start, past)`` (position ``j - start``) or an ancestor node k (position
    ``past - start + depth_k``) only if the two positions lie in one chunk."""
    m = tree.num_nodes
    allowed = torch.zeros(m, width, dtype=torch.bool)
    for i in range(m):
        query = past - start + int(tree.depth[i])
        for j in range(start, past):
            allowed[i, j] = (j - start) // chunk == query // chunk
        for k in range(m):
            key = past - start + int(tree.depth[k])
            allowed[i, past + k] = bool(tree.attn_mask[i, k]) and key // chunk == query // chunk
    return allowed


def test_dense_mask_applies_chunks_by_position():
    """The reference's chunked mask is the rule: positions count from each row's first visible column,
    and a tree node's position is the row's past plus its depth, not its column."""
    tree = TreeBuffers.from_choices(random_tree(4, nodes=10, max_depth=4))
    mask = TreeMask.of(tree)
    pasts, starts, width = [9, 14, 5, 3], [2, 0, 5, 0], 14 + tree.num_nodes + 2
    for chunk in (3, 4, 7):
        dense = dense_tree_mask(
            torch.tensor(pasts), torch.tensor(starts), mask.bits, mask.depth, width, chunk=chunk
        )
        for b, (past, start) in enumerate(zip(pasts, starts, strict=True)):
            assert torch.equal(dense[b, 0], chunk_rule(past, start, tree, width, chunk)), (chunk, b)


@needs_triton
@pytest.mark.parametrize(
    ("pasts", "starts", "chunk", "window", "splits"),
    [
        ([37, 20, 9], [0, 5, 0], 8, None, 1),  # rows whose trees cross a chunk's end, and one that does not
        ([300, 129], [0, 50], 64, None, 3),  # splits, some of which see none of a row's chunk
        ([70, 33, 5], [0, 9, 2], 4, 6, 1),  # a window and chunks together (the tighter bound wins)
        ([200], [190], 8, None, 4),  # left padding shifts the chunk ends (positions 8.. from column 198)
    ],
)
@pytest.mark.torch_only
def test_triton_kernel_applies_chunks(pasts, starts, chunk, window, splits):
    """The kernel with a chunk against the reference, on small tiles (several past tiles and tree tiles
    per row), unsplit and split."""
    tree = random_tree(5, nodes=20, max_depth=5)
    q, k, v, past, start, mask = random_case(21, tree, pasts, starts, 2, 2, 32, torch.float32)
    ref = tree_attention(
        q.float(), k.nan_to_num(), v.nan_to_num(), past, start, mask, window=window, chunk=chunk
    )
    assert not torch.allclose(ref, reference(q, k, v, past, start, mask, window))  # the chunk cuts keys
    args = (q, k, v, past.int(), start.int(), mask.bits_for(window), mask.depth, 32**-0.5)
    for config in (LaunchConfig(16, 16, 4, 1), LaunchConfig(64, 32, 4, 1)):
        out = triton_tree_attention(*args, window=window, chunk=chunk, num_splits=splits, config=config)
        assert_matches(out, ref, torch.float32)
    out = tree_attention(q, k, v, past, start, mask, window=window, chunk=chunk, backend="triton")
    assert_matches(out, ref, torch.float32)


def test_reference_with_sinks_scales_the_attention_by_its_share_of_the_softmax():
    """The reference's sinks against another form of the same thing (Granite SWA's): attention without
    sinks times ``sigmoid(lse - sink)``, lse the log-sum-exp of the row's visible scores."""
    tree = random_tree(3, nodes=9)
    q, k, v, past, start, mask = random_case(3, tree, [30, 12], [0, 4], 2, 2, 16, torch.float32)
    k, v = k.nan_to_num(), v.nan_to_num()
    sinks = torch.tensor([-2.0, 0.5, 3.0, 8.0])
    with_sinks = tree_attention(q, k, v, past, start, mask, sinks=sinks)
    dense = dense_tree_mask(past, start, mask.bits, mask.depth, k.shape[2])  # (B, 1, M, W)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 16**-0.5
    lse = scores.masked_fill(~dense, float("-inf")).logsumexp(-1)  # (B, Hq, M)
    share = torch.sigmoid(lse - sinks[None, :, None])[..., None]
    torch.testing.assert_close(with_sinks, tree_attention(q, k, v, past, start, mask) * share)


@needs_triton
@pytest.mark.parametrize(
    ("pasts", "starts", "window", "chunk", "splits", "dtype"),
    [
        ([37, 20], [0, 5], None, None, 1, torch.float32),
        ([300, 129], [0, 50], None, None, 3, torch.float32),  # the combine kernel adds the sink
        ([70, 33, 5], [0, 9, 2], 6, None, 1, torch.float32),  # with a window
        ([70, 33], [0, 9], None, 16, 2, torch.bfloat16),
    ],
)
@pytest.mark.torch_only
def test_triton_kernel_applies_sinks(pasts, starts, window, chunk, splits, dtype):
    """Sinks from -10 to +10 (a sink that takes nearly all of a row's softmax, and one that takes
    none) against the reference, unsplit and split, with a window or chunks, fp32 and bf16."""
    tree = random_tree(6, nodes=12)
    q, k, v, past, start, mask = random_case(22, tree, pasts, starts, 2, 3, 32, dtype)
    sinks = torch.linspace(-10, 10, 6).to(DEVICE)
    ref = tree_attention(
        q.float(), k.float().nan_to_num(), v.float().nan_to_num(), past, start, mask,
        window=window, chunk=chunk, sinks=sinks,
    )  # fmt: skip
    kwargs = dict(window=window, chunk=chunk, sinks=sinks, num_splits=splits)
    args = (q, k, v, past.int(), start.int(), mask.bits_for(window), mask.depth, 32**-0.5)
    for config in (LaunchConfig(16, 16, 4, 1), LaunchConfig(64, 32, 4, 1)):
        assert_matches(triton_tree_attention(*args, **kwargs, config=config), ref, dtype)
    assert not torch.allclose(ref, reference(q, k, v, past, start, mask, window), atol=1e-2)


@needs_triton
@pytest.mark.parametrize(
    ("cap", "window", "chunk", "with_sinks", "splits", "dtype"),
    [
        (1.0, None, None, False, 1, torch.float32),  # every score capped
        (0.3, 6, None, True, 3, torch.float32),  # with a window, sinks, splits
        (30.0, None, 8, False, 2, torch.float32),  # a cap few scores reach, chunks
        (2.0, None, None, False, 1, torch.bfloat16),
    ],
)
@pytest.mark.torch_only
def test_triton_kernel_softcaps_scores(cap, window, chunk, with_sinks, splits, dtype):
    """Softcapped scores (``cap * tanh(x / cap)``, Gemma 2's) against the reference, on scores of a few
    units and up to ~30 (queries scaled up), unsplit and split, with the other score and mask options."""
    tree = random_tree(7, nodes=14)
    q, k, v, past, start, mask = random_case(24, tree, [60, 17], [0, 4], 2, 2, 32, dtype)
    q = q * 4.0
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0], device=DEVICE) if with_sinks else None
    kinds = dict(window=window, chunk=chunk, sinks=sinks, softcap=cap)
    ref = tree_attention(
        q.float(), k.float().nan_to_num(), v.float().nan_to_num(), past, start, mask, **kinds
    )
    args = (q, k, v, past.int(), start.int(), mask.bits_for(window), mask.depth, 32**-0.5)
    for config in (LaunchConfig(16, 16, 4, 1), LaunchConfig(64, 32, 4, 1)):
        assert_matches(triton_tree_attention(*args, **kinds, num_splits=splits, config=config), ref, dtype)
    uncapped = tree_attention(
        q.float(),
        k.float().nan_to_num(),
        v.float().nan_to_num(),
        past,
        start,
        mask,
        **{**kinds, "softcap": None},
    )
    assert not torch.allclose(ref, uncapped, atol=1e-2)


@needs_triton
@pytest.mark.parametrize(("head_dim", "value_dim"), [(24, 12), (192, 128), (16, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.torch_only
def test_triton_kernel_reads_values_of_their_own_width(head_dim, value_dim, dtype):
    """Values narrower than the keys (multi-head latent attention: the tiny models' 24 and 12,
    DeepSeek-V3's 192 and 128) or wider, against the reference, unsplit and split, with sinks too;
    the output is as wide as the values."""
    tree = random_tree(4, nodes=10)
    q, k, _, past, start, mask = random_case(23, tree, [40, 7], [0, 3], 2, 2, head_dim, dtype)
    v = torch.randn(*k.shape[:3], value_dim, generator=torch.Generator().manual_seed(5)).to(k)
    v[:, :, -3:] = float("nan")  # stale columns
    sinks = torch.tensor([-1.0, 0.0, 2.0, 5.0], device=DEVICE)
    args = (q, k, v, past.int(), start.int(), mask.bits, mask.depth, head_dim**-0.5)
    for with_sinks in (None, sinks):
        ref = tree_attention(
            q.float(), k.float().nan_to_num(), v.float().nan_to_num(), past, start, mask, sinks=with_sinks
        )
        assert ref.shape == (*q.shape[:3], value_dim)
        for splits in (1, 3):
            out = triton_tree_attention(
                *args, sinks=with_sinks, num_splits=splits, config=LaunchConfig(16, 16, 4, 1)
            )
            assert out.shape == ref.shape
            assert_matches(out, ref, dtype)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.torch_only
def test_kernels_keep_large_fp16_scores_finite(backend):
    """fp16 queries and keys whose scores reach ~1e2 (a scale the softmax must subtract its running
    max from before exp): finite, and as close to the fp32 reference as PyTorch's own fp16 SDPA (or
    within the short cases' tolerance), split and unsplit."""
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if backend == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    dtype = torch.float16
    q, k, v, past, start, mask = random_case(5, random_tree(2, nodes=9), [300, 40], [0, 3], 2, 2, 64, dtype)
    q = q * 30.0
    ref = reference(q, k, v, past, start, mask)
    torch_fp16 = tree_attention(q, k.nan_to_num(), v.nan_to_num(), past, start, mask, backend="sdpa")
    bound = max(
        2 * (torch_fp16.float() - ref).abs().max().item(), TOLERANCE[dtype][0] * ref.abs().max().item()
    )
    args = (q, k, v, past.int(), start.int(), mask.bits, mask.depth, 64**-0.5)
    kernel = triton_tree_attention if backend == "triton" else cuda_tree_attention
    for splits in (1, 4):
        out = kernel(*args, num_splits=splits)
        assert out.isfinite().all() and (out.float() - ref).abs().max().item() <= bound, splits


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.torch_only
def test_every_launch_config_the_tuner_may_pick_matches_the_reference(dtype):
    """Tile sizes change only how the rows and keys are cut (the interpreter ignores warps and stages),
    never the result: every candidate of the CUDA tuner against the reference, split and unsplit."""
    q, k, v, past, start, mask = random_case(11, random_tree(9, nodes=40), [70, 5], [0, 2], 1, 4, 64, dtype)
    ref = reference(q, k, v, past, start, mask)
    args = (q, k, v, past.int(), start.int(), mask.bits, mask.depth, 64**-0.5)
    configs = candidate_configs(4 * mask.num_nodes, 64, dtype)
    assert len(configs) >= 4 and configs[0] == default_config(4 * mask.num_nodes, 64, dtype, "cuda")
    for config in configs:
        for splits in (1, 2):
            out = triton_tree_attention(*args, num_splits=splits, config=config)
            assert_matches(out, ref, dtype)


@needs_triton
@pytest.mark.parametrize(("head_dim", "window"), [(80, None), (16, 6), (64, 40)])
@pytest.mark.torch_only
def test_whole_and_partial_past_tiles_match_the_reference(head_dim, window):
    """Small tiles over long pasts: whole tiles (read without bounds checks; without head-dim masks
    when the head dim is a power of two; with a window, its per-row bound still applied) and the
    partial last tile, unsplit and split, against the reference."""
    tree = random_tree(7, nodes=12)
    q, k, v, past, start, mask = random_case(14, tree, [70, 33, 5], [0, 9, 2], 1, 2, head_dim, torch.float32)
    ref = reference(q, k, v, past, start, mask, window)
    args = (q, k, v, past.int(), start.int(), mask.bits_for(window), mask.depth, head_dim**-0.5)
    for config in (LaunchConfig(16, 16, 4, 1), LaunchConfig(32, 32, 4, 1)):
        for splits in (1, 3):
            out = triton_tree_attention(*args, window=window, num_splits=splits, config=config)
            assert_matches(out, ref, torch.float32)


@needs_triton
@pytest.mark.torch_only
def test_a_block_reads_the_tree_up_to_its_last_node():
    """Small tiles on a 95-node tree, 2 query heads a KV head: a block of one head's nodes stops at the
    tree tile holding its last node (nodes see only their ancestors, which precede them); a block
    spanning both heads reads the whole tree. The second head's blocks end on nodes 16 and 32, the
    first node of a tile: one tile short, that node would not see itself."""
    tree = random_tree(13, nodes=94, max_rank=3)
    q, k, v, past, start, mask = random_case(12, tree, [9], [0], 1, 2, 16, torch.float32)
    args = (q, k, v, past.int(), start.int(), mask.bits, mask.depth, 16**-0.5)
    ref = reference(q, k, v, past, start, mask)
    for config in (LaunchConfig(16, 16, 4, 1), LaunchConfig(32, 16, 4, 1)):
        assert_matches(triton_tree_attention(*args, num_splits=1, config=config), ref, torch.float32)


def test_tuner_keeps_the_fastest_config_and_never_times_inside_a_trace(monkeypatch):
    from medusa_train.decoding.attention import triton_kernel

    small, large, huge = LaunchConfig(64, 64, 4, 3), LaunchConfig(128, 64, 8, 2), LaunchConfig(128, 128, 8, 2)
    cost = {small: 2.0, large: 1.0}
    launched = []

    def launch(config):
        launched.append(config)
        if config == huge:
            raise RuntimeError("out of resources: shared memory")

    def measure(fn):  # what the launched configuration costs
        fn()
        return cost[launched[-1]]

    monkeypatch.setattr(triton_kernel, "gpu_ms", measure)
    monkeypatch.setattr(triton_kernel, "_TUNED", {})
    candidates, cpu = [small, large, huge], torch.device("cpu")
    assert triton_kernel.select_config(("a",), candidates, launch, cpu) == large
    rounds = triton_kernel.TUNE_ROUNDS
    assert launched == candidates + [small, large] * (rounds - 1)  # the failing one tried once
    timed = len(launched)
    assert triton_kernel.select_config(("a",), candidates, launch, cpu) == large and len(launched) == timed
    assert triton_kernel.tuned_configs() == {("a",): large}

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # a trace: nothing timed or kept
    assert triton_kernel.select_config(("b",), candidates, launch, cpu) == small and len(launched) == timed
    assert triton_kernel.select_config(("a",), candidates, launch, cpu) == large
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setenv("MEDUSA_TRITON_TUNE", "0")
    assert triton_kernel.select_config(("b",), candidates, launch, cpu) == small and len(launched) == timed
    assert ("b",) not in triton_kernel.tuned_configs()
    monkeypatch.setenv("MEDUSA_TRITON_TUNE", "1")
    with triton_kernel.tuning_frozen():  # a timed region: the default, nothing timed or kept
        assert (
            triton_kernel.select_config(("b",), candidates, launch, cpu) == small and len(launched) == timed
        )
        assert triton_kernel.select_config(("a",), candidates, launch, cpu) == large
    assert ("b",) not in triton_kernel.tuned_configs()
    assert triton_kernel.select_config(("b",), candidates, launch, cpu) == large and len(launched) > timed
    with pytest.raises(RuntimeError, match="out of resources"):
        triton_kernel.fastest([huge], launch, measure)


def test_tuner_keeps_each_candidates_fastest_round():
    """A burst of noise in one round decides nothing: each candidate keeps its least time over the rounds."""
    from medusa_train.decoding.attention import triton_kernel

    a, b = LaunchConfig(64, 64, 4, 3), LaunchConfig(32, 64, 4, 3)
    times = {a: iter([5.0, 1.0, 1.2]), b: iter([1.5, 1.5, 1.5])}  # a's first round was disturbed
    launched = []

    def measure(fn):
        fn()
        return next(times[launched[-1]])

    best, measured = triton_kernel.fastest([a, b], launched.append, measure, rounds=3)
    assert best == a and measured == {a: 1.0, b: 1.5}
    assert triton_kernel.fastest([a, b], launched.append, lambda fn: fn() or 1.0, rounds=1)[0] == a


def test_tuning_key_buckets_the_past_by_powers_of_two():
    q = torch.zeros(1, 8, 5, 16)

    def key(width):
        return tuning_key(q, torch.zeros(1, 2, width + 5, 16), 1, None)

    assert key(600) == key(1000) != key(1100)
    assert key(600)[1:7] == (torch.float32, 16, 4, 5, 1, 1)


class _GroupedLayer(torch.nn.Module):
    """What transformers' attention functions read from the attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("dv", [16, 8], ids=["values-as-wide", "values-narrower"])
@pytest.mark.parametrize("kind", ["float", "bool"])
@pytest.mark.parametrize(("hkv", "group", "m"), [(2, 4, 7), (1, 8, 1), (4, 2, 33)])
def test_packed_gqa_sdpa_equals_transformers_sdpa_with_expanded_kv(kind, hkv, group, m, dv):
    """Query heads stacked per KV head give transformers' repeat_kv SDPA output (same layout), also with
    values narrower than the keys (the output as wide as the values)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(hkv * 100 + group * 10 + m)
    bsz, width, d = 2, 45, 16
    q = torch.randn(bsz, m, hkv * group, d, generator=gen).transpose(
        1, 2
    )  # (B, Hq, M, D), as the models give it
    k, v = torch.randn(bsz, hkv, width, d, generator=gen), torch.randn(bsz, hkv, width, dv, generator=gen)
    allowed = torch.rand(bsz, 1, m, width, generator=gen) > 0.3
    allowed[..., 0] = True  # every query sees something
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo().min)
    out = packed_gqa_sdpa(q, k, v, mask, 0.3)
    ref, _ = sdpa_attention_forward(_GroupedLayer(group), q, k, v, mask, scaling=0.3)
    assert out.shape == ref.shape == (bsz, m, hkv * group, dv)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("hkv", "group", "m"), [(2, 4, 7), (4, 2, 33)])
def test_packed_gqa_sdpa_reads_any_layout_sdpa_returns(monkeypatch, hkv, group, m):
    """CUDA's efficient and flash SDPA kernels return (B, H, L, D) as a transpose of a contiguous
    (B, L, H, D) buffer: the packed result is the same for that layout (a ``view`` of it fails)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(7)
    bsz, width, d = 2, 45, 16
    q = torch.randn(bsz, hkv * group, m, d, generator=gen)
    k, v = torch.randn(bsz, hkv, width, d, generator=gen), torch.randn(bsz, hkv, width, d, generator=gen)
    mask = torch.rand(bsz, 1, m, width, generator=gen) > 0.3
    mask[..., 0] = True
    expected = packed_gqa_sdpa(q, k, v, mask, 0.3)
    real = F.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):
        out = real(*args, **kwargs)  # (B, H, L, D)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, L, H, D) in memory

    monkeypatch.setattr(F, "scaled_dot_product_attention", cuda_layout)
    assert not cuda_layout(k, k, v).is_contiguous()
    assert torch.equal(packed_gqa_sdpa(q, k, v, mask, 0.3), expected)


def test_packed_attention_takes_only_masked_short_grouped_calls(monkeypatch):
    """Unmasked calls, head-specific masks, more than PACKED_MAX_QUERIES queries and layers without
    grouped heads go to transformers' SDPA attention."""
    from medusa_train.decoding.attention import hf as attention

    taken = []
    real = attention.packed_gqa_sdpa
    monkeypatch.setattr(attention, "packed_gqa_sdpa", lambda *a: taken.append(1) or real(*a))

    def call(groups, m, mask_heads=1, masked=True):
        q = torch.randn(1, 4, m, 8)
        k = v = torch.randn(1, 4 // groups, m + 3, 8)
        mask = torch.zeros(1, mask_heads, m, m + 3) if masked else None
        out, _ = hf_packed_sdpa_attention(_GroupedLayer(groups), q, k, v, mask, scaling=0.5)
        assert out.shape == (1, m, 4, 8)
        return len(taken)

    assert call(2, 5) == 1
    assert call(2, 5, masked=False) == 1
    assert call(2, 5, mask_heads=4) == 1
    assert call(2, PACKED_MAX_QUERIES + 1) == 1
    assert call(1, 5) == 1
    assert call(4, PACKED_MAX_QUERIES) == 2


def test_packed_sdpa_switches_sdpa_models_only_and_restores_on_error():
    model = tiny_model("llama", seed=1)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), packed_sdpa(model):
        assert model.config._attn_implementation == PACKED_SDPA_NAME
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    with packed_sdpa(model):
        assert model.config._attn_implementation == "eager"


def test_tree_forward_is_the_same_with_packed_heads():
    """A grouped-query model's tree forward (4D float mask) inside packed_sdpa: the logits of
    transformers' own SDPA path, and the decoders' greedy output is plain greedy."""
    model = tiny_model("llama", seed=4, hidden=64, heads=8, kv_heads=2)
    tree = TreeBuffers.from_choices(random_tree(2, nodes=20))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, VOCAB, (1, 9), generator=gen)
    logits = []
    for packed in (False, True):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, use_cache=True, **cache_kwargs(model, cache))
            tokens = torch.randint(1, VOCAB, (1, tree.num_nodes), generator=torch.Generator().manual_seed(1))
            mask = dense_tree_mask(
                torch.tensor([9]),
                torch.tensor([0]),
                TreeMask.of(tree).bits,
                TreeMask.of(tree).depth,
                9 + tree.num_nodes,
            )
            fmask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo().min)
            with packed_sdpa(model) if packed else contextlib.nullcontext():
                out = model(
                    input_ids=tokens,
                    attention_mask=fmask,
                    position_ids=(9 + tree.depth)[None],
                    use_cache=True,
                    **cache_kwargs(model, cache),
                )
        logits.append(out.logits)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
    heads = random_heads(model, seed=2)
    ref = plain_greedy(model, prompt[0], 24)
    assert (
        medusa_generate(
            model, heads, prompt, max_new_tokens=24, tree=random_tree(2, nodes=20)
        ).tokens.tolist()
        == ref
    )


def test_every_decoder_verifies_through_the_packed_heads(monkeypatch):
    """attention="sdpa" in the eager, batched and static decoders: each tree forward of a grouped-query
    model runs packed_gqa_sdpa (a call per layer and step), and the output stays plain greedy."""
    from medusa_train.decoding.attention import hf as attention
    from medusa_train.decoding.static import StaticDecoder

    calls = []
    real = attention.packed_gqa_sdpa
    monkeypatch.setattr(attention, "packed_gqa_sdpa", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    model = tiny_model("qwen2", seed=6)
    heads = random_heads(model, seed=1)
    tree = random_tree(3, nodes=10)
    prompts = [torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 11)]
    refs = [plain_greedy(model, p, 12) for p in prompts]
    one = medusa_generate(model, heads, prompts[0][None], max_new_tokens=12, tree=tree)
    assert one.tokens.tolist() == refs[0] and len(calls) >= 2 * one.num_forwards - 2
    calls.clear()
    batch = medusa_generate_batch(model, heads, prompts, max_new_tokens=12, tree=tree)
    assert [r.tokens.tolist() for r in batch.rows] == refs and calls
    calls.clear()
    static = StaticDecoder(model, heads, tree, 48, batch_size=2).generate_batch(prompts, max_new_tokens=12)
    assert [r.tokens.tolist() for r in static.rows] == refs and 11 in calls  # the step's 11 nodes


def test_resolve_attention_on_cpu(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_attention("sdpa", cpu) == "sdpa"
    assert resolve_attention("auto", cpu) == "sdpa"
    with pytest.raises(AttentionBackendError, match="CUDA device"):
        resolve_attention("cuda", cpu)
    with pytest.raises(AttentionBackendError, match="one of"):
        resolve_attention("flash", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(AttentionBackendError, match="CUDA device|not installed"):
        resolve_attention("triton", cpu)


def test_auto_takes_the_kernel_only_for_long_contexts_on_cuda():
    """``auto`` on a CUDA device: SDPA below AUTO_MIN_CONTEXT keys (faster there per call, measured),
    the Triton kernel from there on or when the context is unknown (needs no GPU: nothing runs)."""
    cuda = torch.device("cuda")
    assert resolve_attention("auto", cuda, context=AUTO_MIN_CONTEXT - 1) == "sdpa"
    if triton_available():
        assert resolve_attention("auto", cuda, context=AUTO_MIN_CONTEXT) == "triton"
        assert resolve_attention("auto", cuda) == "triton"
    assert resolve_attention("auto", torch.device("cpu"), context=10**6) == "sdpa"
    # a captured step (no launch cost) takes the kernel from a shorter context
    assert resolve_attention("auto", cuda, context=AUTO_MIN_CONTEXT_CAPTURED - 1, captured=True) == "sdpa"
    if triton_available():
        assert resolve_attention("auto", cuda, context=AUTO_MIN_CONTEXT_CAPTURED, captured=True) == "triton"


def test_tree_step_switches_the_attention_and_restores_it_on_error():
    """Inside a step the model runs the registered function (the reference here: its logits equal the
    dense-mask forward's); after the step, also one that raised, the model's own implementation is back."""
    model = tiny_model("llama", seed=1)
    tree = TreeBuffers.from_choices(random_tree(3, nodes=6))
    mask = TreeMask.of(tree)
    prompt = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(1, VOCAB, (1, mask.num_nodes), generator=torch.Generator().manual_seed(1))
    positions = (7 + tree.depth)[None]  # (1, M)
    allowed = torch.cat([torch.ones(mask.num_nodes, 7, dtype=torch.bool), tree.attn_mask], 1)  # (M, 7 + M)
    dense = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
    outs = []
    for use_step in (False, True):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=prompt, use_cache=True, **cache_kwargs(model, cache))
            step = TreeStep(torch.tensor([7]), torch.tensor([0]), mask, "sdpa")
            with tree_step(model, step) if use_step else contextlib.nullcontext():
                assert model.config._attn_implementation == (KERNEL_NAME if use_step else "sdpa")
                kwargs = dict(position_ids=positions, use_cache=True, **cache_kwargs(model, cache))
                outs.append(
                    model(input_ids=tokens, attention_mask=None if use_step else dense, **kwargs).logits
                )
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="boom"), tree_step(model, step):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_verify_forward_through_the_kernel_equals_the_dense_mask(arch):
    """``verify_forward`` (the forward calibration times) with the kernel gives the dense-mask forward's
    logits and hidden states for a branching tree (mistral: window 8, crossed by the context), each
    appending the tree to the cache."""
    model = tiny_model(arch, seed=2).to(DEVICE)
    tree = TreeBuffers.from_choices(random_tree(3, nodes=7)).to(DEVICE)
    prompt = torch.randint(1, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    tokens = torch.randint(1, VOCAB, (tree.num_nodes,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    outs = []
    for backend in ("sdpa", "triton"):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=prompt, use_cache=True, **cache_kwargs(model, cache))
            outs.append(verify_forward(model, cache, tokens, tree, 11, backend))
        assert cache.get_seq_length() == 11 + tree.num_nodes
    for ref, out in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)  # a wrong mask or position: ~1e-1


def plain_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    out = model.generate(prompt[None], max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_medusa_generate_with_triton_equals_greedy_generate(arch):
    """Batch 1 with the kernel (mistral: sliding window 8, crossed by the context) equals ``generate``;
    the model's attention implementation is back to its own afterwards."""
    model = tiny_model(arch, seed=3)
    heads = random_heads(model, seed=5)
    prompt = torch.randint(1, VOCAB, (9,), generator=torch.Generator().manual_seed(1))
    before = model.config._attn_implementation
    out = medusa_generate(
        model, heads, prompt[None], max_new_tokens=12, tree=random_tree(1, nodes=8), attention="triton"
    )
    assert out.tokens.tolist() == plain_greedy(model, prompt, 12)
    assert model.config._attn_implementation == before


@needs_triton
def test_medusa_generate_batch_with_triton_equals_greedy_generate():
    """Ragged prompts (left padding, rows of different past lengths) on a Qwen2: each row equals its
    own ``generate``."""
    model = tiny_model("qwen2", seed=4)
    heads = random_heads(model, seed=6)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (5, 13, 2)]
    out = medusa_generate_batch(
        model, heads, prompts, max_new_tokens=8, tree=random_tree(2, nodes=6), attention="triton"
    )
    assert [r.tokens.tolist() for r in out.rows] == [plain_greedy(model, p, 8) for p in prompts]


# Models beyond Llama/Qwen2/Mistral, 2 layers of 64 wide: what their attention does that the kernels must
# refuse or follow.
_SMALL = dict(
    hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB
)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
OTHER_MODELS = {
    # attention of its own (local and global layers), not through transformers' attention functions
    "gpt_neo": lambda: tf.GPTNeoConfig(
        hidden_size=64, num_layers=2, num_heads=4, vocab_size=VOCAB, window_size=6,
        attention_types=[[["global", "local"], 1]], max_position_embeddings=64,
    ),
    # through them, without the _supports_attention_backend flag: the kernels serve it
    "stablelm": lambda: tf.StableLmConfig(**{**_SMALL, "hidden_size": 160, "num_attention_heads": 2}),
    # sliding-window layers that pass no sliding_window to their attention (their mask windows them)
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(
        **_SMALL, **_MOE, num_key_value_heads=2, use_sliding_window=True, sliding_window=6,
        max_window_layers=1, num_experts=4, shared_expert_intermediate_size=32,
    ),
    "phimoe": lambda: tf.PhimoeConfig(**_SMALL, num_key_value_heads=2, sliding_window=6, num_local_experts=4),
    # softcapped scores (a cap of 1 with large weights: every score is capped), a window of 6 on layer 0
    "gemma2_softcap": lambda: tf.Gemma2Config(
        **_SMALL, head_dim=16, num_key_value_heads=2, attn_logit_softcapping=1.0, sliding_window=6,
        initializer_range=0.3,
    ),
    # attention sinks; sliding-window (6) and full layers
    "gpt_oss_sinks": lambda: tf.GptOssConfig(
        **_SMALL, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=6,
    ),
    # multi-head latent attention: value heads of 16, query and key heads of 24
    "deepseek_v3_mla": lambda: tf.DeepseekV3Config(
        **_SMALL, **_MOE, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, first_k_dense_replace=2, n_group=1,
        topk_group=1, rope_scaling=None,
    ),
}  # fmt: skip


def other_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(OTHER_MODELS[name]()).eval()


def count_forwards(model: torch.nn.Module) -> list:
    calls: list = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def _triton_decoder_calls(model, heads, max_new_tokens: int) -> list:
    """The three decoders, each asked for the Triton kernel on a 3-token prompt and a 2-node chain (not
    called: a refusal must come before any forward)."""
    prompt, tree = torch.tensor([3, 5, 7]), chain_tree(2)
    return [
        lambda: medusa_generate(
            model, heads, prompt[None], max_new_tokens=max_new_tokens, tree=tree, attention="triton"
        ),
        lambda: medusa_generate_batch(
            model, heads, [prompt], max_new_tokens=max_new_tokens, tree=tree, attention="triton"
        ),
        lambda: StaticDecoder(model, heads, tree, 32, attention="triton"),
    ]


@needs_triton
@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("gpt_neo", "computes its attention itself"),
    ],
)
def test_kernels_refuse_models_they_cannot_compute_before_any_work(name, reason):
    """A kernel named for a model it would compute wrongly (GPT-Neo's layers never call it, and would
    attend the tree without a mask) is one AttentionBackendError before any forward; ``auto`` keeps SDPA
    there, where it takes the kernel for a model it computes."""
    model = other_model(name)
    heads = random_heads(model, seed=1)
    calls = count_forwards(model)
    for decode in _triton_decoder_calls(model, heads, max_new_tokens=4):
        with pytest.raises(AttentionBackendError, match=f"attention=triton cannot run here: .*{reason}"):
            decode()
    assert not calls
    assert resolve_attention("auto", torch.device("cuda"), context=10**6, model=model) == "sdpa"
    served = tiny_model("llama")
    assert kernel_refusal(served) is None and kernel_refusal(other_model("stablelm")) is None
    if triton_available():
        assert resolve_attention("auto", torch.device("cuda"), context=10**6, model=served) == "triton"


def assert_triton_decoders_equal_greedy(
    model, rows: list[torch.Tensor], new_tokens: int, capacity: int
) -> None:
    """The three decoders with the Triton kernel and random heads on an 8-node tree (``rows`` ragged in
    the batched and static decoders; the one-row decoder on the longest, the furthest past a chunk's or
    a window's end) return each row's greedy ``generate`` tokens."""
    heads = random_heads(model, seed=1)
    refs = [plain_greedy(model, p, new_tokens) for p in rows]
    tree = random_tree(2, nodes=8)
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    out = medusa_generate(
        model, heads, rows[longest][None], max_new_tokens=new_tokens, tree=tree, attention="triton"
    )
    assert out.tokens.tolist() == refs[longest]
    batch = medusa_generate_batch(
        model, heads, rows, max_new_tokens=new_tokens, tree=tree, attention="triton"
    )
    assert [r.tokens.tolist() for r in batch.rows] == refs
    static = StaticDecoder(model, heads, tree, capacity, batch_size=len(rows), attention="triton")
    assert [r.tokens.tolist() for r in static.generate_batch(rows, max_new_tokens=new_tokens).rows] == refs


def chunked_llama4(no_rope_layers=(1, 1), chunk=8):
    """Llama 4's text model, 2 layers: chunked (RoPE) where ``no_rope_layers`` has 1, global (NoPE)
    where 0."""
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(
        tf.Llama4TextConfig(
            **_SMALL, num_key_value_heads=2, head_dim=16, intermediate_size_mlp=64,
            attention_chunk_size=chunk, num_local_experts=2, num_experts_per_tok=1,
            no_rope_layers=list(no_rope_layers), max_position_embeddings=64, initializer_range=0.2,
        )
    ).eval()  # fmt: skip


@needs_triton
@pytest.mark.parametrize(
    "no_rope_layers", [(1, 1), (1, 0)], ids=["every-layer-chunked", "chunked-and-global"]
)
def test_triton_kernel_decodes_chunked_layers_past_the_chunk(no_rope_layers):
    """Llama 4's chunked layers (chunk 8) with the Triton kernel, prompts and new tokens well past the
    chunk: the three decoders return ``generate``'s tokens (ragged rows in the batched and static
    decoders), and with heads that know each row's continuation the static decoder accepts whole paths
    across chunk boundaries. ``auto`` takes the kernel for such a model; the CUDA kernel, which applies
    no chunk, is refused before any forward where the call's positions pass the chunk."""
    from tests.unit.decoding.test_decoding_architectures import RowsOracle

    model = chunked_llama4(no_rope_layers)
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (11, 5, 17)]
    assert_triton_decoders_equal_greedy(model, rows, 10, capacity=40)
    longer = [plain_greedy(model, p, 20) for p in rows]
    oracle = RowsOracle(model, [torch.cat([p, torch.tensor(r)]) for p, r in zip(rows, longer, strict=True)])
    static = StaticDecoder(model, oracle, chain_tree(4), 40, batch_size=3, attention="triton")
    out = static.generate_batch(rows, max_new_tokens=14)
    assert [r.tokens.tolist() for r in out.rows] == [r[:14] for r in longer]
    assert all(r.accepted_lengths[:2] == [5, 5] for r in out.rows)  # 10 positions: across a chunk's end
    if triton_available():
        assert resolve_attention("auto", torch.device("cuda"), context=10**6, model=model) == "triton"
    assert chunk_refusal(model, 8) is None
    assert "attention_chunk_size=8" in chunk_refusal(model, 9) and "attention=triton" in chunk_refusal(
        model, None
    )


def test_the_cuda_kernel_is_refused_for_chunked_layers_past_the_chunk(monkeypatch):
    """Where the CUDA kernel could run (its device check passed here), a chunked model is refused for it
    before any forward in every decoder once the call's positions pass the chunk, in one line naming the
    chunk; a call inside the chunk runs it (no chunk boundary to apply); ``sdpa`` is never refused."""
    monkeypatch.setattr(attention_module, "_why_not", lambda backend, device: None)
    model = chunked_llama4((1, 0))
    for context in (9, None):
        with pytest.raises(AttentionBackendError, match=r"attention=cuda cannot run here: .*chunk_size=8"):
            resolve_attention("cuda", torch.device("cpu"), context=context, model=model)
    assert resolve_attention("cuda", torch.device("cpu"), context=8, model=model) == "cuda"
    assert resolve_attention("triton", torch.device("cpu"), context=None, model=model) == "triton"
    assert resolve_attention("sdpa", torch.device("cpu"), context=None, model=model) == "sdpa"
    with pytest.raises(ValueError, match="applies no chunk"):
        cuda_tree_attention(*[torch.zeros(1)] * 7, 1.0, chunk=8)


@needs_triton
@pytest.mark.parametrize(
    "no_rope_layers", [(1, 1), (1, 0)], ids=["every-layer-chunked", "chunked-and-global"]
)
def test_verify_forward_through_the_kernel_applies_chunks(no_rope_layers):
    """``verify_forward`` with the kernel gives the dense-mask forward's logits and hidden states for a
    12-node tree of depth 4 at every past length from 0 to 11 (chunk 4: the tree crosses one or two
    chunk ends, at different nodes each time)."""
    model = chunked_llama4(no_rope_layers, chunk=4)
    tree = TreeBuffers.from_choices(random_tree(3, nodes=11, max_depth=4)).to(DEVICE)
    tokens = torch.randint(1, VOCAB, (tree.num_nodes,), generator=torch.Generator().manual_seed(1))
    for past in range(1, 12):
        prompt = torch.randint(1, VOCAB, (1, past), generator=torch.Generator().manual_seed(past))
        outs = []
        for backend in ("sdpa", "triton"):
            cache = DynamicCache()
            with torch.no_grad():
                model(input_ids=prompt, use_cache=True, **cache_kwargs(model, cache))
                outs.append(verify_forward(model, cache, tokens, tree, past, backend))
        for ref, out in zip(outs[0], outs[1], strict=True):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, msg=f"past {past}")


@needs_triton
def test_the_kernel_computes_a_softcap_or_sinks_only_where_the_models_own_attention_does():
    """A layer's softcap and sinks, where the model's own implementation (recorded by ``tree_step``) is
    SDPA, which computes neither (transformers 5.17 loads Gemma 2 with it and drops the softcap): the
    kernel drops them too, as the model's ``generate`` does; under eager attention it applies them."""
    gen = torch.Generator().manual_seed(0)
    q = 4 * torch.randn(1, 4, 3, 16, generator=gen)  # (B, Hq, M, D): scores a cap of 1 changes
    k, v = torch.randn(1, 2, 8, 16, generator=gen), torch.randn(1, 2, 8, 16, generator=gen)
    mask = TreeMask.of(TreeBuffers.from_choices(chain_tree(2)))
    past, start = torch.tensor([5]), torch.tensor([0])
    modifiers = {"softcap": 1.0, "s_aux": torch.tensor([3.0, -1.0, 0.0, 2.0])}
    plain = tree_attention(q, k, v, past, start, mask, scale=0.25).transpose(1, 2)
    applied = tree_attention(
        q, k, v, past, start, mask, scale=0.25, softcap=1.0, sinks=modifiers["s_aux"]
    ).transpose(1, 2)
    assert not torch.allclose(plain, applied, atol=1e-2)
    for own, expected in (("sdpa", plain), (PACKED_SDPA_NAME, plain), ("eager", applied)):
        step = TreeStep(past, start, mask, "triton", model_attention=own)
        out, _ = hf_tree_attention(
            torch.nn.Module(), q, k, v, None, scaling=0.25, medusa_tree_step=step, **modifiers
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=own)


def gpt_oss_with_sinks() -> torch.nn.Module:
    """gpt-oss (sliding-window and full layers) whose sinks are large enough to move its outputs."""
    model = other_model("gpt_oss_sinks")
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(3 * torch.randn(layer.self_attn.sinks.shape, generator=gen))
    return model


@needs_triton
@pytest.mark.parametrize(
    ("make", "cuda_refusal"),
    [
        (gpt_oss_with_sinks, "GptOssForCausalLM has attention sinks, which the CUDA kernel does not apply"),
        (
            lambda: other_model("gemma2_softcap"),
            "the CUDA kernel does not apply Gemma2ForCausalLM's attention softcapping",
        ),
    ],
    ids=["gpt-oss-sinks", "gemma2-softcap"],
)
def test_triton_kernel_decodes_models_with_sinks_or_softcapped_scores(make, cuda_refusal):
    """gpt-oss's attention sinks (one logit per query head joining the softmax) and Gemma 2's softcapped
    scores (a cap of 1: every score capped), each with its window of 6 crossed, with the Triton kernel:
    the three decoders return ``generate``'s tokens (ragged rows in the batched and static decoders),
    and a verification forward equals the dense mask's (the model's own eager attention, which applies
    them itself). ``auto`` takes the kernel; the CUDA kernel, which applies neither, is refused."""
    model = make()
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (9, 4, 13)]
    assert_triton_decoders_equal_greedy(model, rows, 10, capacity=32)
    tree = TreeBuffers.from_choices(random_tree(3, nodes=7))
    tokens = torch.randint(1, VOCAB, (tree.num_nodes,), generator=gen)
    outs = []
    for backend in ("sdpa", "triton"):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=rows[2][None], use_cache=True, **cache_kwargs(model, cache))
            outs.append(verify_forward(model, cache, tokens, tree, 13, backend))
    for ref, out in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)  # sinks or the cap left out: ~1e-1
    if triton_available():
        assert resolve_attention("auto", torch.device("cuda"), context=10**6, model=model) == "triton"
    assert cuda_refusal in kernel_refusal(model, "cuda") and kernel_refusal(model, "triton") is None


@needs_triton
@pytest.mark.parametrize("name", ["qwen2_moe", "phimoe"])
def test_kernel_windows_layers_that_pass_no_window(name):
    """Qwen2-MoE (layer 0 windowed, layer 1 not) and PhiMoE (every layer) window their layers through
    the mask alone: the kernel, given no ``sliding_window``, takes the window from the config as the
    dense mask does (a context of 11 + 8 nodes crosses the window of 6)."""
    model = other_model(name)
    tree = TreeBuffers.from_choices(random_tree(3, nodes=7))
    prompt = torch.randint(1, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(1, VOCAB, (tree.num_nodes,), generator=torch.Generator().manual_seed(1))
    outs = []
    for backend in ("sdpa", "triton"):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=prompt, use_cache=True, **cache_kwargs(model, cache))
            outs.append(verify_forward(model, cache, tokens, tree, 11, backend))
    for ref, out in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)  # without the window: ~2e-1


@needs_triton
def test_kernel_applies_no_window_the_models_code_does_not_read():
    """A Llama whose config carries ``sliding_window=4``, which its code never reads: the kernel attends
    the whole past, as the dense masks and the model's forward do (its verification forward equals the
    same weights' without the key; a context of 11 + 7 nodes crosses the window)."""
    tree = TreeBuffers.from_choices(random_tree(3, nodes=7))
    prompt = torch.randint(1, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(1, VOCAB, (tree.num_nodes,), generator=torch.Generator().manual_seed(1))
    outs = []
    for window, backend in ((None, "sdpa"), (4, "triton"), (4, "sdpa")):
        model = tiny_model("llama", seed=1, sliding_window=window, initializer_range=0.2)
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=prompt, use_cache=True, **cache_kwargs(model, cache))
            outs.append(verify_forward(model, cache, tokens, tree, 11, backend))
    for out in outs[1:]:
        for ref, got in zip(outs[0], out, strict=True):
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        ({"sinks": torch.zeros(4)}, "passes sinks"),
        ({"indices": torch.zeros(1, 3, 2, dtype=torch.long)}, "passes indices"),
        ({"attention_mask": torch.zeros(1, 1, 3, 8)}, "a mask of its own"),
        ({"dropout": 0.1}, "dropout 0.1"),
        ({"value_dim": 8, "backend": "cuda"}, r"value heads \(8\).*\(16\), which the CUDA kernel needs"),
        ({"s_aux": torch.zeros(4), "backend": "cuda"}, "passes s_aux"),
        ({"s_aux": torch.zeros(2), "backend": "triton"}, "passes s_aux"),
        (
            {"sliding_window": 4},
            "passes sliding_window=4 to its attention, but its layer's masks apply no window",
        ),
    ],
)
def test_tree_attention_refuses_calls_it_would_compute_wrongly(call, reason):
    """In a step, a layer's call with what the kernels do not apply (attention sinks under another name,
    the keys of sparse attention, a mask or bias it built itself, dropout; for the CUDA kernel sinks
    and value heads not as wide as its query heads; sinks not one per query head), or a window its
    config gives no layer is one AttentionBackendError, not a result without them."""
    call = dict(call)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 16, generator=gen)  # (B, Hq, M, D)
    k = torch.randn(1, 2, 8, 16, generator=gen)  # (B, Hkv, W, D)
    v = torch.randn(1, 2, 8, call.pop("value_dim", 16), generator=gen)
    mask = TreeMask.of(TreeBuffers.from_choices(chain_tree(2)))
    step = TreeStep(torch.tensor([5]), torch.tensor([0]), mask, call.pop("backend", "sdpa"))
    module = torch.nn.Module()
    attention_mask = call.pop("attention_mask", None)
    with pytest.raises(AttentionBackendError, match=reason):
        hf_tree_attention(module, q, k, v, attention_mask, medusa_tree_step=step, **call)


@needs_triton
def test_verify_forward_through_the_kernel_reads_narrow_value_heads():
    """DeepSeek-V3's value heads (16) are narrower than its queries and keys (24): the Triton kernel's
    verification forward equals the dense mask's (values read at their own width, heads returned at
    theirs)."""
    model = other_model("deepseek_v3_mla")
    tree = TreeBuffers.from_choices(random_tree(3, nodes=4))
    tokens = torch.arange(1, tree.num_nodes + 1)
    outs = []
    for backend in ("sdpa", "triton"):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 5, 7]]), use_cache=True, **cache_kwargs(model, cache))
            outs.append(verify_forward(model, cache, tokens, tree, 3, backend))
    for ref, out in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_kernels_refuse_inputs_they_would_misread():
    """Keys narrower than the queries, or values for fewer columns than the keys, are refused by every
    backend (not read past their width); the CUDA kernel reads values as wide as the queries, and
    refuses narrower ones. It reads K/V as the query's dtype and any dtype but fp16/bf16 as fp32:
    fp64, or K/V of another dtype than the query, is refused before the launch (not read as
    garbage)."""
    q, k, v, past, start, mask = random_case(1, chain_tree(2), [5], [0], 1, 2, 16, torch.float32, "cpu")
    for backend in ("sdpa", "triton", "cuda"):
        for k_, v_ in ((k[..., :8], v), (k, v[:, :, :-1])):
            with pytest.raises(ValueError, match="one head dim D for queries and keys"):
                tree_attention(q, k_, v_, past, start, mask, backend=backend)
    args = (past.int(), start.int(), mask.bits, mask.depth, 0.25)
    with pytest.raises(ValueError, match="values as wide as the queries"):
        cuda_tree_attention(q, k, v[..., :8], *args)
    for q_, k_, v_ in ((q.double(), k.double(), v.double()), (q.half(), k, v)):
        with pytest.raises(ValueError, match="fp16, bf16 or fp32 query, key and value of one dtype"):
            cuda_tree_attention(q_, k_, v_, *args)


@needs_triton
@pytest.mark.torch_only
def test_triton_kernels_compile_for_hopper(tmp_path):
    """The Triton kernels compile for sm_90 down to a cubin, as at their first launch on an H100 (no GPU
    needed; ~20 s): the variants of ``tests.helpers.triton_compile`` (window, chunks, sinks, softcaps,
    split, dtypes, values narrower than the keys, head dims, tiles of 32 to 128 keys). The interpreter
    the tests above run does not generate this code."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.triton_compile"],
        cwd=Path(__file__).resolve().parents[3],  # the repository, where tests.helpers is
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("tree_attn_fwd") == 4 and "tree_attn_combine" in done.stdout, done.stdout


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed")
@pytest.mark.torch_only
def test_cuda_source_compiles(tmp_path):
    """The kernel source compiles for Hopper (nothing runs: no GPU needed)."""
    done = subprocess.run(
        [nvcc_path(), "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "k.cubin"), str(SOURCE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_gpu_kernels_match_sdpa_reference(backend, name):
    tree, pasts, starts, hkv, group, head_dim, dtype, window = KERNEL_CASES[name]
    q, k, v, past, start, mask = random_case(
        len(name), tree, pasts, starts, hkv, group, head_dim, dtype, "cuda"
    )
    out = tree_attention(q, k, v, past, start, mask, window=window, backend=backend)
    assert_matches(out, reference(q, k, v, past, start, mask, window), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_kernels_long_context_split(backend):
    """8K context, 64 nodes, bf16, 32/8 heads, head dim 128: the split path is as close to the fp32
    reference as PyTorch's own bf16 SDPA is (over thousands of keys, rounding the probabilities to
    bf16 before the value product, as flash attention does, moves a few outputs past the fixed
    tolerance of the short cases)."""
    q, k, v, past, start, mask = random_case(
        9, random_tree(9, nodes=63), [8000, 5000], [0, 100], 8, 4, 128, torch.bfloat16, "cuda"
    )
    out = tree_attention(q, k, v, past, start, mask, backend=backend)
    ref = reference(q, k, v, past, start, mask)
    torch_bf16 = tree_attention(q, k.nan_to_num(), v.nan_to_num(), past, start, mask, backend="sdpa")
    err = (out.float() - ref).abs().max().item()
    torch_err = (torch_bf16.float() - ref).abs().max().item()
    assert err <= max(2 * torch_err, TOLERANCE[torch.bfloat16][0] * ref.abs().max().item()), (err, torch_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("shape", "kinds"),
    [
        ((8, 4, 128), {"chunk": 8192}),
        ((8, 8, 64), {"sinks": True}),
        ((8, 8, 64), {"sinks": True, "window": 128}),
        ((8, 2, 256), {"softcap": 50.0, "window": 4096}),
        ((16, 1, 192), {"value_dim": 128}),
    ],
    ids=[
        "llama4-chunks",
        "gpt-oss-sinks",
        "gpt-oss-sinks-window",
        "gemma2-softcap-window",
        "deepseek-values",
    ],
)
def test_gpu_triton_kernel_computes_the_models_attention(dtype, shape, kinds):
    """On CUDA (the launcher's own splits and tuned tiles), 64-node trees on two rows crossing a chunk's
    end (8,190 and 8,292 keys, one left-padded) and one long past it (12,000): Llama 4's chunks of 8,192
    (32/8 heads, head dim 128), gpt-oss's sinks (64/8 heads, head dim 64), alone and with its window of
    128, Gemma 2's softcap of 50 with its window of 4,096 (16/8 heads, head dim 256), DeepSeek-V3's values
    of 128 under keys of 192 (16 heads); as close to the fp32 reference as PyTorch's own attention in
    that dtype (or the short cases' tolerance)."""
    hkv, group, head_dim = shape
    q, k, v, past, start, mask = random_case(
        10, random_tree(9, nodes=63), [8190, 8292, 12000], [0, 100, 0], hkv, group, head_dim, dtype, "cuda"
    )
    v = v[..., : kinds.get("value_dim", head_dim)]
    gen = torch.Generator().manual_seed(1)
    sinks = 3 * torch.randn(hkv * group, generator=gen).cuda() if kinds.get("sinks") else None
    kw = dict(window=kinds.get("window"), chunk=kinds.get("chunk"), sinks=sinks, softcap=kinds.get("softcap"))
    ref = tree_attention(q.float(), k.float().nan_to_num(), v.float().nan_to_num(), past, start, mask, **kw)
    out = tree_attention(q, k, v, past, start, mask, backend="triton", **kw)
    torch_same = tree_attention(q, k.nan_to_num(), v.nan_to_num(), past, start, mask, **kw)
    err = (out.float() - ref).abs().max().item()
    torch_err = (torch_same.float() - ref).abs().max().item()
    assert err <= max(2 * torch_err, TOLERANCE[dtype][0] * ref.abs().max().item()), (err, torch_err)


# The CUDA kernel's tensor-core path (fp16/bf16, head dims in (32, 128]) on what the shared cases leave
# out: (tree, past lengths, first visible columns, KV heads, group, head dim, dtype, window, K/V layout,
# KV splits). Layouts: "bhwd" as the cache holds them; "bwhd" heads interleaved (head-dim stride 1,
# 16-byte loads); "bhdw" head-dim stride W (the generic staging path).
TENSOR_CORE_CASES = {
    "window-bf16-g4-d128": (
        random_tree(7, nodes=40),
        [300, 90],
        [0, 5],
        2,
        4,
        128,
        torch.bfloat16,
        50,
        "bhwd",
        None,
    ),
    "fp16-g2-d96-bwhd": (random_tree(8, nodes=20), [200], [0], 2, 2, 96, torch.float16, None, "bwhd", None),
    "bf16-g1-d80-bhdw-70-nodes": (
        random_tree(9, nodes=70, max_depth=4, max_rank=30),
        [130],
        [7],
        1,
        1,
        80,
        torch.bfloat16,
        None,
        "bhdw",
        None,
    ),
    "split-fp16-g8-d64-empty-splits": (
        random_tree(10, nodes=25),
        [3000, 1500, 100],
        [0, 40, 0],
        1,
        8,
        64,
        torch.float16,
        None,
        "bhwd",
        5,
    ),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(TENSOR_CORE_CASES))
def test_gpu_cuda_tensor_core_kernel_matches_sdpa_reference(name):
    """As close to the fp32 reference as PyTorch's own SDPA in the input dtype (the kernel rounds the
    probabilities to that dtype before the value product), or within the short cases' tolerance."""
    tree, pasts, starts, hkv, group, head_dim, dtype, window, layout, splits = TENSOR_CORE_CASES[name]
    q, k, v, past, start, mask = random_case(
        len(name), tree, pasts, starts, hkv, group, head_dim, dtype, "cuda"
    )
    if layout == "bwhd":
        k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))  # (B, Hkv, W, D) views
    elif layout == "bhdw":
        k, v = (x.transpose(2, 3).contiguous().transpose(2, 3) for x in (k, v))
    out = cuda_tree_attention(
        q, k, v, past.int(), start.int(), mask.bits_for(window), mask.depth, head_dim**-0.5, window, splits
    )
    ref = reference(q, k, v, past, start, mask, window)
    torch_same_dtype = tree_attention(
        q, k.nan_to_num(), v.nan_to_num(), past, start, mask, window=window, backend="sdpa"
    )
    err = (out.float() - ref).abs().max().item()
    torch_err = (torch_same_dtype.float() - ref).abs().max().item()
    assert err <= max(2 * torch_err, TOLERANCE[dtype][0] * ref.abs().max().item()), (err, torch_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tuned_triton_configs_match_the_reference():
    """The tuner's pick and every candidate that compiles on this GPU (256 nodes, bf16, GQA 4, head dim
    128: the shape where the tiles matter most) agree with the fp32 reference as closely as PyTorch's
    own bf16 SDPA does."""
    from medusa_train.decoding.attention import triton_kernel

    tree = random_tree(6, nodes=255, max_depth=5, max_rank=60)
    q, k, v, past, start, mask = random_case(3, tree, [3000, 1200], [0, 7], 2, 4, 128, torch.bfloat16, "cuda")
    ref = reference(q, k, v, past, start, mask)
    torch_err = (
        tree_attention(q, k.nan_to_num(), v.nan_to_num(), past, start, mask, backend="sdpa").float() - ref
    )
    bound = max(2 * torch_err.abs().max().item(), TOLERANCE[torch.bfloat16][0] * ref.abs().max().item())
    before = len(triton_kernel.tuned_configs())
    out = tree_attention(q, k, v, past, start, mask, backend="triton")
    assert len(triton_kernel.tuned_configs()) == before + 1
    assert (out.float() - ref).abs().max().item() <= bound
    args = (q, k, v, past.int(), start.int(), mask.bits, mask.depth, 128**-0.5)
    ran = 0
    for config in candidate_configs(4 * mask.num_nodes, 128, torch.bfloat16):
        try:
            out = triton_tree_attention(*args, config=config)
        except Exception as err:  # noqa: BLE001 - a tile this GPU cannot hold: the tuner skips it too
            print(f"{config}: {type(err).__name__}")
            continue
        ran += 1
        assert (out.float() - ref).abs().max().item() <= bound, config
    assert ran >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention", ["triton", "cuda"])
def test_gpu_decoders_with_kernels_equal_greedy(attention):
    model = tiny_model("llama", seed=3, hidden=128, heads=4, kv_heads=2).cuda()
    heads = random_heads(model, seed=5).cuda()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).cuda() for n in (5, 13, 2)]
    tree = random_tree(1, nodes=12)
    refs = [plain_greedy(model, p, 16) for p in prompts]
    one = medusa_generate(model, heads, prompts[0][None], max_new_tokens=16, tree=tree, attention=attention)
    assert one.tokens.tolist() == refs[0]
    out = medusa_generate_batch(model, heads, prompts, max_new_tokens=16, tree=tree, attention=attention)
    assert [r.tokens.tolist() for r in out.rows] == refs


@needs_triton
def test_bench_attention_dry_run_reports_every_method():
    """scripts/bench_attention.py at one tiny CPU shape: every method timed or its failure reported."""
    bench = load_script("bench_attention")
    args = bench.parse_args(["--device", "cpu", "--quick", "--batches", "2", "--iters", "1"])
    rows = bench.run(args)
    assert len(rows) == 1 and rows[0]["batch"] == 2
    row = rows[0]
    assert all(row[m] is not None for m in ("sdpa_float", "sdpa_bool", "flash_nomask", "triton"))
    assert row["triton_err"] < 1e-2  # bf16
    assert row["cuda"] is None and "CUDA device" in row["cuda_error"]
    assert "| llama | 40 | 8 | 2 |" in bench.markdown(rows)
    # K/V bytes and dense products of the case: rows of past 40 and 35 (ragged), 8 nodes each, 4 query
    # and 2 KV heads of dim 16, bf16
    keys = 40 + 35 + 2 * 8
    assert row["kv_bytes"] == 2 * keys * 2 * 16 * 2 and row["dense_flop"] == 4 * keys * 8 * 4 * 16


@needs_triton
def test_bench_attention_times_the_layers_of_models_with_chunks_sinks_softcaps_or_narrower_values():
    """``--models``: each model's layer at the dry run's size with its option applied by the kernel (an
    error of bf16 rounding against the written-out reference; leaving the option out gives ~1e-1), SDPA's
    methods only where SDPA computes the layer, the model's eager attention as the baseline elsewhere."""
    bench = load_script("bench_attention")
    models = ["llama4", "gpt-oss", "gemma2", "deepseek-v3"]
    args = bench.parse_args(
        ["--device", "cpu", "--quick", "--batches", "2", "--iters", "1", "--models", *models]
    )
    rows = bench.run(args)
    assert [r["model"] for r in rows] == models
    for row in rows:
        assert row["triton_err"] < 1e-2 and row["triton_default_err"] < 1e-2, row
        sdpa_computes = row["model"] in ("llama4", "deepseek-v3")
        assert ("sdpa_float" in row) == sdpa_computes and ("eager" in row) != sdpa_computes, row
        assert row.get("sdpa_float", row.get("eager")) is not None
    latent = rows[3]  # keys 16 wide, values 8, one KV head per query head
    keys = 40 + 35 + 2 * 8
    assert latent["kv_bytes"] == keys * 4 * (16 + 8) * 2
    assert "| gpt-oss | 40 | 8 | 2 |" in bench.markdown(rows)
