"""Batched tree decoding: every row equals its own batch-1 decode, rows leave the batch when done."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from medusa_train.decoding import (
    MEDUSA_63,
    PackedHeads,
    TreeBuffers,
    TreeError,
    chain_tree,
    medusa_generate,
    medusa_generate_batch,
    warp_probs,
)
from medusa_train.hf_compat import passed_cache
from tests.helpers.models import MAX_POS, VOCAB, random_heads, random_tree, tiny_model
from tests.unit.decoding.test_decoding_greedy import assert_kv_close, generate_kv, oracle_eos

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]
TREES = {"chain4": chain_tree(4), "medusa63": MEDUSA_63, "random": random_tree(1)}
LENGTHS = [1, 19, 6, 2, 13, 9, 4, 17]  # ragged: row b of a batch of B takes LENGTHS[b]


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    return request.param, tiny_model(request.param, seed=20 + ARCHS.index(request.param))


def plain_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Batch-1 ``generate(do_sample=False)`` of a 1-D prompt: the new tokens."""
    out = model.generate(
        prompt[None],
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def prompts_for(bsz: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (LENGTHS[b],), generator=gen) for b in range(bsz)]


@pytest.mark.parametrize("bsz", [1, 3, 8])
@pytest.mark.parametrize("tree_name", list(TREES))
def test_batched_greedy_parity_every_row(arch_model, tree_name, bsz):
    """Each row equals its own batch-1 ``generate``; one row's EOS ends it mid-batch, the rest go on."""
    arch, model = arch_model
    heads = random_heads(model, seed=5)
    prompts = prompts_for(bsz, seed=ARCHS.index(arch) * 10 + bsz)
    refs = [plain_greedy(model, p, 24) for p in prompts]
    # EOS: the 6th greedy token of the last row (it stops there; other rows may stop wherever it occurs).
    eos = refs[-1][5]
    expected = [plain_greedy(model, p, 24, eos_token_id=eos) for p in prompts]
    assert len(expected[-1]) == refs[-1].index(eos) + 1 < 24
    tree = TreeBuffers.from_choices(TREES[tree_name])
    for fast in (True, False) if bsz == 1 else (False,):
        out = medusa_generate_batch(
            model, heads, prompts, max_new_tokens=24, tree=tree, eos_token_id=[VOCAB + 3, eos],
            batch1_fast_path=fast,
        )  # fmt: skip
        assert [r.tokens.tolist() for r in out.rows] == expected, (arch, tree_name, bsz, fast)
        for row, exp in zip(out.rows, expected, strict=True):
            assert sum(row.accepted_lengths) == len(exp)
            assert all(1 <= n <= tree.max_depth + 1 for n in row.accepted_lengths)
            assert row.stop_reason == ("eos" if exp[-1] == eos else "max_new_tokens")


