"""The static-shape decoder is token-for-token plain greedy ``generate``, eager and under torch.compile,
and with typical acceptance token-for-token ``medusa_generate(acceptance="typical")``; its tensor
acceptance rules pick the same paths as the host-side ones."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import medusa_train.decoding.attention.function as attention_function
import medusa_train.decoding.static as static_module
from medusa_train.decoding import MEDUSA_63, TreeBuffers, chain_tree, medusa_generate, medusa_generate_batch
from medusa_train.decoding.acceptance import accept_greedy, accept_typical
from medusa_train.decoding.static import (
    StaticDecoder,
    StaticKVCache,
    capacity_for,
    columns_needed,
    greedy_path,
    host_synced_rope,
    medusa_generate_static,
    typical_nodes,
    typical_path,
)
from tests.helpers.models import MAX_POS, VOCAB, random_heads, random_tree, tiny_model
from tests.unit.decoding.test_decoding_batched import OracleRows, prompts_for
from tests.unit.decoding.test_decoding_greedy import OracleHeads, assert_kv_close, generate_kv, oracle_eos

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]
TREES = {"chain4": chain_tree(4), "medusa63": MEDUSA_63, "random": random_tree(0), "root": []}


def plain_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> list[int]:
    out = model.generate(
        prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id, pad_token_id=0
    )
    return out[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_static_greedy_parity(arch):
    """One decoder per tree, reused across prompts of different lengths (mistral: window 8 < 30 tokens)."""
    model = tiny_model(arch, seed=ARCHS.index(arch))
    heads = random_heads(model, seed=1)
    lm_heads = random_heads(model, seed=2, std=0.0)
    lm_heads.init_from_lm_head(model.get_output_embeddings().weight)
    gen = torch.Generator().manual_seed(ARCHS.index(arch))
    for name, tree in TREES.items():
        decoders = {
            kind: StaticDecoder(model, h, tree, capacity=2 * MAX_POS)
            for kind, h in (("random", heads), ("lm_head", lm_heads))
        }
        for prompt_len, kind in [(1, "random"), (6, "lm_head"), (19, "random")]:
            prompt = torch.randint(1, VOCAB, (1, prompt_len), generator=gen)
            out = decoders[kind].generate(prompt, max_new_tokens=30)
            assert out.tokens.tolist() == plain_greedy(model, prompt, 30), (arch, name, prompt_len, kind)
            assert sum(out.accepted_lengths) == 30 and out.stop_reason == "max_new_tokens"
            dynamic = medusa_generate(
                model, decoders[kind].packed, prompt, max_new_tokens=30, tree=tree
            )  # same steps as the dynamic decoder
            assert out.accepted_lengths == dynamic.accepted_lengths


class _Rotary(torch.nn.Module):
    """A rotary embedding as transformers calls it (``forward(x, position_ids)``); ``host`` decides on
    the host (``if`` on a tensor) like dynamic NTK RoPE and some releases' LongRoPE."""

    def __init__(self, rope_type: str, host: bool, signature_ok: bool = True) -> None:
        super().__init__()
        self.rope_type, self.host, self.signature_ok = rope_type, host, signature_ok
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)

    def forward(self, x, position_ids, *extra):
        if not self.signature_ok and not extra:
            raise TypeError("forward() missing 1 required positional argument")
        if self.host and position_ids.max() + 1 > 16:
            self.inv_freq = self.inv_freq * 2
        freqs = position_ids[..., None].float() * self.inv_freq
        return freqs.cos(), freqs.sin()


@pytest.mark.parametrize(
    ("rotary", "synced"),
    [
        (_Rotary("longrope", host=True), True),  # decides on the host, whatever its name
        (_Rotary("longrope", host=False), False),  # torch.where in place: capturable
        (_Rotary("yarn", host=False, signature_ok=False), True),  # not probed: judged by its name
        (_Rotary("default", host=False, signature_ok=False), False),
    ],
)
def test_host_synced_rope_is_probed_by_a_forward(rotary, synced):
    model = tiny_model("llama")
    model.model.rotary_emb = rotary
    assert host_synced_rope(model) is synced


