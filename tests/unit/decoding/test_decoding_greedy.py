"""Greedy Medusa decoding is token-for-token plain greedy ``generate``; tau is counted right."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from medusa_train.decoding import MEDUSA_63, PackedHeads, TreeBuffers, TreeError, chain_tree, medusa_generate
from medusa_train.decoding.generate import dynamic_entries
from medusa_train.heads import MedusaHeads
from medusa_train.hf_compat import cache_kwargs, output_cache_field
from tests.helpers.models import MAX_POS, VOCAB, random_heads, random_tree, tiny_model

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]


TREES = {"chain4": chain_tree(4), "medusa63": MEDUSA_63, "random": random_tree(0)}


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    return request.param, tiny_model(request.param, seed=ARCHS.index(request.param))


def plain_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None, **extra):
    """Plain greedy ``generate``'s new tokens of the ``(1, T)`` prompt (its whole output with ``extra``
    such as ``return_dict_in_generate=True``)."""
    out = model.generate(
        prompt,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        **extra,
    )
    return out if extra else out[0, prompt.shape[1] :]


def test_hidden_states_last_is_lm_head_input(arch_model):
    _, model = arch_model
    ids = torch.randint(0, VOCAB, (1, 9))
    out = model(ids, output_hidden_states=True)
    torch.testing.assert_close(
        model.get_output_embeddings()(out.hidden_states[-1]), out.logits, rtol=0, atol=1e-6
    )


def test_packed_heads_match_module():
    heads = random_heads(tiny_model("llama"), num_heads=3)
    h = torch.randn(32)
    torch.testing.assert_close(
        PackedHeads(heads).logits(h), heads(h[None, None])[:, 0, 0], rtol=1e-5, atol=1e-5
    )
    two_layer = MedusaHeads(32, VOCAB, num_heads=2, num_layers=2)
    for p in two_layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    torch.testing.assert_close(
        PackedHeads(two_layer).logits(h), two_layer(h[None, None])[:, 0, 0], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("tree_name", list(TREES))
def test_greedy_parity(arch_model, tree_name):
    arch, model = arch_model
    heads_by_kind = {
        "random": random_heads(model, seed=1),
        "lm_head": random_heads(model, seed=2, std=0.0),
    }
    heads_by_kind["lm_head"].init_from_lm_head(model.get_output_embeddings().weight)
    gen = torch.Generator().manual_seed(10 * ARCHS.index(arch) + list(TREES).index(tree_name))
    tree = TreeBuffers.from_choices(TREES[tree_name])
    for prompt_len, kind in [(1, "random"), (6, "lm_head"), (19, "random")]:
        prompt = torch.randint(1, VOCAB, (1, prompt_len), generator=gen)
        ref = plain_greedy(model, prompt, 30)
        out = medusa_generate(model, heads_by_kind[kind], prompt, max_new_tokens=30, tree=tree)
        assert out.tokens.tolist() == ref.tolist(), (arch, tree_name, prompt_len, kind)
        assert sum(out.accepted_lengths) == len(out.tokens) == 30
        assert all(1 <= n <= tree.max_depth + 1 for n in out.accepted_lengths)
        assert out.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_stops_at_context_limit(arch):
    model = tiny_model(arch, seed=7)
    heads = random_heads(model, seed=3)
    prompt = torch.randint(1, VOCAB, (1, 19), generator=torch.Generator().manual_seed(5))
    room = MAX_POS - 19
    ref = plain_greedy(model, prompt, room)
    out = medusa_generate(model, heads, prompt, max_new_tokens=100, tree=MEDUSA_63)
    assert out.tokens.tolist() == ref.tolist()
    assert len(out.tokens) == room and out.stop_reason == "context"
    full = medusa_generate(
        model, heads, torch.randint(1, VOCAB, (1, MAX_POS)), max_new_tokens=5, tree=MEDUSA_63
    )
    assert len(full.tokens) == 0 and full.stop_reason == "empty"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_stops_at_eos(arch):
    model = tiny_model(arch, seed=11)
    heads = random_heads(model, seed=4)
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(6))
    ref = plain_greedy(model, prompt, 40).tolist()
    for pos in (0, 3, 9):
        eos = ref[pos]
        expected = ref[: ref.index(eos) + 1]
        assert plain_greedy(model, prompt, 40, eos_token_id=eos).tolist() == expected
        for tree in (chain_tree(4), MEDUSA_63):
            out = medusa_generate(
                model, heads, prompt, max_new_tokens=40, tree=tree, eos_token_id=[VOCAB + 5, eos]
            )
            assert out.tokens.tolist() == expected
            assert out.stop_reason == "eos" and sum(out.accepted_lengths) == len(expected)


def test_eos_given_as_a_tensor_or_a_numpy_int_stops_as_an_int_does():
    """eos_token_id as a 0-d / 1-d tensor or a numpy integer (what generation configs and user code
    hold) stops where the same id as an int stops (a 0-d tensor or numpy int was refused)."""
    model = tiny_model("llama", seed=11)
    heads = random_heads(model, seed=4)
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(6))
    eos = plain_greedy(model, prompt, 40).tolist()[3]

    def run(eos_token_id):
        out = medusa_generate(
            model, heads, prompt, max_new_tokens=40, tree=MEDUSA_63, eos_token_id=eos_token_id
        )
        return out.tokens.tolist(), out.stop_reason

    expected = run(eos)
    assert expected[1] == "eos"
    for given in (torch.tensor(eos), torch.tensor([VOCAB + 5, eos]), np.int64(eos)):
        assert run(given) == expected, given


class OracleHeads(PackedHeads):
    """Heads that know the true greedy continuation: head k ranks token t + k + 2 at ``rank``.

    The position t is found by matching the hidden state against a forward over the whole sequence.
    """

    def __init__(self, model, full_ids: torch.Tensor, num_heads: int = 4, rank: int = 0) -> None:
        self.num_heads, self.draft_vocab_size = num_heads, VOCAB
        self.full = full_ids[0]
        self.rank = rank
        with torch.no_grad():
            self.hidden = model(full_ids, output_hidden_states=True).hidden_states[-1][0]  # (T, d)

    def logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        t = int((self.hidden - hidden).norm(dim=-1).argmin())
        num_heads = self.num_heads if num_heads is None else num_heads
        out = torch.zeros(num_heads, VOCAB)  # (K, V)
        for k in range(num_heads):
            target = int(self.full[t + k + 2]) if t + k + 2 < len(self.full) else 0
            rank = self.rank if k == 0 else 0
            others = [v for v in range(VOCAB) if v != target][:rank]
            for r, v in enumerate(others):  # tokens that outrank the target
                out[k, v] = 10.0 - r
            out[k, target] = 10.0 - rank
        return out


def test_oracle_heads_give_tau_above_one():
    model = tiny_model("llama", seed=3)
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    ref = plain_greedy(model, prompt, 40)
    full = torch.cat([prompt[0], ref])[None]
    out = medusa_generate(model, OracleHeads(model, full), prompt, max_new_tokens=21, tree=chain_tree(4))
    assert out.tokens.tolist() == ref[:21].tolist()
    assert out.accepted_lengths == [5, 5, 5, 5, 1]  # root + 4 per step; the last root needs no forward
    assert out.num_forwards == 4 and out.tau == pytest.approx(21 / 5)
    # Target at rank 1 for head 1: the accepted path (1,), (1, 0), (1, 0, 0) is not contiguous in the
    # node order, so this also checks KV compaction against plain greedy.
    out = medusa_generate(model, OracleHeads(model, full, rank=1), prompt, max_new_tokens=21, tree=MEDUSA_63)
    assert out.tokens.tolist() == ref[:21].tolist()
    assert out.accepted_lengths == [4, 4, 4, 4, 4, 1]
    # Typical acceptance at a tiny temperature accepts the argmax path too.
    out = medusa_generate(
        model,
        OracleHeads(model, full),
        prompt,
        max_new_tokens=21,
        tree=chain_tree(4),
        acceptance="typical",
        temperature=1e-3,
    )
    assert out.tokens.tolist() == ref[:21].tolist() and out.accepted_lengths == [5, 5, 5, 5, 1]


def generate_kv(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> list:
    """What plain greedy ``generate``'s cache holds after the call: per layer ``(H, n, D)`` keys and
    values of the ``(1, T)`` prompt's row."""
    out = plain_greedy(model, prompt, max_new_tokens, eos_token_id, return_dict_in_generate=True)
    return [(layer.keys[0], layer.values[0]) for layer in getattr(out, output_cache_field()).layers]


