"""Tree calibration: head accuracy, Medusa's greedy tree growth, latency-aware tree choice.

On a CPU the Triton kernel runs in triton's interpreter (``TRITON_INTERPRET=1``, set here before triton
is first imported, as in test_tree_attention.py).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import importlib.util  # noqa: E402

import pytest  # noqa: E402

from medusa_train.decoding import (  # noqa: E402
    TreeBuffers,
    choose_tree,
    compute_head_accuracy,
    expected_tau,
    grow_tree,
    head_topk_accuracy,
    measure_forward_latency,
    per_rank_accuracy,
)
from medusa_train.decoding import attention as attention_module  # noqa: E402
from medusa_train.decoding import calibrate as calibrate_module  # noqa: E402
from medusa_train.decoding.attention import function as attention_function  # noqa: E402
from medusa_train.decoding.attention import layers as attention_layers  # noqa: E402
from medusa_train.decoding.attention import support as attention_support  # noqa: E402
from medusa_train.decoding.calibrate import (  # noqa: E402
    calibrate,
    calibrate_tree,
    device_label,
    head_topk_counts,
    pick_size,
)
from tests.helpers.models import VOCAB, random_heads, tiny_model  # noqa: E402
from tests.helpers.training import tiny_logit_step_model  # noqa: E402


def test_head_topk_accuracy_by_hand():
    # 1 head, 3 positions, vocab 4; rankings: [3, 2, 1, 0] at every position.
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0]] * 3])  # (1, 3, 4)
    targets = torch.tensor([[3, 1, -100]])  # rank 0, rank 2, ignored
    acc = head_topk_accuracy(logits, targets, max_k=4)
    assert acc.tolist() == [[0.5, 0.5, 1.0, 1.0]]
    assert per_rank_accuracy(acc).tolist() == [[0.5, 0.0, 0.5, 0.0]]


def test_grow_tree_known_table():
    a = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1]]
    trees, taus = grow_tree(a, max_nodes=5)
    # path probabilities: (0,) .6, (0,0) .3, (1,) .2, (0,1) .12, then (2,) .1 vs (1,0) .1 -> shallower first
    assert trees[-1] == [[0], [0, 0], [1], [0, 1], [2]]
    assert [len(t) for t in trees] == [1, 2, 3, 4, 5]
    assert taus == pytest.approx([1.6, 1.9, 2.1, 2.22, 2.32])
    for tree, tau in zip(trees, taus, strict=True):
        TreeBuffers.from_choices(tree)  # every prefix is a valid tree
        assert expected_tau(a, tree) == pytest.approx(tau)


def test_grow_tree_top1_heads_give_chain():
    trees, taus = grow_tree([[0.9], [0.8], [0.7]], max_nodes=10)
    assert trees[-1] == [[0], [0, 0], [0, 0, 0]]  # exhausted after 3 nodes
    assert taus[-1] == pytest.approx(1 + 0.9 + 0.72 + 0.504)


def test_grow_tree_stops_where_the_nodes_left_have_probability_0():
    """Heads never right past rank 0: the 2-node chain holds every bit of the expected tau; a node of
    probability 0 would only cost its verification. Heads never right at all: the 1-node tree."""
    trees, taus = grow_tree([[0.6, 0.0, 0.0], [0.5, 0.0, 0.0]], max_nodes=5)
    assert trees == [[[0]], [[0], [0, 0]]] and taus == pytest.approx([1.6, 1.9])
    assert grow_tree([[0.0, 0.0], [0.5, 0.5]], max_nodes=5) == ([[[0]]], [1.0])


def test_calibrate_tree_grows_no_useless_node_even_where_a_larger_tree_times_faster(
    monkeypatch: pytest.MonkeyPatch,
):
    """Timing noise that makes a larger forward look cheaper cannot choose a tree with nodes of
    probability 0; the result says how far the tree grew."""

    def noisy(model, sizes, context_len, **kwargs):
        return {n: {"seconds": 1.0 - 0.01 * n} for n in sorted(set(sizes) | {1})}

    monkeypatch.setattr(calibrate_module, "measure_forward_latency", noisy)
    cum = torch.tensor([[0.6, 0.6, 0.6], [0.5, 0.5, 0.5]])  # every hit at rank 0
    result = calibrate_module.calibrate_tree(tiny_model("llama"), cum, max_nodes=6, topk=3, context_len=8)
    assert result["choices"] == [[0], [0, 0]] and result["grown_nodes"] == 2
    assert [row["nodes"] for row in result["table"]] == [1, 2]


def test_grow_tree_tau_monotone_on_real_shape():
    torch.manual_seed(0)
    cum = torch.sort(torch.rand(4, 10), dim=1).values * torch.tensor([[0.95], [0.85], [0.75], [0.65]])
    trees, taus = grow_tree(per_rank_accuracy(cum), max_nodes=64)
    assert len(trees) == 64
    assert all(b >= a for a, b in zip(taus, taus[1:], strict=False))
    assert TreeBuffers.from_choices(trees[-1]).num_nodes == 65


def test_choose_tree_trades_tau_for_latency():
    trees, taus = grow_tree([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1]], max_nodes=5)
    best, table = choose_tree(trees, taus, {1: 1.0, 8: 1.0})  # flat cost: biggest tree wins
    assert best == trees[-1] and len(table) == 5
    best, table = choose_tree(trees, taus, {1: 1.0, 2: 1.5, 6: 10.0})  # steep cost: smallest tree
    assert best == trees[0]
    assert table[0]["tau_per_latency"] == pytest.approx(1.6 / 1.5)


def test_a_tolerance_prefers_the_smallest_tree_near_the_best():
    table = [{"nodes": n, "tau_per_latency": v} for n, v in [(1, 380.0), (2, 700.0), (3, 721.0), (4, 715.0)]]
    assert pick_size(table) == 3 and pick_size(table, 0.0) == 3
    assert pick_size(table, 0.03) == 2  # 700 >= 0.97 * 721
    assert pick_size(table, 0.02) == 3  # 700 < 0.98 * 721; 4 is within but larger
    with pytest.raises(ValueError, match="tolerance"):
        pick_size(table, 1.0)
    trees, taus = grow_tree([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1]], max_nodes=5)
    flat = {1: 1.0, 8: 1.0}  # the biggest tree is best; a wide tolerance takes the smallest
    assert choose_tree(trees, taus, flat)[0] == trees[-1]
    assert choose_tree(trees, taus, flat, tolerance=0.5)[0] == trees[0]  # tau 1.6 >= 0.5 * tau of 5 nodes


def test_latency_is_timed_in_rounds_over_every_size(monkeypatch: pytest.MonkeyPatch):
    """Each round times every size once, alternating direction: drift while measuring hits all sizes."""
    order: list[int] = []
    real = calibrate_module.verify_forward

    def spy(model, cache, tokens, tree, past_len, backend):
        order.append(tokens.numel())
        return real(model, cache, tokens, tree, past_len, backend)

    monkeypatch.setattr(calibrate_module, "verify_forward", spy)
    measure_forward_latency(tiny_model("llama"), [2, 4], context_len=8, warmup=1, repeats=2)
    assert order == [1, 2, 4, 4, 2, 1, 1, 2, 4]


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_latency_times_no_walk_over_the_models_modules(attention, monkeypatch: pytest.MonkeyPatch):
    """A windowed model (Mistral, window 8): whether its code reads the window is decided once per model,
    not in each timed forward (``verify_forward`` asks for the window at every call, the dense mask's
    and the kernel's step alike), whose time would include a walk over the model's modules (0.25 ms
    for a 32-layer Mistral on a 2-core AMD EPYC, 2026-12-07)."""
    if attention == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    model = tiny_model("mistral")
    walks: list[int] = []
    real = model.modules
    monkeypatch.setattr(model, "modules", lambda: walks.append(1) or real())
    measure_forward_latency(model, [2, 4], context_len=8, attention=attention, warmup=1, repeats=2)
    # tree_refusal's (whether the code reads is_decoder), the kernels' check and the first forward's: once
    # per model, not per timed forward (9 here)
    assert len(walks) <= 3


def test_latency_through_a_kernel_places_a_mixed_models_layers_once(monkeypatch: pytest.MonkeyPatch):
    """Gemma 3n (a sliding and a full layer) timed through the Triton kernel: the place of each attention
    module among the decoder layers (``layer_positions``) is found once per model, not in each timed
    forward (a walk over the model's modules, as above)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    model = tiny_logit_step_model("gemma3n")
    walks: list[int] = []
    real = attention_layers.decoder_layers
    for module in (attention_layers, attention_support):  # layer_positions's and the kernels' check's calls
        monkeypatch.setattr(module, "decoder_layers", lambda m: walks.append(1) or real(m))
    measure_forward_latency(model, [2, 4], context_len=8, attention="triton", warmup=1, repeats=2)
    assert attention_module.layer_positions(model)
    # tree_refusal's (whether the code reads is_decoder), the kernels' check and the first forward's: once
    # per model, not per timed forward (9 here)
    assert len(walks) <= 3


def test_latency_is_timed_on_the_decoders_attention_backends(monkeypatch: pytest.MonkeyPatch):
    """Every forward (the context's prefill and each timed one) runs under ``attention_backends`` of
    the model's device, as the decoders' calls do: on CUDA the default would time cuDNN's kernel, not
    the one the tree steps run on."""
    inside: list[bool] = []
    entered: list[torch.device] = []
    active = [False]

    @contextlib.contextmanager
    def backends(device):
        entered.append(device)
        active[0] = True
        try:
            yield
        finally:
            active[0] = False

    real = calibrate_module.verify_forward

    def spy(model, cache, tokens, tree, past_len, backend):
        inside.append(active[0])
        return real(model, cache, tokens, tree, past_len, backend)

    model = tiny_model("llama")
    real_forward = model.forward

    def forward(*args, **kwargs):
        inside.append(active[0])
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(calibrate_module, "attention_backends", backends, raising=False)
    monkeypatch.setattr(calibrate_module, "verify_forward", spy)
    monkeypatch.setattr(model, "forward", forward)
    measure_forward_latency(model, [2], context_len=8, warmup=1, repeats=1)
    assert entered == [torch.device("cpu")]
    assert len(inside) == 1 + 2 * 2 * 2 and all(inside)  # prefill; 2 rounds x 2 sizes, each seen twice


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernel on CPU tensors: the interpreter")
def test_latency_is_timed_with_the_decoders_tree_attention(monkeypatch: pytest.MonkeyPatch):
    """attention=triton: every timed forward runs the Triton kernel, in every layer on the forward's N
    nodes (the context's prefill does not), and the calibration records it; the default and ``auto`` on a
    CPU time SDPA with the dense mask, the decoders' choice there, and record that."""
    calls: list[int] = []
    real = attention_function.triton_tree_attention

    def kernel(query, *args, **kwargs):
        calls.append(query.shape[2])  # (B, Hq, M, D): the forward's tree nodes
        return real(query, *args, **kwargs)

    monkeypatch.setattr(attention_function, "triton_tree_attention", kernel)
    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    measure_forward_latency(model, [2, 4], context_len=8, attention="triton", warmup=1, repeats=1)
    assert calls == [n for n in (1, 2, 4, 4, 2, 1) for _ in range(layers)]  # two rounds, both directions
    acc = torch.tensor([[0.5, 0.7], [0.3, 0.5]])  # (K, R) cumulative top-k
    calls.clear()
    tree = calibrate_tree(model, acc, max_nodes=1, topk=2, context_len=8, attention="triton")
    assert tree["calibrated_for"]["attention"] == "triton"
    assert sorted(set(calls)) == sorted(tree["latency"]) == [1, 2]
    calls.clear()
    for attention in ("sdpa", "auto"):
        tree = calibrate_tree(model, acc, max_nodes=1, topk=2, context_len=8, attention=attention)
        assert tree["calibrated_for"]["attention"] == "sdpa"
    assert calls == []


def test_measure_forward_latency_and_head_accuracy():
    model = tiny_model("llama")
    lat = measure_forward_latency(model, [1, 4, 16], context_len=20, warmup=1, repeats=2)
    assert sorted(lat) == [1, 4, 16] and lat[1]["relative"] == 1.0
    assert all(v["seconds"] > 0 for v in lat.values())
    with pytest.raises(ValueError, match="exceeds"):
        measure_forward_latency(model, [64], context_len=20)

    heads = random_heads(model, num_heads=3)
    batches = [torch.randint(0, VOCAB, (2, 12)) for _ in range(2)]
    acc = compute_head_accuracy(model, heads, batches, max_k=10)
    assert tuple(acc.shape) == (3, 10)
    assert (acc[:, 1:] >= acc[:, :-1]).all() and (acc >= 0).all() and (acc <= 1).all()
    # By hand for head 0 on the first batch alone.
    with torch.no_grad():
        h = model(batches[0], output_hidden_states=True).hidden_states[-1]
        logits = heads(h)[0, :, :-2]  # (B, T - 2, V)
    manual = head_topk_accuracy(logits.reshape(1, -1, VOCAB), batches[0][:, 2:].reshape(1, -1))[0]
    torch.testing.assert_close(compute_head_accuracy(model, heads, batches[:1])[0], manual)


def test_head_accuracy_scores_the_training_targets_on_padded_masked_batches():
    """One accuracy: head k at t is scored on token t+k+1 where it is loss-masked, real and no reply
    ends within t..t+k (``head_targets.medusa_targets``, the training loss's targets); right padding
    changes nothing."""
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=3)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (12, 7)]
    masks = [(torch.rand(n, generator=gen) > 0.3).long() for n in (12, 7)]
    singles = [(i[None], m[None]) for i, m in zip(ids, masks, strict=True)]
    hits, count = head_topk_counts(model, heads, singles, max_k=10)
    padded = {
        "input_ids": torch.stack([ids[0], torch.cat([ids[1], torch.zeros(5, dtype=torch.long)])]),
        "attention_mask": torch.tensor([[1] * 12, [1] * 7 + [0] * 5]),
        "loss_mask": torch.stack([masks[0], torch.cat([masks[1], torch.ones(5, dtype=torch.long)])]),
    }
    hits_padded, count_padded = head_topk_counts(model, heads, [padded], max_k=10)
    assert torch.equal(hits, hits_padded) and torch.equal(count, count_padded)
    # By hand for head k (0-based): position t scored on token t + k + 2 when its mask is 1 and no
    # masked token in t .. t + k + 1 is followed by an unmasked one.
    with torch.no_grad():
        logits = [heads(model(i[None], output_hidden_states=True).hidden_states[-1])[:, 0] for i in ids]

    def scored(m: torch.Tensor, shift: int) -> torch.Tensor:  # (T - shift,) bool
        ends = [bool(m[j] and not m[j + 1]) for j in range(len(m) - 1)]
        return torch.tensor(
            [bool(m[t + shift]) and not any(ends[t : t + shift]) for t in range(len(m) - shift)]
        )

    for k in range(3):
        shift = k + 2
        top1 = sum(
            int(((lg[k, :-shift].argmax(-1) == i[shift:]) & scored(m, shift)).sum())
            for lg, i, m in zip(logits, ids, masks, strict=True)
        )
        assert count[k] == sum(int(scored(m, shift).sum()) for m in masks) and hits[k, 0] == top1