def test_a_dynamic_rope_is_never_captured_as_a_cuda_graph():
    """Dynamic NTK RoPE decides on the host, every forward, whether to recompute its frequencies: the
    decoder refuses to capture it as a CUDA graph (which would fail or replay a stale decision), and
    the automatic choices (eval's, ``generate``'s static cache) run its step eager instead; eager, it
    equals plain greedy."""
    from transformers import GenerationConfig

    from medusa_train.custom_generate import _static_capture

    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    plain = tiny_model("llama")
    assert host_synced_rope(dynamic) and not host_synced_rope(plain)
    heads = random_heads(dynamic, seed=1)
    with pytest.raises(ValueError, match="RoPE .*dynamic NTK.*capture='eager'"):
        StaticDecoder(dynamic, heads, MEDUSA_63, capacity=2 * MAX_POS, capture="cuda_graph")
    cuda = torch.device("cuda")
    assert _static_capture(GenerationConfig(), cuda, dynamic) == ("eager", None)
    assert _static_capture(GenerationConfig(), cuda, plain) == ("cuda_graph", None)
    prompt = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    out = StaticDecoder(dynamic, heads, MEDUSA_63, capacity=2 * MAX_POS).generate(prompt, max_new_tokens=20)
    assert out.tokens.tolist() == plain_greedy(dynamic, prompt, 20)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_static_stops_at_eos_and_context(arch):
    model = tiny_model(arch, seed=11)
    heads = random_heads(model, seed=4)
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(6))
    ref = plain_greedy(model, prompt, 40)
    decoder = StaticDecoder(model, heads, MEDUSA_63, capacity=2 * MAX_POS, sync_every=3)
    for pos in (0, 3, 9):
        eos = ref[pos]
        expected = ref[: ref.index(eos) + 1]
        out = decoder.generate(prompt, max_new_tokens=40, eos_token_id=[VOCAB + 5, eos])
        assert out.tokens.tolist() == expected
        assert out.stop_reason == "eos" and sum(out.accepted_lengths) == len(expected)
    long_prompt = torch.randint(1, VOCAB, (1, 19), generator=torch.Generator().manual_seed(5))
    out = decoder.generate(long_prompt, max_new_tokens=100)
    assert out.tokens.tolist() == plain_greedy(model, long_prompt, MAX_POS - 19)
    assert out.stop_reason == "context"
    full = decoder.generate(torch.randint(1, VOCAB, (1, MAX_POS)), max_new_tokens=5)
    assert len(full.tokens) == 0 and full.stop_reason == "empty"


def test_a_prompt_past_the_models_positions_is_empty_and_its_batch_mates_decode():
    """GPT-2's positions end at MAX_POS: a longer prompt gets no tokens ("empty", as from the dynamic
    decoders) and is never prefilled there; the row decoded beside it is its own plain greedy."""
    model = tiny_model("gpt2", seed=11)
    heads = random_heads(model, seed=4)
    gen = torch.Generator().manual_seed(7)
    too_long = torch.randint(1, VOCAB, (1, MAX_POS + 3), generator=gen)
    short = torch.randint(1, VOCAB, (1, 6), generator=gen)
    decoder = StaticDecoder(model, heads, chain_tree(4), capacity=2 * MAX_POS, batch_size=2)
    alone = decoder.generate(too_long, max_new_tokens=10)
    assert len(alone.tokens) == 0 and alone.stop_reason == "empty" and alone.accepted_lengths == []
    out = decoder.generate_batch([too_long, short], max_new_tokens=10)
    assert len(out.rows[0].tokens) == 0 and out.rows[0].stop_reason == "empty"
    assert out.rows[1].tokens.tolist() == plain_greedy(model, short, 10)
    assert out.rows[1].stop_reason == "max_new_tokens"


class RowOracleHeads(OracleHeads):
    """:class:`OracleHeads` for decoders that ask for the heads of several rows at once."""

    def logits_rows(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        return torch.stack([self.logits(h, num_heads) for h in hidden])  # (B, K, V)


def test_static_oracle_heads_accept_whole_paths():
    """Heads that know the greedy continuation: whole chains accepted, and a path that is not contiguous
    in node order (head 1's target at rank 1) is compacted right."""
    model = tiny_model("llama", seed=3)
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    ref = plain_greedy(model, prompt, 40)
    full = torch.cat([prompt[0], torch.tensor(ref)])[None]
    out = medusa_generate_static(
        model, RowOracleHeads(model, full), prompt, max_new_tokens=21, tree=chain_tree(4)
    )
    assert out.tokens.tolist() == ref[:21]
    assert out.accepted_lengths == [5, 5, 5, 5, 1] and out.tau == pytest.approx(21 / 5)
    out = medusa_generate_static(
        model, RowOracleHeads(model, full, rank=1), prompt, max_new_tokens=21, tree=MEDUSA_63
    )
    assert out.tokens.tolist() == ref[:21] and out.accepted_lengths == [4, 4, 4, 4, 4, 1]


def test_static_rows_keep_the_kv_generates_cache_holds_after_them():
    """keep_kv: each row's entries as its own generate's cache holds them after the call (its columns
    before its last token; paths not contiguous in node order, rows ended by the budget inside a step or
    by an EOS inside a path while the other row goes on)."""
    model = tiny_model("llama", seed=3)
    prompts = [p[None] for p in prompts_for(2, seed=4)]
    refs = [torch.tensor(plain_greedy(model, p, 40)) for p in prompts]
    fulls = [torch.cat([p[0], r]) for p, r in zip(prompts, refs, strict=True)]
    decoder = StaticDecoder(model, OracleRows(model, fulls, rank=1), MEDUSA_63, 128, batch_size=2)
    for n, eos in ((19, None), (21, None), (30, oracle_eos(refs[0], 4, 8))):
        out = decoder.generate_batch(prompts, max_new_tokens=n, eos_token_id=eos, keep_kv=True)
        for prompt, row in zip(prompts, out.rows, strict=True):
            assert row.tokens.tolist() == plain_greedy(model, prompt, n, eos)
            assert_kv_close(row.kv, generate_kv(model, prompt, n, eos))
        assert out.rows[0].stop_reason == ("eos" if eos else "max_new_tokens")


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_static_batch_rows_match_plain_greedy(arch):
    """B = 3 rows of different prompt lengths: each row is its own plain greedy; a row that stops at
    EOS leaves the others running; fewer prompts than rows; then the same decoder at batch 1."""
    model = tiny_model(arch, seed=5)
    heads = random_heads(model, seed=6)
    decoder = StaticDecoder(model, heads, MEDUSA_63, capacity=2 * MAX_POS, batch_size=3, sync_every=2)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=gen) for n in (2, 9, 17)]
    refs = [plain_greedy(model, p, 25) for p in prompts]
    out = decoder.generate_batch(prompts, max_new_tokens=25)
    assert [r.tokens.tolist() for r in out.rows] == refs
    assert all(sum(r.accepted_lengths) == 25 and r.stop_reason == "max_new_tokens" for r in out.rows)
    eos = refs[1][4]
    out = decoder.generate_batch(prompts, max_new_tokens=25, eos_token_id=eos)
    for ref, row in zip(refs, out.rows, strict=True):
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert row.tokens.tolist() == ref[:cut]
        assert row.stop_reason == ("eos" if eos in ref else "max_new_tokens")
    two = decoder.generate_batch([p[0] for p in prompts[:2]], max_new_tokens=25)  # (T,) prompts, 2 of 3 rows
    assert [r.tokens.tolist() for r in two.rows] == refs[:2]
    assert decoder.generate(prompts[2], max_new_tokens=25).tokens.tolist() == refs[2]
    with pytest.raises(ValueError, match="1 to 3 prompts"):
        decoder.generate_batch(prompts * 2, max_new_tokens=5)