class OracleRows(PackedHeads):
    """Heads that know every row's greedy continuation (batched form of the greedy tests' oracle).

    Head k ranks token t + k + 2 of the row's full sequence first (head 1 at ``rank``); the (row, t)
    of a hidden state is found by matching it against a forward over each full sequence.
    """

    def __init__(self, model, fulls: list[torch.Tensor], num_heads: int = 4, rank: int = 0) -> None:
        self.num_heads, self.draft_vocab_size = num_heads, VOCAB
        self.rank = rank
        self.fulls = fulls
        with torch.no_grad():
            self.hidden = [model(f[None], output_hidden_states=True).hidden_states[-1][0] for f in fulls]

    def _one(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        dists = [(h - hidden).norm(dim=-1) for h in self.hidden]
        row = min(range(len(dists)), key=lambda r: float(dists[r].min()))
        t, full = int(dists[row].argmin()), self.fulls[row]
        out = torch.zeros(num_heads, VOCAB)  # (K, V)
        for k in range(num_heads):
            target = int(full[t + k + 2]) if t + k + 2 < len(full) else 0
            rank = self.rank if k == 0 else 0
            for r, v in enumerate([v for v in range(VOCAB) if v != target][:rank]):
                out[k, v] = 10.0 - r
            out[k, target] = 10.0 - rank
        return out

    def logits(self, hidden, num_heads=None):
        return self._one(hidden, num_heads or self.num_heads)

    def logits_rows(self, hidden, num_heads=None):
        return torch.stack([self._one(h, num_heads or self.num_heads) for h in hidden])  # (B, K, V)


def test_batched_oracle_heads_accept_and_compact_per_row():
    """Rows accept long paths; on MEDUSA_63 the accepted nodes are not contiguous (KV entries move)."""
    model = tiny_model("llama", seed=3)
    prompts = prompts_for(3, seed=4)
    refs = [plain_greedy(model, p, 40) for p in prompts]
    fulls = [torch.cat([p, torch.tensor(r)]) for p, r in zip(prompts, refs, strict=True)]
    budgets = 21
    out = medusa_generate_batch(
        model, OracleRows(model, fulls), prompts, max_new_tokens=budgets, tree=chain_tree(4)
    )
    assert [r.tokens.tolist() for r in out.rows] == [r[:budgets] for r in refs]
    assert all(r.accepted_lengths == [5, 5, 5, 5, 1] for r in out.rows)
    assert out.num_forwards == 4 and out.tau == pytest.approx(21 / 5)
    out = medusa_generate_batch(
        model, OracleRows(model, fulls, rank=1), prompts, max_new_tokens=budgets, tree=MEDUSA_63
    )
    assert [r.tokens.tolist() for r in out.rows] == [r[:budgets] for r in refs]
    assert all(r.accepted_lengths == [4, 4, 4, 4, 4, 1] for r in out.rows)


def test_each_row_keeps_the_kv_generates_cache_holds_after_it():
    """keep_kv: each row's KV entries as its own generate's cache holds them after the call, copied as
    the row leaves the batch (paths not contiguous in node order; rows ended by the budget inside a
    step or at a root emitted without a forward, or by an EOS inside a path)."""
    model = tiny_model("llama", seed=3)
    prompts = prompts_for(3, seed=4)
    refs = [torch.tensor(plain_greedy(model, p, 40)) for p in prompts]
    fulls = [torch.cat([p, r]) for p, r in zip(prompts, refs, strict=True)]
    heads = OracleRows(model, fulls, rank=1)
    for n, eos in ((19, None), (21, None), (30, oracle_eos(refs[1], 4, 8))):
        out = medusa_generate_batch(
            model, heads, prompts, max_new_tokens=n, tree=MEDUSA_63, eos_token_id=eos, keep_kv=True
        )
        for prompt, row in zip(prompts, out.rows, strict=True):
            assert row.tokens.tolist() == plain_greedy(model, prompt, n, eos)
            assert_kv_close(row.kv, generate_kv(model, prompt[None], n, eos))
        assert out.rows[1].stop_reason == ("eos" if eos else "max_new_tokens")


def test_finished_rows_leave_the_batch_and_cache_is_never_reallocated():
    model = tiny_model("llama", seed=3)
    heads = random_heads(model, seed=1)
    prompts = prompts_for(4, seed=9)
    budgets = [3, 30, 8, 30]  # rows 0 and 2 finish early: max_new_tokens per row via EOS
    refs = [plain_greedy(model, p, 30) for p in prompts]
    eos = [refs[0][budgets[0] - 1], refs[2][budgets[2] - 1]]
    expected = [plain_greedy(model, p, 30, eos_token_id=eos) for p in prompts]
    batch_sizes, key_ptrs = [], set()

    def hook(module, args, kwargs):
        batch_sizes.append(kwargs["input_ids"].shape[0])
        cache = passed_cache(module, kwargs)
        if cache.layers[0].keys is not None:
            key_ptrs.add(cache.layers[0].keys.data_ptr())

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = medusa_generate_batch(
            model, heads, prompts, max_new_tokens=30, tree=MEDUSA_63, eos_token_id=eos
        )
    finally:
        handle.remove()
    assert [r.tokens.tolist() for r in out.rows] == expected
    assert batch_sizes[0] == 4 and batch_sizes[-1] < 4  # prefill with 4 rows, later forwards fewer
    assert batch_sizes == sorted(batch_sizes, reverse=True)
    assert sum(batch_sizes[1:]) == sum(r.num_forwards for r in out.rows)  # a row costs only its steps
    assert len(key_ptrs) == 1  # one preallocated buffer for the whole call


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batched_context_limit_per_row(arch):
    model = tiny_model(arch, seed=7)
    heads = random_heads(model, seed=3)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (MAX_POS - 3, 5, MAX_POS, 40)]
    out = medusa_generate_batch(model, heads, prompts, max_new_tokens=30, tree=MEDUSA_63)
    assert out.rows[0].tokens.tolist() == plain_greedy(model, prompts[0], 3)
    assert out.rows[0].stop_reason == "context"
    assert out.rows[1].tokens.tolist() == plain_greedy(model, prompts[1], 30)
    assert out.rows[1].stop_reason == "max_new_tokens"
    assert len(out.rows[2].tokens) == 0 and out.rows[2].stop_reason == "empty"
    assert out.rows[3].tokens.tolist() == plain_greedy(model, prompts[3], MAX_POS - 40)
    assert out.rows[3].stop_reason == "context"