def test_calibrate_measures_and_chooses_a_tree():
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=3)
    batches = [torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))]
    cal = calibrate(model, heads, batches, max_nodes=5, topk=4, context_len=8)
    torch.testing.assert_close(cal.acc, compute_head_accuracy(model, heads, batches))
    assert 1 <= len(cal.choices) <= 5 and cal.tree["best"]["nodes"] == len(cal.choices)
    TreeBuffers.from_choices(cal.choices)
    saved = cal.to_json()
    assert saved["count"] == cal.count.tolist() == [20, 18, 16]
    assert {"choices", "table", "context_len", "best", "grown_nodes", "calibrated_for"} == set(saved["tree"])
    assert saved["tree"]["choices"] == cal.choices  # the chosen tree's paths, to match it by
    assert saved["tree"]["grown_nodes"] == len(saved["tree"]["table"]) and "1" in saved["latency"]
    label = {"device": device_label(model, "sdpa")["device"], "dtype": "float32", "attention": "sdpa"}
    assert saved["tree"]["calibrated_for"] == label  # the default: SDPA with the dense mask


@pytest.mark.parametrize("arch", ["gemma3n", "llama4"])
def test_calibrate_scores_the_heads_on_what_the_lm_head_reads(arch):
    """Gemma 3n, whose ``hidden_states[-1]`` is its AltUp streams stacked, and Llama 4, whose
    ``get_decoder()`` is its causal LM itself: calibration times their tree forwards and scores the heads
    on the states their LM head reads (the ``last_hidden_state`` of the model under it)."""
    model = tiny_logit_step_model(arch) if arch == "gemma3n" else tiny_model(arch, vocab=64, eos_token_id=1)
    heads = random_heads(model, num_heads=3)
    batches = [torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(2))]
    cal = calibrate(model, heads, batches, max_nodes=5, topk=4, context_len=8)
    assert 1 <= len(cal.choices) <= 5 and "1" in cal.to_json()["latency"]
    seen: list = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        model(batches[0])
    hook.remove()
    with torch.no_grad():
        logits = heads(seen[0])[0, :, :-2]  # (B, T - 2, V): head 0 at t, scored on token t + 2
    manual = head_topk_accuracy(logits.reshape(1, -1, 64), batches[0][:, 2:].reshape(1, -1))[0]
    torch.testing.assert_close(cal.acc[0], manual)