def test_static_mixed_sliding_window_layers():
    """Qwen2 with one full and one sliding-window layer (window 8, crossed): one mask per layer type,
    three rows each their plain greedy; the window matters (without it the tokens differ)."""
    model = tiny_model("qwen2", seed=9, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    heads = random_heads(model, seed=8)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=gen) for n in (12, 3, 7)]
    refs = [plain_greedy(model, p, 30) for p in prompts]
    decoder = StaticDecoder(model, heads, MEDUSA_63, 2 * MAX_POS, batch_size=3)
    assert [r.tokens.tolist() for r in decoder.generate_batch(prompts, max_new_tokens=30).rows] == refs
    model.config.sliding_window = 1000
    unwindowed = StaticDecoder(model, heads, MEDUSA_63, 2 * MAX_POS, batch_size=3)
    assert [r.tokens.tolist() for r in unwindowed.generate_batch(prompts, max_new_tokens=30).rows] != refs


@pytest.mark.parametrize("seed", range(4))
def test_greedy_path_matches_host_walk(seed):
    """On random logits (with a tree whose tokens often match their parents' argmax), the tensor rule
    accepts the same path as :func:`accept_greedy`."""
    gen = torch.Generator().manual_seed(seed)
    tree = TreeBuffers.from_choices(MEDUSA_63 if seed % 2 else random_tree(seed, nodes=30))
    vocab = 12  # few tokens (the 63-node tree takes top-10): accepted paths of several lengths occur
    retrieve = tree.retrieve_indices.clamp(min=0)
    valid = tree.retrieve_indices[:, 1:] >= 0
    parents = tree.parents.clamp(min=0)
    lengths = set()
    for _ in range(50):
        logits = torch.randn(tree.num_nodes, vocab, generator=gen)
        pred = logits.argmax(-1)
        # Node tokens: each head's distinct top-k, as the decoder lays them out.
        ranks = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(tree.max_depth)])
        flat = torch.cat([torch.tensor([3]), ranks[:, : tree.topk].reshape(-1)])
        tokens = flat[tree.tree_indices]
        path, n = greedy_path(tokens[None], pred[None], retrieve, valid, parents)  # one row
        path, n = path[0], n[0]
        expected = accept_greedy(tokens, logits, tree)
        assert path[: int(n)].tolist() == expected.path
        assert int(pred[path[int(n) - 1]]) == expected.next_token
        lengths.add(int(n))
    assert len(lengths) >= 2


