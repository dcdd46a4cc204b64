"""generate's logits processors in every decoder (repetition penalty, minimum length): node by node as
transformers applies them, and greedy decoding identical to ``generate`` with the same settings."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from medusa_train.decoding import MEDUSA_63, TreeBuffers, chain_tree, medusa_generate, medusa_generate_batch
from medusa_train.decoding.processors import mark_seen, penalize, tree_ancestors
from medusa_train.decoding.static import StaticDecoder, medusa_generate_static
from tests.helpers.models import MAX_POS, VOCAB, random_heads, tiny_model
from tests.unit.decoding.test_decoding_batched import OracleRows
from tests.unit.decoding.test_decoding_static import RowOracleHeads


def penalized_greedy(model, prompt: torch.Tensor, new: int, penalty: float) -> list[int]:
    out = model.generate(
        prompt, max_new_tokens=new, do_sample=False, repetition_penalty=penalty, pad_token_id=0
    )
    return out[0, prompt.shape[1] :].tolist()


def test_tree_ancestors_lists_each_path_padded_with_the_root():
    tree = TreeBuffers.from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])  # nodes 0..5
    assert tree_ancestors(tree).tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [3, 1, 0, 0],
                                             [4, 1, 0, 0], [5, 3, 1, 0]]  # fmt: skip


def test_every_node_is_penalised_as_the_processor_penalises_its_sequence():
    torch.manual_seed(0)
    tree = TreeBuffers.from_choices(MEDUSA_63[:20])
    m, vocab = tree.num_nodes, 12
    sequence = torch.tensor([3, 5, 5, 7])  # the row's tokens so far
    node_tokens = torch.randint(0, vocab, (m,))
    logits = torch.randn(m, vocab, dtype=torch.bfloat16) * 3
    seen = torch.zeros(vocab, dtype=torch.bool)
    mark_seen(seen, sequence)
    ours = penalize(logits, seen, 1.7, node_tokens, tree_ancestors(tree))
    processor = RepetitionPenaltyLogitsProcessor(1.7)
    for i in range(m):
        path = [j for j in range(m) if tree.attn_mask[i, j]]  # the root first, node i last
        ids = torch.cat([sequence, node_tokens[path]])[None]
        expected = processor(ids, logits[i].float()[None].clone())[0]
        assert torch.equal(ours[i], expected), i
    # no tree: the sequence only (the prefill's last position)
    expected = processor(sequence[None], logits[0].float()[None].clone())[0]
    assert torch.equal(penalize(logits[0], seen, 1.7), expected)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_with_a_penalty_equals_generate(arch, penalty):
    model = tiny_model(arch, seed=2)
    heads = random_heads(model, seed=3)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=gen) for n in (3, 8, 13)]
    refs = [penalized_greedy(model, p, 30, penalty) for p in prompts]
    assert refs != [penalized_greedy(model, p, 30, 1.0) for p in prompts]  # the penalty changes them
    for prompt, ref in zip(prompts, refs, strict=True):
        for tree in (chain_tree(4), MEDUSA_63):
            out = medusa_generate(
                model, heads, prompt, max_new_tokens=30, tree=tree, repetition_penalty=penalty
            )
            assert out.tokens.tolist() == ref
        out = medusa_generate_static(
            model, heads, prompt, max_new_tokens=30, tree=MEDUSA_63, repetition_penalty=penalty
        )
        assert out.tokens.tolist() == ref
    batch = medusa_generate_batch(
        model, heads, prompts, max_new_tokens=30, tree=MEDUSA_63, repetition_penalty=penalty
    )
    assert [r.tokens.tolist() for r in batch.rows] == refs
    static = StaticDecoder(model, heads, MEDUSA_63, 2 * MAX_POS, batch_size=3, repetition_penalty=penalty)
    assert [r.tokens.tolist() for r in static.generate_batch(prompts, max_new_tokens=30).rows] == refs
    # the decoder resets each row's tokens per call: the same prompts again, the same tokens
    assert [r.tokens.tolist() for r in static.generate_batch(prompts[::-1], max_new_tokens=30).rows] == refs[
        ::-1
    ]


def test_whole_accepted_paths_are_penalised_node_by_node():
    """Heads that know the penalised continuation: whole chains are accepted, so every node's logits
    must carry its path's penalty for the tokens to stay those of generate."""
    model = tiny_model("llama", seed=3)
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    ref = penalized_greedy(model, prompt, 40, 1.5)
    assert len(set(ref[:21])) < 21 or ref != penalized_greedy(model, prompt, 40, 1.0)
    full = torch.cat([prompt[0], torch.tensor(ref)])[None]
    for tree, lengths, rank in ((chain_tree(4), [5, 5, 5, 5, 1], 0), (MEDUSA_63, [4, 4, 4, 4, 4, 1], 1)):
        heads = RowOracleHeads(model, full, rank=rank)
        out = medusa_generate(model, heads, prompt, max_new_tokens=21, tree=tree, repetition_penalty=1.5)
        assert out.tokens.tolist() == ref[:21] and out.accepted_lengths == lengths
        out = medusa_generate_static(
            model, heads, prompt, max_new_tokens=21, tree=tree, repetition_penalty=1.5
        )
        assert out.tokens.tolist() == ref[:21] and out.accepted_lengths == lengths
    prompts = [prompt[0], torch.randint(1, VOCAB, (7,), generator=torch.Generator().manual_seed(2))]
    refs = [penalized_greedy(model, p[None], 40, 1.5) for p in prompts]
    fulls = [torch.cat([p, torch.tensor(r)]) for p, r in zip(prompts, refs, strict=True)]
    out = medusa_generate_batch(
        model,
        OracleRows(model, fulls),
        prompts,
        max_new_tokens=21,
        tree=chain_tree(4),
        repetition_penalty=1.5,
    )
    assert [r.tokens.tolist() for r in out.rows] == [r[:21] for r in refs]
    assert all(r.accepted_lengths == [5, 5, 5, 5, 1] for r in out.rows)


