"""Exact sampling: Medusa's output distribution equals plain ancestral sampling."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from medusa_train.decoding import (
    MEDUSA_63,
    PackedHeads,
    TreeBuffers,
    accept_sample,
    acceptance,
    medusa_generate,
    medusa_generate_batch,
    warp_probs,
)
from medusa_train.decoding.static import StaticDecoder
from tests.helpers.models import random_heads, tiny_model

SMALL_VOCAB = 6


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "min_p"),
    [
        (1.0, 1.0, 0, 0.0),
        (0.7, 0.8, 0, 0.0),
        (1.3, 0.5, 0, 0.0),
        (1.0, 1.0, 5, 0.0),
        (0.7, 0.9, 20, 0.0),
        (1.0, 1.0, 0, 0.1),
        (0.7, 0.95, 30, 0.05),
        (1.0, 1.0, 0, 1.0),
    ],
)
def test_warp_probs_matches_generate_warpers(temperature, top_p, top_k, min_p):
    logits = torch.randn(3, 50) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    torch.testing.assert_close(warp_probs(logits, temperature, top_p, top_k, min_p), scores.softmax(-1))


def test_warp_probs_keeps_ties_at_both_cutoffs():
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 0.0, -1.0]])
    # top-k 3 keeps the three tokens tied at the third score, as transformers' warper does
    scores = TopPLogitsWarper(0.99)(None, TopKLogitsWarper(3)(None, logits.clone()))
    probs = warp_probs(logits, 1.0, 0.99, 3)
    torch.testing.assert_close(probs, scores.softmax(-1))
    assert (probs[0, :5] > 0).all() and (probs[0, 5:] == 0).all()
    # a nucleus boundary inside a tie keeps the whole tie (transformers keeps any of its members)
    mass = logits.softmax(-1)[0]
    top_p = float(mass[:3].sum()) - 1e-3  # the first of the tied tokens reaches it
    probs = warp_probs(logits, 1.0, top_p)
    assert (probs[0, :5] > 0).all() and (probs[0, 5:] == 0).all()


def test_warp_probs_ranks_once_with_a_top_k(monkeypatch):
    logits = torch.randn(4, 1000)
    expected = TopPLogitsWarper(0.9)(None, TopKLogitsWarper(50)(None, logits.clone())).softmax(-1)
    calls = []
    monkeypatch.setattr(torch, "sort", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: calls.append(1))
    torch.testing.assert_close(warp_probs(logits, 1.0, 0.9, 50), expected)
    assert not calls  # the nucleus ranked the top-k's scores, not the vocabulary


def _sorted_nucleus_warp(logits, temperature, top_p, top_k=0, min_p=0.0):
    """The nucleus rule over the sorted vocabulary, as written without the search of the highest scores."""
    scores = logits.float() / temperature
    ranked = None
    if 0 < top_k < scores.shape[-1]:
        ranked = scores.topk(top_k, dim=-1).values
        scores = scores.masked_fill(scores < ranked[..., -1:], float("-inf"))
    if top_p < 1.0:
        if ranked is None:
            ranked = scores.sort(dim=-1, descending=True).values
        mass = (ranked - scores.logsumexp(dim=-1, keepdim=True)).exp()
        ahead = mass.cumsum(dim=-1) - mass
        keep = ahead < top_p
        keep[..., 0] = True
        cutoff = ranked.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
        scores = scores.masked_fill(scores < cutoff, float("-inf"))
    if min_p > 0.0:
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return scores.softmax(dim=-1)


def _nucleus_cases(vocab: int) -> dict[str, torch.Tensor]:
    """Logits whose nucleus lies among the highest scores, far down the ranking, or across a tie."""
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(6, vocab, generator=gen) * 6
    flat = torch.randn(6, vocab, generator=gen) * 0.05
    tied = torch.randint(-3, 4, (6, vocab), generator=gen).float() * 2  # a few levels, thousands each
    plateau = torch.zeros(3, vocab)  # 200 tokens tied on top: the first ranks cut through the tie
    plateau[:, torch.randperm(vocab, generator=gen)[:200]] = torch.tensor([[8.0], [12.0], [20.0]])
    masked = peaked.clone()
    masked[:, : vocab // 2] = float("-inf")  # processors' -inf (min_new_tokens' EOS)
    return {
        "peaked": peaked,
        "flat": flat,
        "mixed": torch.stack((peaked, flat), dim=1).reshape(2, 6, vocab),  # (2, 6, V): both per batch
        "tied": tied,
        "plateau": plateau,
        "masked": masked,
        "one row": flat[0] + peaked[0],  # (V,)
    }


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.9, 0.999, 0.99995, 1 - 2**-24])
@pytest.mark.torch_only
def test_warp_probs_top_p_equals_the_sorted_rule_bit_for_bit(top_p):
    for vocab in (3000, 32000):
        for name, logits in _nucleus_cases(vocab).items():
            for temperature, min_p in ((1.0, 0.0), (0.6, 0.0), (1.5, 0.05)):
                expected = _sorted_nucleus_warp(logits, temperature, top_p, min_p=min_p)
                probs = warp_probs(logits, temperature, top_p, min_p=min_p)
                assert torch.equal(probs.view(torch.int32), expected.view(torch.int32)), (vocab, name)
                unsynced = warp_probs(logits, temperature, top_p, min_p=min_p, host_sync=False)
                assert torch.equal(unsynced.view(torch.int32), expected.view(torch.int32)), (vocab, name)


def test_warp_probs_top_p_sorts_on_a_device_without_float64(monkeypatch):
    """MPS has no float64, in which the search of the highest scores decides its rows: there top-p
    without a top-k sorts the vocabulary, host_sync or not, to the same probabilities bit for bit.
    Simulated on the CPU: its device type counted as such a device, float64 refused as MPS refuses it."""
    monkeypatch.setattr(acceptance, "_SORTING_DEVICES", ("cpu",))

    def no_float64(*args, **kwargs):
        raise TypeError(
            "Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support float64"
        )

    monkeypatch.setattr(torch.Tensor, "double", no_float64)
    for name, logits in _nucleus_cases(3000).items():
        for temperature, top_p, min_p in ((1.0, 0.9, 0.0), (0.6, 0.3, 0.0), (1.5, 0.999, 0.05)):
            expected = _sorted_nucleus_warp(logits, temperature, top_p, min_p=min_p)
            probs = warp_probs(logits, temperature, top_p, min_p=min_p)
            assert torch.equal(probs.view(torch.int32), expected.view(torch.int32)), name


def test_warp_probs_top_p_ranks_the_highest_scores_and_sorts_only_the_rows_they_leave_open(monkeypatch):
    vocab = 5000
    peaked = torch.randn(4, vocab) * 6  # the top 64 hold nearly all the mass
    plateau = torch.zeros(vocab)
    plateau[:300] = 10.0  # 300 tied tokens hold ~99.9%: after the top 64, at least 150 for top-p 0.5
    flat = torch.randn(vocab) * 0.05  # the top 64 hold ~1.3%: at least ~2,000 more, past the search
    logits = torch.cat((peaked, plateau[None], flat[None]))  # (6, V)
    expected = _sorted_nucleus_warp(logits, 1.0, 0.5)
    calls = []
    sort, topk = torch.Tensor.sort, torch.Tensor.topk
    monkeypatch.setattr(
        torch.Tensor, "sort", lambda x, *a, **k: calls.append(("sort", len(x))) or sort(x, *a, **k)
    )
    monkeypatch.setattr(
        torch.Tensor, "topk", lambda x, r, *a, **k: calls.append((r, len(x))) or topk(x, r, *a, **k)
    )
    assert torch.equal(warp_probs(logits, 1.0, 0.5).view(torch.int32), expected.view(torch.int32))
    assert calls == [(64, 6), (256, 1), ("sort", 1)]  # the plateau's second round; the flat row sorted
    calls.clear()
    assert torch.equal(warp_probs(logits[:4], 1.0, 0.5), expected[:4])
    assert calls == [(64, 4)]
    assert (expected[4, :300] > 0).all() and (expected[4, 300:] == 0).all()  # the whole tie


def test_accept_sample_descends_on_matching_draws():
    tree = TreeBuffers.from_choices([[0], [1], [0, 0]])  # nodes: root, (0,), (1,), (0, 0)
    tokens = torch.tensor([7, 3, 4, 5])
    logits = torch.full((4, 10), -1e4)
    logits[0, 3] = logits[1, 5] = logits[3, 9] = 0.0  # point masses: root -> 3 -> 5 -> 9
    result = accept_sample(tokens, logits, tree, temperature=1.0)
    assert result.path == [0, 1, 3] and result.next_token == 9
    logits[0] = -1e4
    logits[0, 8] = 0.0  # the root's draw matches no child: emit it as the bonus
    result = accept_sample(tokens, logits, tree, temperature=1.0)
    assert result.path == [0] and result.next_token == 8


def _exact_joint(model, prompt, n_tokens, temperature, top_p, top_k=0) -> dict[tuple[int, ...], float]:
    """p(x1..xn) by enumeration, with the same temperature/top-k/top-p warping as generate."""
    joint = {(): 1.0}
    for _ in range(n_tokens):
        prefixes = list(joint)
        ids = torch.cat(
            [
                prompt.expand(len(prefixes), -1),
                torch.tensor(prefixes, dtype=torch.long).reshape(len(prefixes), -1),
            ],
            dim=1,
        )
        with torch.no_grad():
            probs = warp_probs(model(ids).logits[:, -1], temperature, top_p, top_k)  # (P, V)
        joint = {
            pre + (v,): joint[pre] * float(probs[i, v])
            for i, pre in enumerate(prefixes)
            for v in range(SMALL_VOCAB)
        }
    return joint


class FixedHeads(PackedHeads):
    """Heads whose top-3 at every depth are fixed tokens (drafts the sampler must correct)."""

    def __init__(self, num_heads: int = 2) -> None:
        self.num_heads, self.draft_vocab_size = num_heads, 6  # the tokens they rank

    def logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        ranks = torch.tensor([[3.0, 2.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 3.0, 2.0, 0.0]])
        return ranks[: self.num_heads if num_heads is None else num_heads]  # (K, V)


TREE_12 = [[i] for i in range(3)] + [[i, j] for i in range(3) for j in range(3)]


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "choices"),
    # the chain: host-side drafts; top-k 4 of the 6 tokens, then top-p, as generate warps them
    [(1.0, 1.0, 0, TREE_12), (0.8, 0.9, 4, TREE_12), (1.0, 1.0, 0, [[0], [0, 0]])],
    ids=["tree12-1.0-1.0", "tree12-0.8-0.9-k4", "chain2-1.0-1.0"],
)
def test_sampling_distribution_matches_ancestral(temperature, top_p, top_k, choices):
    model = tiny_model("llama", vocab=SMALL_VOCAB, initializer_range=0.5)
    prompt = torch.tensor([[1, 4, 2]])
    n_tokens, draws = 3, 1500
    exact = _exact_joint(model, prompt, n_tokens, temperature, top_p, top_k)
    tree = TreeBuffers.from_choices(choices)
    heads = FixedHeads()
    gen = torch.Generator().manual_seed(0)
    counts: dict[tuple[int, ...], int] = {}
    accepted_multi = 0
    for _ in range(draws):
        out = medusa_generate(
            model, heads, prompt, max_new_tokens=n_tokens, tree=tree, acceptance="sample",
            temperature=temperature, top_p=top_p, top_k=top_k, generator=gen,
        )  # fmt: skip
        key = tuple(out.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted_multi += int(max(out.accepted_lengths) > 1)
    assert accepted_multi > draws // (10 if len(choices) > 2 else 20)  # the tree really is used
    assert_matches(counts, exact, draws, n_tokens)


def assert_matches(counts: dict[tuple[int, ...], int], exact: dict, draws: int, n_tokens: int) -> None:
    """``counts`` of ``draws`` sampled sequences fit the exact joint (chi-square, total variation)."""
    assert all(exact[k] > 0 for k in counts)  # never a token outside the top-p set
    # Chi-square over cells with expected count >= 5 (the rest pooled).
    stat, df, pooled_e, pooled_o = 0.0, -1, 0.0, 0
    for key in itertools.product(range(SMALL_VOCAB), repeat=n_tokens):
        e, o = exact[key] * draws, counts.get(key, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            df += 1
        else:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        df += 1
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)
    tv = 0.5 * sum(abs(counts.get(k, 0) / draws - p) for k, p in exact.items())
    assert tv < 0.15, tv


class FixedRowHeads(FixedHeads):
    """:class:`FixedHeads` for the static decoder, which asks for every row's heads at once (on the
    rows' device: the logits are copied there on the first call, before any capture)."""

    def logits_rows(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        ranks = getattr(self, "_ranks", None)
        if ranks is None or ranks.device != hidden.device:
            ranks = self._ranks = self.logits(hidden, num_heads).to(hidden.device)
        return ranks[None].expand(hidden.shape[0], -1, -1)  # (B, K, V)


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 1.0, 0), (0.8, 0.9, 4)])
def test_static_sampling_distribution_matches_ancestral(temperature, top_p, top_k):
    check_static_sampling(torch.device("cpu"), "eager", temperature, top_p, top_k)