def test_batched_mixed_sliding_window_parity():
    model = tiny_model("qwen2", seed=9, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    heads = random_heads(model, seed=8)
    prompts = prompts_for(3, seed=3)
    out = medusa_generate_batch(model, heads, prompts, max_new_tokens=30, tree=MEDUSA_63)
    assert [r.tokens.tolist() for r in out.rows] == [plain_greedy(model, p, 30) for p in prompts]


@pytest.mark.parametrize("acceptance", ["sample", "typical"])
def test_batched_rows_equal_batch1_with_their_own_generator(acceptance):
    """A row's sample is the batch-1 sample with the same seed, whatever its batch mates are."""
    model = tiny_model("llama", seed=2, vocab=16, initializer_range=0.3)
    heads = random_heads(model, seed=4)
    heads.init_from_lm_head(model.get_output_embeddings().weight)  # drafts that often get accepted
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 16, (n,), generator=gen) for n in (3, 9, 5)]
    mates = [torch.randint(1, 16, (n,), generator=gen) for n in (9, 5)]
    kw = dict(max_new_tokens=20, tree=MEDUSA_63, acceptance=acceptance, temperature=0.9, top_p=0.95)
    seeds = [11, 12, 13]
    batch = medusa_generate_batch(
        model, heads, prompts, generators=[torch.Generator().manual_seed(s) for s in seeds], **kw
    )
    other = medusa_generate_batch(
        model, heads, prompts[:1] + mates, generators=[torch.Generator().manual_seed(s) for s in seeds], **kw
    )
    accepted = 0
    for b, (p, s) in enumerate(zip(prompts, seeds, strict=True)):
        one = medusa_generate(model, heads, p[None], generator=torch.Generator().manual_seed(s), **kw)
        assert batch.rows[b].tokens.tolist() == one.tokens.tolist(), b
        assert batch.rows[b].accepted_lengths == one.accepted_lengths
        accepted += sum(n - 1 for n in one.accepted_lengths)
    assert other.rows[0].tokens.tolist() == batch.rows[0].tokens.tolist()
    assert accepted > 0  # the trees really accepted candidates
    if acceptance == "typical":  # temperature 0 is greedy
        kw.update(temperature=0.0)
        out = medusa_generate_batch(model, heads, prompts, **kw)
        assert [r.tokens.tolist() for r in out.rows] == [plain_greedy(model, p, 20) for p in prompts]


def test_a_generator_on_another_device_than_the_model_is_refused_before_any_work():
    """``torch.multinomial`` on a CUDA model's logits fails with a CPU generator mid-generation: both
    decoders check their generators first (the check needs no GPU; CPU generators for a CPU model
    run in the tests above)."""
    from medusa_train.decoding.generate import _check_generators

    cpu = torch.Generator()
    with pytest.raises(
        ValueError, match=r"a generator on cpu for a model on cuda:0: make it with torch.Generator"
    ):
        _check_generators([None, cpu], torch.device("cuda", 0))
    _check_generators([None, cpu], torch.device("cpu"))