def assert_kv_close(kv: list, expected: list) -> None:
    assert kv is not None and len(kv) == len(expected)
    for (keys, values), (want_keys, want_values) in zip(kv, expected, strict=True):
        torch.testing.assert_close(keys, want_keys)
        torch.testing.assert_close(values, want_values)


def oracle_eos(ref: torch.Tensor, steps_of: int, after: int) -> int:
    """A token of ``ref`` that is the third of a step of ``steps_of`` tokens, from ``after`` on, and does
    not occur before it: an EOS the decoder meets inside an accepted path, after a node out of place."""
    return int(next(ref[k] for k in range(after, len(ref)) if k % steps_of == 2 and ref[k] not in ref[:k]))


def test_a_given_cache_is_left_as_generates_cache():
    """medusa_generate(cache=...) decodes on the cache it is given and leaves in it what generate's cache
    holds after the same call: the prompt's and the new tokens' entries but the last one's, the
    accepted path's moved into place and the tree's other nodes cut off (paths not contiguous in node
    order; the call ended by the budget inside a step or at a root emitted without a forward, or by an
    EOS inside a path). A cache that holds the prompt's first tokens: only the others are prefilled on
    it."""
    model = tiny_model("llama", seed=3)
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    ref = plain_greedy(model, prompt, 40)
    full = torch.cat([prompt[0], ref])[None]
    heads = OracleHeads(model, full, rank=1)  # paths (1,), (1, 0), ...: not contiguous in MEDUSA_63
    for n, eos in ((19, None), (21, None), (30, oracle_eos(ref, 4, 8))):
        cache = DynamicCache()
        out = medusa_generate(
            model, heads, prompt, max_new_tokens=n, tree=MEDUSA_63, eos_token_id=eos, cache=cache
        )
        expected = plain_greedy(model, prompt, n, eos)
        assert (
            out.tokens.tolist() == expected.tolist() and out.accepted_lengths[-1] == {19: 3, 21: 1, 30: 3}[n]
        )
        assert cache.get_seq_length() == prompt.shape[1] + len(expected) - 1
        assert_kv_close(dynamic_entries(cache), generate_kv(model, prompt, n, eos))
    longer = full[:, :12]
    first = DynamicCache()
    with torch.no_grad():
        model(longer[:, :7], use_cache=True, **cache_kwargs(model, first))
    out = medusa_generate(model, heads, longer, max_new_tokens=6, tree=MEDUSA_63, cache=first)
    assert out.tokens.tolist() == ref[7:13].tolist()
    assert_kv_close(dynamic_entries(first), generate_kv(model, longer, 6))
    with pytest.raises(ValueError, match="the cache holds 17 tokens and input_ids 12: pass input_ids that"):
        medusa_generate(model, heads, longer, max_new_tokens=4, tree=MEDUSA_63, cache=first)