def check_static_sampling(
    device: torch.device, capture: str, temperature: float, top_p: float, top_k: int = 0
) -> None:
    """The static decoder's draws inside the step (the exponential race) against the exact joint of 3
    tokens: 1,500 sequences, 100 rows of one prompt per call (also the gpu test, on CUDA)."""
    model = tiny_model("llama", vocab=SMALL_VOCAB, initializer_range=0.5)
    prompt = torch.tensor([[1, 4, 2]])
    n_tokens, draws, rows = 3, 1500, 100
    exact = _exact_joint(model, prompt, n_tokens, temperature, top_p, top_k)
    decoder = StaticDecoder(
        model.to(device), FixedRowHeads(), TREE_12, capacity=32, batch_size=rows, capture=capture,
        acceptance="sample", temperature=temperature, top_p=top_p, top_k=top_k,
    )  # fmt: skip
    torch.manual_seed(0)
    counts: dict[tuple[int, ...], int] = {}
    accepted_multi = 0
    for _ in range(draws // rows):
        for row in decoder.generate_batch([prompt.to(device)] * rows, max_new_tokens=n_tokens).rows:
            key = tuple(row.tokens.tolist())
            counts[key] = counts.get(key, 0) + 1
            accepted_multi += int(max(row.accepted_lengths) > 1)
    assert accepted_multi > draws // 10  # the tree really is used
    assert_matches(counts, exact, draws, n_tokens)


def test_static_sampling_at_temperature_0_is_greedy_and_a_seed_repeats_it():
    model = tiny_model("llama", seed=3)
    prompt = torch.tensor([[5, 9, 2, 7]])
    heads = PackedHeads(random_heads(model, seed=1))
    expected = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False
    )
    greedy = StaticDecoder(model, heads, TREE_12, 64, acceptance="sample", temperature=0.0)
    assert greedy.generate(prompt, max_new_tokens=20).tokens.tolist() == expected[0, 4:].tolist()
    sampler = StaticDecoder(model, heads, TREE_12, 64, acceptance="sample", temperature=1.0, top_p=0.9)
    torch.manual_seed(7)
    first = sampler.generate(prompt, max_new_tokens=20).tokens
    torch.manual_seed(7)
    assert torch.equal(sampler.generate(prompt, max_new_tokens=20).tokens, first)
    assert first.tolist() != expected[0, 4:].tolist()  # drawn, not the greedy reply