def test_batched_sampling_distribution_matches_ancestral():
    """Chi-square of the batched sampler's outputs (4 rows, own generators) against the exact joint."""
    vocab, n_tokens = 6, 3
    model = tiny_model("llama", vocab=vocab, initializer_range=0.5)
    prompt = torch.tensor([1, 4, 2])
    temperature, top_p = 0.8, 0.9
    joint = {(): 1.0}
    for _ in range(n_tokens):
        pre = list(joint)
        ids = torch.cat(
            [prompt.expand(len(pre), -1), torch.tensor(pre, dtype=torch.long).reshape(len(pre), -1)], 1
        )
        with torch.no_grad():
            probs = warp_probs(model(ids).logits[:, -1], temperature, top_p)  # (P, V)
        joint = {p + (v,): joint[p] * float(probs[i, v]) for i, p in enumerate(pre) for v in range(vocab)}
    heads = random_heads(model, seed=0, std=0.0)
    heads.init_from_lm_head(model.get_output_embeddings().weight)
    tree = [[i] for i in range(3)] + [[i, j] for i in range(3) for j in range(3)]
    counts: dict[tuple[int, ...], int] = {}
    calls, rows = 375, 4
    multi = 0
    for c in range(calls):
        out = medusa_generate_batch(
            model, heads, [prompt] * rows, max_new_tokens=n_tokens, tree=tree, acceptance="sample",
            temperature=temperature, top_p=top_p,
            generators=[torch.Generator().manual_seed(c * rows + r) for r in range(rows)],
        )  # fmt: skip
        for r in out.rows:
            counts[tuple(r.tokens.tolist())] = counts.get(tuple(r.tokens.tolist()), 0) + 1
            multi += int(max(r.accepted_lengths) > 1)
    draws = calls * rows
    assert multi > draws // 10
    assert all(joint[k] > 0 for k in counts)
    stat, df, pe, po = 0.0, -1, 0.0, 0
    for key in itertools.product(range(vocab), repeat=n_tokens):
        e, o = joint[key] * draws, counts.get(key, 0)
        if e >= 5:
            stat, df = stat + (o - e) ** 2 / e, df + 1
        else:
            pe, po = pe + e, po + o
    if pe > 0:
        stat, df = stat + (po - pe) ** 2 / pe, df + 1
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)


def test_batched_user_errors():
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=2)
    with pytest.raises(ValueError, match="prompts is empty"):
        medusa_generate_batch(model, heads, [], max_new_tokens=4, tree=chain_tree(2))
    with pytest.raises(ValueError, match="a prompt is empty"):
        medusa_generate_batch(model, heads, [[1, 2], []], max_new_tokens=4, tree=chain_tree(2))
    with pytest.raises(ValueError, match="one per prompt"):
        medusa_generate_batch(
            model, heads, [[1], [2]], max_new_tokens=4, tree=chain_tree(2), generators=[torch.Generator()]
        )
    with pytest.raises(ValueError, match="1-D token ids"):
        medusa_generate_batch(
            model, heads, [torch.ones(2, 3, dtype=torch.long)], max_new_tokens=4, tree=chain_tree(2)
        )
    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    try:  # a rank the vocabulary cannot give: refused before the prefill, as by medusa_generate
        with pytest.raises(TreeError, match=f"rank {VOCAB} but the heads give only {VOCAB}"):
            medusa_generate_batch(model, heads, [[1, 2], [3]], max_new_tokens=4, tree=[[VOCAB]])
    finally:
        hook.remove()
    assert calls == []


def test_no_pad_token_pads_with_any_id():
    """``pad_token_id=None`` (a tokenizer without a pad token): the padding is masked, so any id does."""
    model = tiny_model("llama", seed=3)
    heads = random_heads(model, seed=5)
    prompts = prompts_for(3, seed=6)
    out = medusa_generate_batch(model, heads, prompts, max_new_tokens=8, tree=MEDUSA_63, pad_token_id=None)
    assert [r.tokens.tolist() for r in out.rows] == [plain_greedy(model, p, 8) for p in prompts]