def test_typical_accepts_and_counts():
    model = tiny_model("qwen2", seed=5)
    heads = random_heads(model, seed=6)
    prompt = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    out = medusa_generate(
        model, heads, prompt, max_new_tokens=30, tree=MEDUSA_63, acceptance="typical", temperature=0.7
    )
    assert len(out.tokens) == 30 and sum(out.accepted_lengths) == 30
    assert all(n >= 1 for n in out.accepted_lengths)
    # A random model is nearly uniform: the entropy-adaptive threshold lets candidates through.
    assert out.tau > 1
    greedy = medusa_generate(
        model, heads, prompt, max_new_tokens=30, tree=MEDUSA_63, acceptance="typical", temperature=0
    )
    assert greedy.tokens.tolist() == plain_greedy(model, prompt, 30).tolist()


def test_user_errors():
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=2)
    ids = torch.randint(1, VOCAB, (2, 4))
    with pytest.raises(ValueError, match=r"must be \(1, T\)"):
        medusa_generate(model, heads, ids, max_new_tokens=4, tree=chain_tree(2))
    with pytest.raises(TreeError, match="only 2 Medusa heads"):
        medusa_generate(model, heads, ids[:1], max_new_tokens=4, tree=chain_tree(3))
    with pytest.raises(ValueError, match="acceptance must be one of"):
        medusa_generate(model, heads, ids[:1], max_new_tokens=4, tree=chain_tree(2), acceptance="beam")
    with pytest.raises(TreeError, match="no parent"):
        medusa_generate(model, heads, ids[:1], max_new_tokens=4, tree=[[1, 1]])


def test_greedy_parity_mixed_sliding_window_layers():
    """Qwen2 with one full and one sliding-window layer: the decoder passes one mask per layer type."""
    model = tiny_model("qwen2", seed=9, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    heads = random_heads(model, seed=8)
    prompt = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    ref = plain_greedy(model, prompt, 30)
    for tree in (chain_tree(4), MEDUSA_63):
        out = medusa_generate(model, heads, prompt, max_new_tokens=30, tree=tree)
        assert out.tokens.tolist() == ref.tolist()
    # Sanity: the window matters for this model (a full-attention mask would diverge).
    model.config.sliding_window = 1000
    assert (
        medusa_generate(model, heads, prompt, max_new_tokens=30, tree=MEDUSA_63).tokens.tolist()
        != ref.tolist()
    )