def test_min_p_of_one_keeps_the_most_likely_token_in_every_decoder():
    """min_p=1 keeps only the tokens as likely as the most likely one: sampling is greedy decoding."""
    model = tiny_model("llama", seed=7)
    heads = random_heads(model, seed=8)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, model.config.vocab_size, (1, n), generator=gen) for n in (4, 9)]
    greedy = [
        medusa_generate(model, heads, p, max_new_tokens=20, tree=MEDUSA_63).tokens.tolist() for p in prompts
    ]
    rule = dict(acceptance="sample", temperature=1.3, top_p=0.9, min_p=1.0)
    for p, expected in zip(prompts, greedy, strict=True):
        assert (
            medusa_generate(model, heads, p, max_new_tokens=20, tree=MEDUSA_63, **rule).tokens.tolist()
            == expected
        )
    batch = medusa_generate_batch(model, heads, prompts, max_new_tokens=20, tree=MEDUSA_63, **rule)
    assert [r.tokens.tolist() for r in batch.rows] == greedy
    static = StaticDecoder(model, heads, MEDUSA_63, 128, batch_size=2, **rule)
    assert [r.tokens.tolist() for r in static.generate_batch(prompts, max_new_tokens=20).rows] == greedy
    with pytest.raises(ValueError, match="min_p must be in"):
        medusa_generate(model, heads, prompts[0], max_new_tokens=4, tree=MEDUSA_63, min_p=1.5)