def peaked_model(arch: str, seed: int) -> torch.nn.Module:
    """A tiny model whose final norm is scaled up: its next-token distributions are peaked enough for
    typical acceptance to reject candidates (the plain tiny models are nearly uniform: all accepted)."""
    model = tiny_model(arch, seed=seed)
    norm = model.transformer.ln_f if arch == "gpt2" else model.model.norm
    with torch.no_grad():
        norm.weight.mul_({"gpt2": 8.0}.get(arch, 20.0))
    return model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_static_typical_matches_medusa_generate(arch):
    """Typical acceptance inside the step: batch 1 and three rows (different prompt lengths, a budget
    that cuts the last step's tree), two temperatures, a bushy and a random tree, and an EOS; every row
    is ``medusa_generate(acceptance="typical")`` token for token and step for step."""
    model = peaked_model(arch, seed=4)
    heads = random_heads(model, seed=7)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=gen) for n in (4, 13, 1)]
    lengths = set()
    for tree in (MEDUSA_63, random_tree(3)):
        for temperature in (0.7, 1.0):
            settings = dict(acceptance="typical", temperature=temperature)
            refs = [
                medusa_generate(model, heads, p, max_new_tokens=23, tree=tree, **settings) for p in prompts
            ]
            one = StaticDecoder(model, heads, tree, 2 * MAX_POS, **settings)
            single = one.generate(prompts[0], max_new_tokens=23)
            assert single.tokens.tolist() == refs[0].tokens.tolist()
            assert single.accepted_lengths == refs[0].accepted_lengths
            rows = StaticDecoder(model, heads, tree, 2 * MAX_POS, batch_size=3, sync_every=2, **settings)
            out = rows.generate_batch(prompts, max_new_tokens=23)
            for ref, row in zip(refs, out.rows, strict=True):
                assert row.tokens.tolist() == ref.tokens.tolist(), (tree is MEDUSA_63, temperature)
                assert row.accepted_lengths == ref.accepted_lengths
                lengths.update(ref.accepted_lengths)
            eos = refs[1].tokens.tolist()[6]
            out = rows.generate_batch(prompts, max_new_tokens=23, eos_token_id=eos)
            for p, row in zip(prompts, out.rows, strict=True):
                ref = medusa_generate(
                    model, heads, p, max_new_tokens=23, tree=tree, eos_token_id=eos, **settings
                )
                assert row.tokens.tolist() == ref.tokens.tolist() and row.stop_reason == ref.stop_reason
    assert {1, 2, 3} <= lengths  # candidates were rejected and accepted
    greedy = StaticDecoder(model, heads, MEDUSA_63, 2 * MAX_POS, acceptance="typical", temperature=0.0)
    assert greedy.generate(prompts[1], max_new_tokens=20).tokens.tolist() == plain_greedy(
        model, prompts[1], 20
    )


def _accepted_lengths(tokens, logits, tree, temperature, eps, alpha) -> list[int]:
    """Each root-to-leaf row's accepted prefix, walked on the host (the test's own view of the rule)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (M, V)
    entropy = -(probs * torch.log(probs + 1e-10)).sum(-1)  # (M,)
    threshold = torch.minimum(torch.full_like(entropy, eps), alpha * torch.exp(-entropy))
    lengths = []
    for row in tree.retrieve_indices.tolist():
        n = 0
        while n + 1 < len(row) and row[n + 1] >= 0 and probs[row[n], tokens[row[n + 1]]] > threshold[row[n]]:
            n += 1
        lengths.append(n)
    return lengths


@pytest.mark.parametrize("seed", range(4))
def test_typical_path_matches_accept_typical(seed):
    """On random logits, B = 4 rows at once: the tensor rule accepts the path of :func:`accept_typical`
    (ties in length among several rows included), capped at a budget as ``accept_typical`` on the
    tree's prefix of that depth."""
    gen = torch.Generator().manual_seed(seed)
    tree = TreeBuffers.from_choices(MEDUSA_63 if seed % 2 else random_tree(seed, nodes=30))
    vocab, b, eps, alpha = 12, 4, 0.09, 0.3
    retrieve = tree.retrieve_indices.clamp(min=0)
    valid = tree.retrieve_indices[:, 1:] >= 0
    internal, parent_slot = typical_nodes(tree)
    node_of = {c: n + 1 for n, c in enumerate(tree.choices)}
    ties = lengths = 0
    for temperature in (0.7, 1.0, 1.5):
        for _ in range(15):
            logits = 3 * torch.randn(b, tree.num_nodes, vocab, generator=gen)  # (B, M, V)
            ranks = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(b * tree.max_depth)])
            flat = torch.cat([torch.full((b, 1), 3), ranks[:, : tree.topk].reshape(b, -1)], dim=1)
            tokens = flat[:, tree.tree_indices]  # (B, M)
            cap = torch.randint(0, tree.max_depth + 2, (b,), generator=gen)  # (B,) budget less the root
            path, n = typical_path(
                tokens,
                logits,
                internal,
                parent_slot,
                retrieve,
                valid,
                cap,
                temperature=temperature,
                posterior_threshold=eps,
                posterior_alpha=alpha,
            )
            for r in range(b):
                sub = tree.prefix(int(cap[r]))
                nodes = [0] + [node_of[c] for c in sub.choices]  # sub-tree node -> node
                expected = accept_typical(
                    tokens[r, nodes],
                    logits[r, nodes],
                    sub,
                    temperature=temperature,
                    posterior_threshold=eps,
                    posterior_alpha=alpha,
                )
                got = path[r, : int(n[r])].tolist()
                assert got == [nodes[i] for i in expected.path], (temperature, r)
                assert int(logits[r, got[-1]].argmax()) == expected.next_token
                rows = _accepted_lengths(tokens[r], logits[r], tree, temperature, eps, alpha)
                longest = max(rows)
                heads_of_ties = {
                    tuple(row[: longest + 1])
                    for row, k in zip(tree.retrieve_indices.tolist(), rows, strict=True)
                    if k == longest
                }
                ties += longest > 0 and len(heads_of_ties) > 1 and int(cap[r]) >= longest
                lengths |= 1 << int(n[r])
    assert ties >= 5  # distinct paths of equal length, settled by their log-likelihood
    assert lengths.bit_count() >= 3