def test_the_penalty_reaches_sampling_and_typical_acceptance():
    """Sampling with top_k=1 and typical acceptance at a tiny temperature take the penalised argmax."""
    model = tiny_model("qwen2", seed=5)
    heads = random_heads(model, seed=6)
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    ref = penalized_greedy(model, prompt, 24, 1.4)
    rules = [
        dict(acceptance="sample", temperature=0.9, top_k=1),
        dict(acceptance="typical", temperature=1e-4),
    ]
    for rule in rules:
        for decode in (medusa_generate, medusa_generate_static):
            out = decode(
                model, heads, prompt, max_new_tokens=24, tree=MEDUSA_63, repetition_penalty=1.4, **rule
            )
            assert out.tokens.tolist() == ref, (decode.__name__, rule)


def test_a_penalty_that_is_not_positive_is_refused():
    model = tiny_model("llama")
    heads = random_heads(model)
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        medusa_generate(model, heads, prompt, max_new_tokens=4, tree=MEDUSA_63, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        StaticDecoder(model, heads, MEDUSA_63, 64, repetition_penalty=-1.0)


def greedy_until_eos(model, prompt: torch.Tensor, new: int, eos: int, **settings) -> list[int]:
    out = model.generate(
        prompt, max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0, **settings
    )
    row = out[0, prompt.shape[1] :].tolist()
    return row[: row.index(eos) + 1] if eos in row else row


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_minimum_length_keeps_eos_away_in_every_decoder(arch):
    model = tiny_model(arch, seed=4)
    heads = random_heads(model, seed=5)
    gen = torch.Generator().manual_seed(6)
    prompt, other = (
        torch.randint(1, VOCAB, (1, 6), generator=gen),
        torch.randint(1, VOCAB, (1, 9), generator=gen),
    )
    eos = greedy_until_eos(model, prompt, 30, -1)[2]  # plain greedy would stop at the third new token
    for minimum, first_eos in (({"min_new_tokens": 12}, 11), ({"min_length": 6 + 9}, 8)):
        ref = greedy_until_eos(model, prompt, 30, eos, **minimum)
        assert len(ref) > first_eos and eos not in ref[:first_eos]  # the minimum moved the stop
        for tree in (chain_tree(4), MEDUSA_63):
            out = medusa_generate(
                model, heads, prompt, max_new_tokens=30, tree=tree, eos_token_id=eos, **minimum
            )
            assert out.tokens.tolist() == ref, (minimum, tree)
        out = medusa_generate_static(
            model, heads, prompt, max_new_tokens=30, tree=MEDUSA_63, eos_token_id=eos, **minimum
        )
        assert out.tokens.tolist() == ref, minimum
        other_ref = greedy_until_eos(model, other, 30, eos, **minimum)
        batch = medusa_generate_batch(
            model,
            heads,
            [prompt[0], other[0]],
            max_new_tokens=30,
            tree=MEDUSA_63,
            eos_token_id=eos,
            **minimum,
        )
        assert [r.tokens.tolist() for r in batch.rows] == [ref, other_ref], minimum
        static = StaticDecoder(model, heads, MEDUSA_63, 2 * MAX_POS, batch_size=2, **minimum)
        rows = static.generate_batch([prompt, other], max_new_tokens=30, eos_token_id=eos).rows
        assert [r.tokens.tolist() for r in rows] == [ref, other_ref], minimum
        # the same decoder without EOS ids in the call: nothing to keep away
        assert static.generate(prompt, max_new_tokens=10).tokens.tolist() == greedy_until_eos(
            model, prompt, 10, -1
        )


def eos_everywhere(model, eos: int) -> torch.nn.Module:
    """The model with a bias that makes ``eos`` the argmax at every position."""
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[eos] = 1e3
    model.set_output_embeddings(biased)
    return model


@pytest.mark.parametrize("min_new_tokens", [9, 10, 11, 12])
def test_whole_accepted_paths_keep_eos_away_node_by_node(min_new_tokens):
    """EOS is the argmax everywhere, so generate emits it right at min_new_tokens; heads that know that
    continuation get whole chains accepted (a chain of 4 ends at every offset of the bound across the 4
    settings): every node must mask EOS exactly while the token it predicts comes too early."""
    eos = 7
    model = eos_everywhere(tiny_model("llama", seed=3), eos)
    prompt = torch.randint(8, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    ref = greedy_until_eos(model, prompt, 40, eos, min_new_tokens=min_new_tokens)
    assert len(ref) == min_new_tokens + 1 and ref[-1] == eos and eos not in ref[:-1]
    full = torch.cat([prompt[0], torch.tensor(ref)])[None]
    heads = RowOracleHeads(model, full)
    for decode in (medusa_generate, medusa_generate_static):
        out = decode(
            model,
            heads,
            prompt,
            max_new_tokens=40,
            tree=chain_tree(4),
            eos_token_id=eos,
            min_new_tokens=min_new_tokens,
        )
        assert out.tokens.tolist() == ref, decode.__name__
        assert out.accepted_lengths[0] == 5, decode.__name__  # whole chains from the first step
    other = torch.randint(8, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    refs = [ref, greedy_until_eos(model, other, 40, eos, min_new_tokens=min_new_tokens)]
    fulls = [torch.cat([p[0], torch.tensor(r)]) for p, r in zip((prompt, other), refs, strict=True)]
    out = medusa_generate_batch(
        model, OracleRows(model, fulls), [prompt[0], other[0]], max_new_tokens=40, tree=chain_tree(4),
        eos_token_id=eos, min_new_tokens=min_new_tokens,
    )  # fmt: skip
    assert [r.tokens.tolist() for r in out.rows] == refs
    assert all(r.accepted_lengths[0] == 5 for r in out.rows)


def test_a_negative_minimum_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="min_new_tokens must be an integer >= 0"):
        medusa_generate(
            model,
            random_heads(model),
            torch.tensor([[1, 2]]),
            max_new_tokens=4,
            tree=MEDUSA_63,
            min_new_tokens=-1,
        )
