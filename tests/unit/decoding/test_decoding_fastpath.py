"""The decoder's per-step fast paths give exactly what the straightforward code gives.

Covered here: the host-side acceptance walk against the row-wise reference, numpy's argmax against
``torch.argmax``, the cached mask / position views against masks built from scratch, KV compaction
that moves only the out-of-place tail, the first-k head logits (to float rounding: k batched
products vs K), the tree cache of ``as_tree`` and the timing split (only the model call is
"forward"; heads and bookkeeping are overhead). Greedy parity of the whole loop (chain,
``MEDUSA_63``, random trees) is in ``test_decoding_greedy.py``.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import DynamicCache

from medusa_train.decoding import (
    MEDUSA_63,
    PackedHeads,
    TreeBuffers,
    TreeError,
    accept_greedy,
    accept_sample,
    chain_tree,
    medusa_generate,
    tree_attention_mask,
)
from medusa_train.decoding.acceptance import argmax_list, walk_matches
from medusa_train.decoding.generate import _tree_inputs, compact_cache
from medusa_train.decoding.tree import as_tree
from medusa_train.hf_compat import NoKVLayer
from tests.helpers.models import VOCAB, random_heads, random_tree, tiny_model
from tests.helpers.numerics import FP32


def reference_match_path(tree: TreeBuffers, tokens: torch.Tensor, pred: torch.Tensor) -> list[int]:
    """The row-wise rule the walk replaced: longest retrieve-row prefix matching ``pred``."""
    retrieve = tree.retrieve_indices  # (L, D + 1)
    rows = tokens[retrieve.clamp(min=0)]  # (L, D + 1)
    valid = retrieve[:, 1:] >= 0
    match = (rows[:, 1:] == pred[retrieve[:, :-1].clamp(min=0)]) & valid  # (L, D)
    lengths = match.long().cumprod(dim=1).sum(dim=1)  # (L,)
    best = int(lengths.argmax())
    return retrieve[best, : int(lengths[best]) + 1].tolist()


def draft_tokens(tree: TreeBuffers, gen: torch.Generator, vocab: int = 12) -> torch.Tensor:
    """Tokens laid out as the decoder lays them out: rank r of head d is one token for every node."""
    root = torch.randint(0, vocab, (1,), generator=gen)
    top = torch.stack([torch.randperm(vocab, generator=gen)[: tree.topk] for _ in range(tree.max_depth)])
    return torch.cat([root, top.reshape(-1)])[tree.tree_indices]  # (M,)


@pytest.mark.parametrize("choices", [chain_tree(4), MEDUSA_63, random_tree(1), random_tree(2, nodes=35)])
def test_walk_equals_row_reference(choices):
    tree = TreeBuffers.from_choices(choices)
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    lengths = set()
    for _ in range(300):
        tokens = draft_tokens(tree, gen, vocab)
        # Predictions that often agree with a child, so long paths occur.
        pred = torch.randint(0, vocab, (tree.num_nodes,), generator=gen)
        for n, kids in enumerate(tree.child_lists()):
            if kids and torch.rand((), generator=gen) < 0.7:
                # Half the time the rank-0 child, which leads deepest in MEDUSA_63-like trees.
                pick = (
                    0
                    if torch.rand((), generator=gen) < 0.5
                    else torch.randint(0, len(kids), (), generator=gen)
                )
                pred[n] = tokens[kids[int(pick)]]
        expected = reference_match_path(tree, tokens, pred)
        assert walk_matches(tokens.tolist(), pred.tolist(), tree.child_lists()) == expected
        # Through the public rules: greedy (argmax = pred) and sample (point masses at pred).
        logits = torch.full((tree.num_nodes, vocab), -1e4)
        logits[torch.arange(tree.num_nodes), pred] = 0.0
        for result in (
            accept_greedy(tokens, logits, tree),
            accept_greedy(tokens.tolist(), logits, tree),
            accept_sample(tokens, logits, tree, temperature=1.0),
        ):
            assert result.path == expected
            assert result.tokens == tokens[expected].tolist()
            assert result.next_token == int(pred[expected[-1]])
        lengths.add(len(expected))
    assert 1 in lengths and tree.max_depth + 1 in lengths  # no match at all, and a full-depth path


def test_argmax_list_matches_torch_argmax():
    gen = torch.Generator().manual_seed(0)
    cases = [
        torch.randint(0, 3, (7, 50), generator=gen).float(),  # many ties: the first maximum wins
        torch.randn(5, 2048, generator=gen),
        torch.randn(3, 40, generator=gen).double(),
        torch.randn(40, 6, generator=gen).t(),  # not contiguous
        torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [0.0, 0.0, -1.0, 0.0]]),
        torch.randn(4, 30, generator=gen).bfloat16(),  # falls back to torch.argmax
        torch.randn(2, 9, generator=gen, requires_grad=True),
    ]
    for x in cases:
        assert argmax_list(x) == x.argmax(dim=-1).tolist()


def reference_mask(model, tree: TreeBuffers, past_len: int, dtype: torch.dtype):
    """The mask built from scratch for one step (what the decoder built every step before)."""
    m = tree.num_nodes
    allowed = torch.ones(m, past_len + m, dtype=torch.bool)
    allowed[:, past_len:] = tree.attn_mask
    neg = torch.finfo(dtype).min

    def to_float(a):
        return torch.where(a, torch.tensor(0.0, dtype=dtype), torch.tensor(neg, dtype=dtype))[None, None]

    window = getattr(model.config, "sliding_window", None)
    types = getattr(model.config, "layer_types", None)
    if window is None:
        return to_float(allowed)
    q_pos = past_len + tree.depth
    k_pos = torch.cat([torch.arange(past_len), q_pos])
    windowed = allowed & ((q_pos[:, None] - k_pos[None, :]) < window)
    if types is None or all(t == "sliding_attention" for t in types):
        return to_float(windowed)
    return {"full_attention": to_float(allowed), "sliding_attention": to_float(windowed)}


def assert_masks_equal(got, want):
    if isinstance(want, dict):
        assert set(got) == set(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("llama", {}),
        ("mistral", {}),  # sliding_window=8 on every layer
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),  # mixed
    ],
)
@pytest.mark.parametrize("choices", [chain_tree(4), MEDUSA_63])
def test_mask_and_position_views_equal_fresh_masks(arch, extra, choices):
    model = tiny_model(arch, **extra)
    tree = TreeBuffers.from_choices(choices)
    for dtype in (torch.float32, torch.bfloat16):
        first = None
        for max_past in (20, 45):  # the second call grows the cached buffers
            inputs = _tree_inputs(model, tree, max_past, dtype)
            first = first or inputs
            assert inputs.max_past >= max_past
            for past_len in (0, 1, 7, max_past):
                for depth in range(tree.max_depth + 1):
                    sub = tree.prefix(depth)
                    m = sub.num_nodes
                    assert_masks_equal(inputs.mask(past_len, m), reference_mask(model, sub, past_len, dtype))
                    assert_masks_equal(
                        tree_attention_mask(model, sub, past_len, dtype),
                        reference_mask(model, sub, past_len, dtype),
                    )
                    assert inputs.position_ids(past_len, m).tolist() == [(past_len + sub.depth).tolist()]
        assert _tree_inputs(model, tree, 30, dtype) is inputs  # cached: no rebuild for a shorter context
        assert inputs is not first  # 45 > 20: rebuilt wider


def filled_cache(num_layers: int, length: int, seed: int = 0) -> tuple[DynamicCache, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    originals = []
    for layer in range(num_layers):
        k = torch.randn(1, 2, length, 4, generator=gen)
        v = torch.randn(1, 2, length, 4, generator=gen)
        cache.update(k.clone(), v.clone(), layer)
        originals.append((k, v))
    return cache, originals


@pytest.mark.parametrize("path", [[0], [0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 5, 7], [0, 3, 6], [0, 2]])
def test_compact_cache_keeps_the_path(path):
    past_len, m = 3, 8
    cache, originals = filled_cache(2, past_len + m)
    chain_prefix = path == list(range(len(path)))
    pointers = [layer.keys.data_ptr() for layer in cache.layers]
    compact_cache(cache, past_len, path)
    index = list(range(past_len)) + [past_len + p for p in path]
    assert cache.get_seq_length() == past_len + len(path)
    for layer, (k, v), ptr in zip(cache.layers, originals, pointers, strict=True):
        assert torch.equal(layer.keys, k[:, :, index]) and torch.equal(layer.values, v[:, :, index])
        if chain_prefix:  # already in place: nothing copied, the cache is a view of the same memory
            assert layer.keys.data_ptr() == ptr


def test_compact_cache_passes_over_a_layer_that_keeps_no_kv():
    """A cache to go on from that plain generate made for a model whose last layers read an earlier
    layer's KV (Gemma 3n's, Gemma 4's) holds a layer without KV for each (transformers 5.24's
    DummyLayer): the accepted path's entries move in the others, that one is left as it is."""
    past_len, path = 3, [0, 2, 5]
    cache, originals = filled_cache(2, past_len + 8)
    cache.layers.append(NoKVLayer())
    compact_cache(cache, past_len, path)
    index = list(range(past_len)) + [past_len + p for p in path]
    assert cache.get_seq_length() == past_len + len(path)
    for layer, (k, v) in zip(cache.layers[:2], originals, strict=True):
        assert torch.equal(layer.keys, k[:, :, index]) and torch.equal(layer.values, v[:, :, index])
    assert cache.layers[2].keys is None