def test_static_user_errors():
    model = tiny_model("llama")
    heads = random_heads(model)
    with pytest.raises(ValueError, match="capture"):
        StaticDecoder(model, heads, MEDUSA_63, 128, capture="graph")
    with pytest.raises(ValueError, match="CUDA"):
        StaticDecoder(model, heads, MEDUSA_63, 128, capture="cuda_graph")
    with pytest.raises(ValueError, match="attention must be"):
        StaticDecoder(model, heads, MEDUSA_63, 128, attention="flash")
    with pytest.raises(ValueError, match="acceptance must be one of"):
        StaticDecoder(model, heads, MEDUSA_63, 128, acceptance="beam")
    with pytest.raises(ValueError, match="0 < top_p <= 1"):
        StaticDecoder(model, heads, MEDUSA_63, 128, acceptance="sample", top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        StaticDecoder(model, heads, MEDUSA_63, 128, acceptance="sample", top_k=-1)
    with pytest.raises(ValueError, match="temperature >= 0"):
        StaticDecoder(model, heads, MEDUSA_63, 128, acceptance="typical", temperature=-1.0)
    with pytest.raises(ValueError, match="posterior_alpha must be >= 0"):
        StaticDecoder(model, heads, MEDUSA_63, 128, acceptance="typical", posterior_alpha=-0.3)
    with pytest.raises(ValueError, match="capacity >= "):
        StaticDecoder(model, heads, MEDUSA_63, 80).generate(
            torch.ones(1, 10, dtype=torch.long), max_new_tokens=30
        )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_static_compiled_parity(arch):
    """The step of two rows under torch.compile (inductor, default mode): 15-55 s per model on 2 cores."""
    model = tiny_model(arch, seed=ARCHS.index(arch))
    decoder = StaticDecoder(
        model, random_heads(model, seed=1), random_tree(1), 2 * MAX_POS, capture="compile"
    )
    gen = torch.Generator().manual_seed(20 + ARCHS.index(arch))
    for prompt_len in (3, 11):
        prompt = torch.randint(1, VOCAB, (1, prompt_len), generator=gen)
        assert decoder.generate(prompt, max_new_tokens=30).tokens.tolist() == plain_greedy(model, prompt, 30)


@pytest.mark.slow
def test_static_compiled_typical():
    """Typical acceptance in the step under torch.compile (about 30 s on 2 cores)."""
    model = peaked_model("llama", seed=4)
    heads = random_heads(model, seed=7)
    settings = dict(acceptance="typical", temperature=0.7)
    decoder = StaticDecoder(model, heads, random_tree(1), 2 * MAX_POS, capture="compile", **settings)
    gen = torch.Generator().manual_seed(20)
    for prompt_len in (3, 11):
        prompt = torch.randint(1, VOCAB, (1, prompt_len), generator=gen)
        ref = medusa_generate(model, heads, prompt, max_new_tokens=30, tree=random_tree(1), **settings)
        assert decoder.generate(prompt, max_new_tokens=30).tokens.tolist() == ref.tokens.tolist()


def test_sdpa_backend_applies_to_the_step_and_not_the_prefill(monkeypatch):
    """``sdpa_backend="math"`` forces SDPA's math kernel in the step's forwards only; the prefill keeps
    the backends the other decoders use (flash allowed); the setting is undone after the call."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(query, *args, **kwargs):
        seen.append((query.shape[-2], torch.backends.cuda.flash_sdp_enabled()))
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    model = tiny_model("gpt2", seed=1)
    tree = random_tree(1, nodes=6)
    decoder = StaticDecoder(model, random_heads(model), tree, 64, sdpa_backend="math")
    seen.clear()
    decoder.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=4)
    prefill = [on for n, on in seen if n == 5]
    step = [on for n, on in seen if n == len(tree) + 1]  # the root and the chosen nodes
    assert prefill and all(prefill) and step and not any(step) and len(prefill) + len(step) == len(seen)
    assert torch.backends.cuda.flash_sdp_enabled()
    with pytest.raises(ValueError, match="sdpa_backend"):
        StaticDecoder(model, random_heads(model), tree, 64, sdpa_backend="flash")  # no mask on CUDA


def test_a_model_spread_over_devices_is_refused_by_the_batched_decoders():
    """The batched and static decoders keep row indices on one device: a model with a layer elsewhere
    (``device_map``; here the meta device) is refused in one line naming the devices."""
    model = tiny_model("llama", seed=2)
    heads = random_heads(model, seed=3)
    model.model.layers[1].to("meta")
    with pytest.raises(ValueError, match="spread over cpu, meta: decode its rows one at a time"):
        medusa_generate_batch(model, heads, [torch.tensor([1, 2, 3])], max_new_tokens=4, tree=random_tree(1))
    with pytest.raises(ValueError, match="StaticDecoder needs the model on one device"):
        StaticDecoder(model, heads, random_tree(1), 64)


def test_a_captured_step_is_captured_again_when_the_weights_move():
    """A CUDA graph replays the addresses it was captured with: once the model's weights have new
    storage (``model.cpu(); model.cuda()``, a state dict loaded with ``assign=True``) the step is
    captured again before the call (the capture itself: a gpu test); a model on another device is
    refused in one line. The capture is stood in for here (CPU)."""
    model = tiny_model("llama", seed=2)
    decoder = StaticDecoder(model, random_heads(model, seed=3), random_tree(1), 64)
    captures = []

    def capture():
        captures.append(static_module.weight_addresses(model))
        decoder._captured_weights = captures[-1]

    decoder._capture_graph = capture
    decoder._graph = "captured"  # as after a capture (the eager step still runs)
    capture()
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    ref = plain_greedy(model, prompt, 6)
    assert decoder.generate(prompt, max_new_tokens=6).tokens.tolist() == ref and len(captures) == 1
    for p in model.parameters():
        p.data = p.data.clone()  # same values, new storage
    assert decoder.generate(prompt, max_new_tokens=6).tokens.tolist() == ref and len(captures) == 2
    assert captures[1] != captures[0]
    assert decoder.generate(prompt, max_new_tokens=6).tokens.tolist() == ref and len(captures) == 2
    model.to("meta")
    with pytest.raises(ValueError, match="moved from cpu to meta"):
        decoder.generate(prompt, max_new_tokens=6)


def test_auto_counts_a_step_compiled_into_cuda_graphs_as_captured(monkeypatch):
    """``attention="auto"`` takes the captured step's threshold for a CUDA graph, and for a step compiled
    in a mode that replays CUDA graphs; not for an eager or a default-mode compiled step."""
    seen = []

    def resolve(attention, device, context=None, captured=False, model=None):
        seen.append(captured)
        return "sdpa"

    monkeypatch.setattr(static_module, "resolve_attention", resolve)
    model = tiny_model("llama")
    heads = random_heads(model)
    for capture, mode in [
        ("eager", None),
        ("compile", None),
        ("compile", "reduce-overhead"),
        ("compile", "max-autotune"),
    ]:
        StaticDecoder(model, heads, random_tree(1), 64, capture=capture, compile_mode=mode, attention="auto")
    assert seen == [False, False, True, True]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_forward_without_extra_keyword_arguments_gets_the_step_from_tree_step():
    """The step goes to the attention layers as a forward argument only where the forward takes
    ``**kwargs`` (a model class that declares its arguments would raise on it); such a model's layers
    read the step of ``tree_step``, and the kernel's decoding still equals plain greedy."""
    from transformers import LlamaForCausalLM

    class Declared(LlamaForCausalLM):
        def forward(
            self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, cache=None,
            use_cache=None, output_hidden_states=None, logits_to_keep=0,
        ):  # fmt: skip
            kv = {"cache": cache} if cache is not None else {"past_key_values": past_key_values}
            return super().forward(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=use_cache, output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep, **kv,
            )  # fmt: skip

    plain = tiny_model("llama", seed=3)
    model = Declared(plain.config).eval()
    model.load_state_dict(plain.state_dict())
    heads = random_heads(model, seed=5)
    prompt = torch.tensor([[3, 9, 4, 7, 1]])
    decoder = StaticDecoder(model, heads, random_tree(1, nodes=8), 64, attention="triton")
    assert decoder._step_kwargs == {}
    assert decoder.generate(prompt, max_new_tokens=10).tokens.tolist() == plain_greedy(plain, prompt, 10)
    assert StaticDecoder(plain, heads, random_tree(1, nodes=8), 64, attention="triton")._step_kwargs


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_static_compiled_with_triton_kernel_equals_greedy(monkeypatch):
    """The step under torch.compile with the Triton kernel (CPU: its interpreter, inside the custom
    op): one graph, no graph break (the step reaches the attention layers as a forward argument, not
    through the ContextVar Dynamo cannot read), no recompilation (the windowed ancestor bits are built
    before the trace), every layer of every step ran the kernel, and the output is plain greedy.
    Mistral: grouped-query heads and a sliding window of 8 that the 30 tokens cross (~15 s)."""
    import torch._dynamo.utils

    calls = []
    kernel = attention_function.triton_tree_attention

    def counted(*args, **kwargs):
        calls.append(args[3].tolist())  # past_lens (the compiled graph hands over its own tensor)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention_function, "triton_tree_attention", counted)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_model("mistral", seed=3)
    decoder = StaticDecoder(
        model, random_heads(model, seed=5), random_tree(1), 2 * MAX_POS, capture="compile", attention="triton"
    )
    prompt = torch.randint(1, VOCAB, (1, 11), generator=torch.Generator().manual_seed(21))
    out = decoder.generate(prompt, max_new_tokens=30)
    assert out.tokens.tolist() == plain_greedy(model, prompt, 30)
    layers = len(decoder.cache.layers)
    assert len(calls) == layers * out.num_forwards
    pasts = [calls[i * layers][0] for i in range(out.num_forwards)]  # each step's tree column
    assert calls == [[p] for p in pasts for _ in range(layers)]
    assert pasts[0] == 11 and pasts == sorted(set(pasts))  # the prompt's length, then growing
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_static_with_triton_kernel_equals_greedy(arch, monkeypatch):
    """The step's forward through the Triton kernel (CPU: its interpreter), batch 1 and two rows of
    different lengths (mistral: window 8, crossed): every row is its plain greedy, every layer of every
    step ran the kernel, and the model's attention implementation is its own outside the steps.

    The long row stops at its first token while the short one runs on, under a capacity that only
    just fits the call, so the finished row's length passes C - M (the kernel's column is clamped)."""
    calls = []
    kernel = attention_function.triton_tree_attention

    def counted(*args, **kwargs):
        calls.append(args[3].data_ptr())  # past_lens: the decoder's one tensor
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention_function, "triton_tree_attention", counted)
    model = tiny_model(arch, seed=3)
    heads = random_heads(model, seed=5)
    own = model.config._attn_implementation
    tree = TreeBuffers.from_choices(random_tree(1, nodes=8))
    m = tree.num_nodes
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=gen) for n in (17, 2)]
    refs = [plain_greedy(model, p, 14) for p in prompts]

    one = StaticDecoder(model, heads, tree, capacity=2 * MAX_POS, attention="triton")
    single = one.generate(prompts[0], max_new_tokens=14)
    assert single.tokens.tolist() == refs[0]
    assert calls == [one._kernel_step.past_lens.data_ptr()] * len(one.cache.layers) * single.num_forwards
    assert model.config._attn_implementation == own

    rows = StaticDecoder(
        model, heads, tree, capacity=17 + 14 + m, batch_size=2, sync_every=3, attention="triton"
    )
    eos = refs[0][0]
    out = rows.generate_batch(prompts, max_new_tokens=14, eos_token_id=eos)
    cut = refs[1].index(eos) + 1 if eos in refs[1] else len(refs[1])
    assert [r.tokens.tolist() for r in out.rows] == [refs[0][:1], refs[1][:cut]]
    assert int(rows.length[0]) > rows.capacity - m  # the clamped case ran
    assert model.config._attn_implementation == own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention", ["triton", "cuda"])