def test_a_temperature_too_low_to_sample_raises_in_every_decoder_as_in_generate():
    """At temperature 1e-40 the logits over the temperature pass float32's range: the probabilities are
    NaN, and generate's multinomial raises. So does every decoder (the static one at its sync: its draws
    run on the device, where a NaN draw is token 0)."""
    model = tiny_model("llama", seed=2)
    heads = random_heads(model, seed=3)
    prompt = torch.tensor([[5, 9, 2, 7]])
    with pytest.raises(RuntimeError, match="probability tensor"):
        model.generate(prompt, do_sample=True, temperature=1e-40, max_new_tokens=5, pad_token_id=0)
    rule = dict(acceptance="sample", temperature=1e-40)
    with pytest.raises(RuntimeError, match="probability tensor"):
        medusa_generate(model, heads, prompt, max_new_tokens=5, tree=MEDUSA_63, **rule)
    with pytest.raises(RuntimeError, match="probability tensor"):
        medusa_generate_batch(model, heads, [prompt], max_new_tokens=5, tree=MEDUSA_63, **rule)
    static = StaticDecoder(model, heads, MEDUSA_63, 128, batch_size=2, sync_every=2, **rule)
    with pytest.raises(RuntimeError, match="NaN probabilities"):
        static.generate_batch([prompt, prompt[:, :2]], max_new_tokens=5)
    # one token: the prompt's draw alone
    with pytest.raises(RuntimeError, match="probability tensor"):
        medusa_generate(model, heads, prompt, max_new_tokens=1, tree=MEDUSA_63, **rule)
    with pytest.raises(RuntimeError, match="NaN probabilities"):
        static.generate(prompt, max_new_tokens=1)