@pytest.mark.parametrize("shapes", [[(2, 4)] * 3, [(2, 4), (1, 4), (2, 4)]], ids=["uniform", "mixed"])
def test_row_cache_moves_entries_and_rows_of_every_layer(shapes):
    """Layers of one shape share one tensor (a move is one op for the model), a layer of another shape
    keeps its own; either way move_entries and keep_rows do the same to every layer's keys and values."""
    from medusa_train.decoding.batched import RowKVCache

    cache = RowKVCache(len(shapes), 8)
    gen = torch.Generator().manual_seed(0)
    written = []
    for layer, (h, d) in zip(cache.layers, shapes, strict=True):  # a prefill of 3 rows x 8 columns
        k, v = torch.randn(3, h, 8, d, generator=gen), torch.randn(3, h, 8, d, generator=gen)
        layer.update(k, v)
        written.append([k.clone(), v.clone()])
    assert [layer.in_storage for layer in cache.layers] == [s == shapes[0] for s in shapes]
    rows, src, dst = torch.tensor([0, 2, 2]), torch.tensor([5, 4, 7]), torch.tensor([1, 0, 3])
    cache.move_entries(rows, src, dst)
    keep = torch.tensor([1, 2])
    cache.keep_rows(keep)
    for layer, tensors in zip(cache.layers, written, strict=True):
        for got, before in zip((layer.keys, layer.values), tensors, strict=True):
            want = before.clone()
            want[rows, :, dst] = before[rows, :, src]
            want[:2] = want[keep].clone()
            assert torch.equal(got, want)


@pytest.mark.parametrize("second_decoder", ["batched", "static"])
def test_calls_on_one_model_from_two_threads_run_one_after_the_other(second_decoder):
    """The decoders switch ``model.config._attn_implementation`` around their forwards: a second
    thread's call on the same model must not run its forwards in between (its prefill would run
    without a mask). While one call is held inside (its ``on_tokens`` blocks), a batched or static
    decoder's call on the same model runs no forward; one on a copy of the model runs; released, both
    give what they give alone."""
    import copy
    import threading

    from medusa_train.decoding import StaticDecoder

    model = tiny_model("llama", seed=2)
    other = copy.deepcopy(model)
    heads, tree = random_heads(model, seed=3), random_tree(1)
    prompt, batch = torch.tensor([[5, 6, 7, 8]]), prompts_for(2, seed=4)

    def decode(m) -> list[torch.Tensor]:
        if second_decoder == "batched":
            out = medusa_generate_batch(m, heads, batch, max_new_tokens=8, tree=tree)
        else:
            out = StaticDecoder(m, heads, tree, 64, batch_size=2).generate_batch(batch, max_new_tokens=8)
        return [r.tokens for r in out.rows]

    alone = medusa_generate(model, heads, prompt, max_new_tokens=8, tree=tree).tokens
    batch_alone = decode(model)
    inside, release, forwarded = threading.Event(), threading.Event(), threading.Event()

    def hold(_tokens) -> None:
        inside.set()
        assert release.wait(30)

    results = {}

    def first() -> None:
        results["first"] = medusa_generate(
            model, heads, prompt, max_new_tokens=8, tree=tree, on_tokens=hold
        ).tokens

    def second(m) -> None:
        results[id(m)] = decode(m)

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert inside.wait(30)
    hook = model.register_forward_hook(lambda *_: forwarded.set())
    try:
        threads.append(threading.Thread(target=second, args=(model,)))
        threads[1].start()
        second(other)  # another model: not held up
        assert not forwarded.wait(2.0)  # the same model: no forward while the first call is inside
    finally:
        release.set()
        for t in threads:
            t.join(60)
        hook.remove()
    assert torch.equal(results["first"], alone)
    for got, want in zip(results[id(model)], batch_alone, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(results[id(other)], batch_alone, strict=True):
        assert torch.equal(got, want)