@pytest.mark.parametrize("capture", ["cuda_graph", "compile"])
def test_gpu_captured_step_with_kernels_equals_greedy(attention, capture):
    """The CUDA-graph step with the kernel, and the step compiled by inductor with ``reduce-overhead``
    (its own CUDA graphs; the kernel as the custom op), fp32 tiny Llama: three rows of different
    lengths and a second call replaying the same graph each equal their plain greedy."""
    model = tiny_model("llama", seed=3, hidden=128, heads=4, kv_heads=2).cuda()
    heads = random_heads(model, seed=5).cuda()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=gen).cuda() for n in (5, 13, 2)]
    refs = [plain_greedy(model, p, 16) for p in prompts]
    mode = {"compile_mode": "reduce-overhead"} if capture == "compile" else {}
    decoder = StaticDecoder(
        model, heads, random_tree(1, nodes=12), 64, batch_size=3, capture=capture, attention=attention, **mode
    )
    for _ in range(2):
        assert [r.tokens.tolist() for r in decoder.generate_batch(prompts, max_new_tokens=16).rows] == refs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_captured_step_after_the_model_moved_away_and_back():
    """``model.cpu(); model.cuda()`` gives every weight new storage and frees the old (taken here by
    tensors full of NaN): the kept decoder captures its step again and still equals plain greedy."""
    model = tiny_model("llama", seed=3, hidden=128, heads=4, kv_heads=2).cuda()
    heads = random_heads(model, seed=5).cuda()
    prompt = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4)).cuda()
    ref = plain_greedy(model, prompt, 16)
    decoder = StaticDecoder(model, heads, random_tree(1, nodes=12), 64, capture="cuda_graph")
    assert decoder.generate(prompt, max_new_tokens=16).tokens.tolist() == ref
    model.cpu()
    old_blocks = [torch.empty_like(t, device="cuda") for t in (*model.parameters(), *model.buffers())]
    model.cuda()  # new storage: the freed blocks are held above
    for t in old_blocks:
        t.fill_(float("nan") if t.is_floating_point() else 0)
    assert decoder.generate(prompt, max_new_tokens=16).tokens.tolist() == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_captured_step_typical_equals_medusa_generate():
    """Typical acceptance in the CUDA-graph step (fp32 peaked tiny Llama): three rows, two calls replaying
    the same graph, each row ``medusa_generate(acceptance="typical")``."""
    model = peaked_model("llama", seed=4).cuda()
    heads = random_heads(model, seed=7).cuda()
    tree = random_tree(1, nodes=12)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=gen).cuda() for n in (5, 13, 2)]
    settings = dict(acceptance="typical", temperature=0.7)
    refs = [
        medusa_generate(model, heads, p, max_new_tokens=16, tree=tree, **settings).tokens.tolist()
        for p in prompts
    ]
    decoder = StaticDecoder(model, heads, tree, 64, batch_size=3, capture="cuda_graph", **settings)
    for _ in range(2):
        assert [r.tokens.tolist() for r in decoder.generate_batch(prompts, max_new_tokens=16).rows] == refs