def test_packed_heads_first_k_rows_are_the_full_rows():
    heads = PackedHeads(random_heads(tiny_model("llama"), num_heads=4))
    h = torch.randn(32)
    full = heads.logits(h)
    for k in (1, 2, 4):  # k batched products vs K: equal to float rounding
        torch.testing.assert_close(heads.logits(h, k), full[:k], **FP32)


def test_as_tree_reuses_buffers_for_the_same_list_and_still_validates():
    first = as_tree([[0], [0, 0], [1]])
    assert as_tree([[0], [0, 0], [1]]) is first  # equal lists: built once
    assert as_tree(((0,), (0, 0), (1,))) is first
    assert as_tree([[1], [0], [0, 0]]) is not first  # another order: its own (equal) buffers
    for bad, fragment in (
        ([[True]], "non-negative ints"),
        ([[1.0]], "non-negative ints"),
        ([[1, 0]], "no parent"),
    ):
        with pytest.raises(TreeError, match=fragment):
            as_tree(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_chain_greedy_parity_with_other_head_dtypes(dtype):
    """Head logits in bf16 or float64 (topk writes the chain buffer with their own dtype): plain greedy."""
    model = tiny_model("llama", seed=4)
    heads = random_heads(model, seed=5, std=0.0)
    heads.init_from_lm_head(model.get_output_embeddings().weight)
    packed = PackedHeads(heads.to(dtype))
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    ref = model.generate(prompt, max_new_tokens=25, do_sample=False, pad_token_id=0)[0, 6:]
    out = medusa_generate(model, packed, prompt, max_new_tokens=25, tree=chain_tree(4))
    assert out.tokens.tolist() == ref.tolist()


class SlowHeads(PackedHeads):
    """Packed heads that take at least 3 ms per call."""

    def logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        out = super().logits(hidden, num_heads)
        time.sleep(0.003)
        return out


def test_forward_time_is_the_model_call_only():
    """Heads and everything else land in overhead_s; forward_s is the model's own calls."""
    model = tiny_model("llama", seed=2)
    heads = SlowHeads(random_heads(model, seed=1))
    calls: list[float] = []
    started: list[float] = []
    pre = model.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
    post = model.register_forward_hook(lambda *_: calls.append(time.perf_counter() - started[-1]))
    try:
        prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
        out = medusa_generate(model, heads, prompt, max_new_tokens=20, tree=MEDUSA_63)
    finally:
        pre.remove()
        post.remove()
    assert len(calls) == 1 + out.num_forwards  # the prefill, then one call per verification
    model_s = sum(calls[1:])
    assert model_s <= out.forward_s <= model_s + 0.002 * out.num_forwards + 0.02
    heads_calls = out.num_forwards  # one head pass before every verification
    assert out.overhead_s >= 0.003 * heads_calls
    assert out.overhead_fraction == pytest.approx(out.overhead_s / (out.total_s - out.prefill_s))