def test_the_static_decoder_raises_where_a_kept_token_was_drawn_from_nan():
    """Logits that turn NaN in the tree steps only (the prompt's are finite): a call that keeps a token
    drawn there raises, as medusa_generate does; one that ends on the first token (an EOS, or a budget
    of 1) keeps only the prompt's draw, and returns it as medusa_generate does."""
    model = tiny_model("llama", seed=2)
    heads = random_heads(model, seed=3)
    prompt = torch.tensor([[5, 9, 2, 7]])
    model.lm_head.register_forward_hook(lambda _m, _i, out: out * math.nan if out.shape[-2] > 1 else out)
    rule = dict(acceptance="sample", temperature=0.8, top_k=1)  # top-1: the draws are the argmax
    first = medusa_generate(model, heads, prompt, max_new_tokens=1, tree=MEDUSA_63, **rule).tokens.tolist()
    static = StaticDecoder(model, heads, MEDUSA_63, 128, **rule)
    assert static.generate(prompt, max_new_tokens=1).tokens.tolist() == first
    ends = dict(max_new_tokens=5, eos_token_id=first[0])
    assert medusa_generate(model, heads, prompt, tree=MEDUSA_63, **ends, **rule).tokens.tolist() == first
    assert static.generate(prompt, **ends).tokens.tolist() == first
    with pytest.raises(RuntimeError, match="probability tensor"):
        medusa_generate(model, heads, prompt, max_new_tokens=5, tree=MEDUSA_63, **rule)
    with pytest.raises(RuntimeError, match="NaN probabilities"):
        static.generate(prompt, max_new_tokens=5)