def test_one_call_sizes_its_decoder_to_the_context():
    """medusa_generate_static with a budget past the context: sized to what fits, stops at the limit."""
    model = tiny_model("qwen2", seed=2)
    prompt = torch.randint(1, VOCAB, (1, 50), generator=torch.Generator().manual_seed(8))
    out = medusa_generate_static(model, random_heads(model), prompt, max_new_tokens=10**6, tree=MEDUSA_63)
    assert out.tokens.tolist() == plain_greedy(model, prompt, MAX_POS - 50) and out.stop_reason == "context"


@pytest.mark.parametrize("shapes", [[(2, 4)] * 3, [(2, 4), (1, 4), (2, 4)]], ids=["uniform", "mixed"])
def test_static_cache_compacts_every_layer_in_one_tensor_or_layer_by_layer(shapes):
    """Layers of one shape live in one (L, 2, B, H, C, D) tensor and a compaction moves them all at once;
    a layer of another shape keeps its own tensors and the compaction goes layer by layer. Either way
    entry src[b, i] lands at dst[b, i] in every layer, keys and values."""
    cache = StaticKVCache(len(shapes), 10, 2, torch.device("cpu"))
    cache.write_cols = torch.arange(10).expand(2, 10)  # a "step" writing every column
    gen = torch.Generator().manual_seed(0)
    written = []
    for layer, (h, d) in zip(cache.layers, shapes, strict=True):
        k, v = torch.randn(2, h, 10, d, generator=gen), torch.randn(2, h, 10, d, generator=gen)
        layer.update(k, v)
        written.append((k, v))
    uniform = len(set(shapes)) == 1
    assert [layer.in_storage for layer in cache.layers] == [s == shapes[0] for s in shapes]
    assert cache.storage is not None and (cache.storage.shape[0], cache.storage.shape[3]) == (3, 2)
    if uniform:
        assert cache.layers[1].keys.data_ptr() == cache.storage[1, 0].data_ptr()
    src, dst = torch.tensor([[3, 5, 9], [2, 7, 8]]), torch.tensor([[1, 2, 3], [0, 1, 2]])
    cache.move_entries(src, dst)
    for layer, (k, v) in zip(cache.layers, written, strict=True):
        for got, before in ((layer.keys, k), (layer.values, v)):
            want = before.clone()
            for b in range(2):
                want[b, :, dst[b]] = before[b, :, src[b]]
            assert torch.equal(got, want)
    assert not StaticKVCache(1, 4, 1, torch.device("cpu"), shared=False).shared


def test_capacity_is_a_power_of_two_from_256_within_the_limit() -> None:
    assert [capacity_for(n) for n in (0, 1, 256, 257, 1000, 1025)] == [256, 256, 256, 512, 1024, 2048]
    assert capacity_for(300, limit=262) == 512  # the limit is not enough for the need: ignored
    assert capacity_for(261, limit=262) == 262  # the model's positions + the tree: no power of two past them
    assert capacity_for(100, limit=262) == 256


def test_on_tokens_gets_each_steps_accepted_tokens():
    """The streaming hook of both decoders: one call per step with its accepted tokens (oracle heads
    accept whole chains), in order, adding up to the output."""
    model = tiny_model("llama", seed=3)
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    ref = plain_greedy(model, prompt, 40)
    full = torch.cat([prompt[0], torch.tensor(ref)])[None]
    eager: list[list[int]] = []
    out = medusa_generate(
        model, OracleHeads(model, full), prompt, max_new_tokens=21, tree=chain_tree(4), on_tokens=eager.append
    )
    assert [len(t) for t in eager] == out.accepted_lengths == [5, 5, 5, 5, 1] and sum(eager, []) == ref[:21]
    static: list[list[int]] = []
    decoder = StaticDecoder(model, RowOracleHeads(model, full), chain_tree(4), 64)
    out = decoder.generate(prompt, max_new_tokens=21, on_tokens=static.append)
    assert static == eager and out.tokens.tolist() == ref[:21]


def test_a_row_with_no_budget_needs_no_room_for_its_prompt():
    """A row that emits nothing (a prompt past the model's positions, or max_new_tokens=0) is prefilled
    with one token of its prompt: a decoder with room for that and the other rows serves the call, as
    the dynamic decoders do, instead of asking for room for the whole prompt."""
    model = tiny_model("gpt2", seed=11)
    heads = random_heads(model, seed=4)
    gen = torch.Generator().manual_seed(7)
    too_long = torch.randint(1, VOCAB, (1, MAX_POS + 3), generator=gen)
    short = torch.randint(1, VOCAB, (1, 6), generator=gen)
    decoder = StaticDecoder(model, heads, chain_tree(4), capacity=32, batch_size=2)
    out = decoder.generate_batch([too_long, short], max_new_tokens=10)
    assert len(out.rows[0].tokens) == 0 and out.rows[0].stop_reason == "empty"
    assert out.rows[1].tokens.tolist() == plain_greedy(model, short, 10)
    nothing = decoder.generate(too_long[:, :40], max_new_tokens=0)
    assert len(nothing.tokens) == 0 and nothing.stop_reason == "empty"
    assert columns_needed([MAX_POS + 3, 6], [-3, 10], 5) == 6 + 10 + 5
    with pytest.raises(ValueError, match="capacity 33"):  # a row that decodes still needs its prompt
        decoder.generate(too_long[:, :18], max_new_tokens=10)
