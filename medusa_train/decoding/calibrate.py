"""Choosing a Medusa tree for a model, its heads and a machine.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774), section 3.3.3 / appendix "optimized tree construction": with ``a[k][i]`` the
probability that head k's rank-i candidate is correct, a tree's expected accepted length is the sum
over its nodes of the product of ``a`` along the node's path; grow the tree greedily by adding the
frontier node with the largest path probability. The node count is then chosen to maximise expected
tokens per second, ``tau(N) / latency(N + 1)``, using the forward latency measured on this machine.

Pipeline: :func:`compute_head_accuracy` (or :func:`head_topk_accuracy` on logits you already have)
-> :func:`per_rank_accuracy` -> :func:`grow_tree` -> :func:`measure_forward_latency` ->
:func:`choose_tree` -> :func:`~medusa_train.decoding.tree.save_choices`.
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections.abc import Iterable, Sequence

import torch
from transformers import DynamicCache

from ..heads import MedusaHeads
from .generate import context_limit, verify_forward
from .tree import TreeBuffers


def head_topk_accuracy(
    head_logits: torch.Tensor, targets: torch.Tensor, max_k: int = 10, ignore_index: int = -100
) -> torch.Tensor:
    """Cumulative top-k accuracy of each head.

    Args:
        head_logits: ``(K, N, V)`` logits of K heads at N positions.
        targets: ``(K, N)`` the correct token for each head and position; ``ignore_index`` skips.
        max_k: largest k.

    Returns:
        ``(K, max_k)`` float: entry ``[k, i]`` = fraction of positions whose target is within head k's
        top-(i + 1). Non-decreasing along i.
    """
    k_heads, _, vocab = head_logits.shape
    max_k = min(max_k, vocab)
    top = head_logits.topk(max_k, dim=-1).indices  # (K, N, max_k)
    hit = top == targets[..., None]  # (K, N, max_k)
    cum = hit.long().cumsum(dim=-1).clamp(max=1)  # (K, N, max_k)
    valid = targets != ignore_index  # (K, N)
    count = valid.sum(dim=1).clamp(min=1)  # (K,)
    acc = (cum * valid[..., None]).sum(dim=1).float() / count[:, None]  # (K, max_k)
    return acc.reshape(k_heads, max_k)


def per_rank_accuracy(topk_acc: torch.Tensor) -> torch.Tensor:
    """From cumulative top-k accuracy ``(K, R)`` to per-rank ``a[k][i] = top(i+1) - top(i)``."""
    first = topk_acc[:, :1]  # (K, 1)
    return torch.cat([first, topk_acc[:, 1:] - topk_acc[:, :-1]], dim=1).clamp(min=0)  # (K, R)


@torch.inference_mode()
def compute_head_accuracy(
    model: torch.nn.Module,
    heads: MedusaHeads,
    batches: Iterable[torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    max_k: int = 10,
) -> torch.Tensor:
    """Per-head cumulative top-k accuracy of ``heads`` on held-out token batches.

    Head k (0-based) at position t predicts token ``t + k + 2``; positions whose target falls outside
    the sequence, or is masked, are skipped.

    Args:
        model: the backbone (its last hidden state feeds the heads).
        heads: the Medusa heads.
        batches: ``(B, T)`` token ids, or ``(input_ids, mask)`` pairs with ``mask`` ``(B, T)`` true
            where a token may serve as a target (e.g. assistant tokens only).
        max_k: largest k.

    Returns:
        ``(K, max_k)`` cumulative accuracies, as :func:`head_topk_accuracy`.
    """
    hits: torch.Tensor | None = None
    total = torch.zeros(heads.num_heads)
    for batch in batches:
        ids, mask = (
            batch if isinstance(batch, (tuple, list)) else (batch, torch.ones_like(batch, dtype=torch.bool))
        )
        out = model(input_ids=ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]  # (B, T, d)
        for k in range(heads.num_heads):
            shift = k + 2
            if ids.shape[1] <= shift:
                continue
            feats = hidden[:, :-shift]  # (B, T - shift, d)
            logits = heads.proj(k)(heads.blocks(k)(feats.to(heads.proj(k).weight.dtype)))  # (B, T - shift, V)
            targets = ids[:, shift:].masked_fill(~mask[:, shift:].bool(), -100)  # (B, T - shift)
            acc = head_topk_accuracy(logits.reshape(1, -1, logits.shape[-1]), targets.reshape(1, -1), max_k)[
                0
            ]
            n = int((targets != -100).sum())
            if hits is None:
                hits = torch.zeros(heads.num_heads, acc.shape[0])
            hits[k] += acc.cpu() * n
            total[k] += n
    if hits is None:
        raise ValueError("compute_head_accuracy got no usable batch (sequences must be longer than 2 tokens)")
    return hits / total.clamp(min=1)[:, None]


def grow_tree(
    acc: torch.Tensor | Sequence[Sequence[float]], max_nodes: int
) -> tuple[list[list[list[int]]], list[float]]:
    """Medusa's greedy tree construction.

    Args:
        acc: ``(K, R)`` per-rank accuracies ``a[k][i]`` (see :func:`per_rank_accuracy`): probability
            that head k's rank-i candidate is the right token.
        max_nodes: largest tree size (nodes besides the root).

    Returns:
        ``(trees, expected_tau)``: ``trees[n - 1]`` is the n-node tree (a list of paths, in the order
        they were added, so each tree extends the previous one) and ``expected_tau[n - 1]`` its
        expected tokens per step (expected accepted length + 1). Fewer than ``max_nodes`` entries if
        the K x R tree is exhausted first.
    """
    a = torch.as_tensor(acc, dtype=torch.float64).tolist()
    num_heads, ranks = len(a), len(a[0]) if a else 0
    # Max-heap of frontier nodes: (-path probability, depth, path) -> ties go to shallower, then smaller paths.
    frontier: list[tuple[float, int, tuple[int, ...]]] = (
        [(-a[0][i], 1, (i,)) for i in range(ranks)] if num_heads else []
    )
    heapq.heapify(frontier)
    chosen: list[list[int]] = []
    trees: list[list[list[int]]] = []
    taus: list[float] = []
    expected = 1.0
    while frontier and len(chosen) < max_nodes:
        neg_p, depth, path = heapq.heappop(frontier)
        chosen.append(list(path))
        expected += -neg_p
        trees.append([list(p) for p in chosen])
        taus.append(expected)
        if depth < num_heads:
            for i in range(ranks):
                heapq.heappush(frontier, (neg_p * a[depth][i], depth + 1, path + (i,)))
    return trees, taus


def expected_tau(acc: torch.Tensor | Sequence[Sequence[float]], choices: Sequence[Sequence[int]]) -> float:
    """Expected tokens per step of any tree under per-rank accuracies ``acc`` ``(K, R)``."""
    a = torch.as_tensor(acc, dtype=torch.float64).tolist()
    total = 1.0
    for path in choices:
        p = 1.0
        for k, i in enumerate(path):
            p *= a[k][i] if k < len(a) and i < len(a[k]) else 0.0
        total += p
    return total


@torch.inference_mode()
def measure_forward_latency(
    model: torch.nn.Module,
    sizes: Sequence[int],
    context_len: int,
    *,
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
) -> dict[int, dict[str, float]]:
    """Time one verification forward of N tree tokens on top of a KV cache of ``context_len`` tokens.

    The N tokens form a chain-shaped tree (the mask's shape does not change the cost of a dense
    attention kernel); the cache is cropped back after every forward.

    Args:
        model: the backbone.
        sizes: token counts N to time (tree nodes + 1).
        context_len: tokens in the cache.
        warmup: untimed forwards per size.
        repeats: timed forwards per size; the median is reported.
        seed: for the random context tokens.

    Returns:
        ``{N: {"seconds": median, "relative": median / median at N = 1}}``. N = 1 is always timed.
    """
    limit = context_limit(model)
    sizes = sorted(set(sizes) | {1})
    if limit is not None and context_len + max(sizes) > limit:
        raise ValueError(
            f"context_len {context_len} + {max(sizes)} tree tokens exceeds the model's {limit} positions"
        )
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(0, vocab, (1, context_len), generator=gen).to(device)  # (1, C)
    cache = DynamicCache()
    if context_len:
        model(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1)
    results: dict[int, dict[str, float]] = {}
    for n in sizes:
        tree = TreeBuffers.from_choices([[0] * d for d in range(1, n)]).to(device)
        tokens = torch.randint(0, vocab, (n,), generator=gen).to(device)  # (N,)
        times = []
        for r in range(warmup + repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            verify_forward(model, cache, tokens, tree, context_len)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if r >= warmup:
                times.append(time.perf_counter() - t0)
            cache.crop(-n)
        results[n] = {"seconds": statistics.median(times)}
    base = results[1]["seconds"]
    for n in results:
        results[n]["relative"] = results[n]["seconds"] / base
    return results


def _interp(x: float, xs: list[int], ys: list[float]) -> float:
    """Piecewise-linear interpolation, clamped-slope extrapolation past the last point."""
    if x <= xs[0]:
        return ys[0]
    for j in range(1, len(xs)):
        if x <= xs[j]:
            return ys[j - 1] + (ys[j] - ys[j - 1]) * (x - xs[j - 1]) / (xs[j] - xs[j - 1])
    if len(xs) == 1:
        return ys[0]
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (x - xs[-1])


def choose_tree(
    trees: Sequence[Sequence[Sequence[int]]],
    expected_tau: Sequence[float],
    latency: dict[int, float] | dict[int, dict[str, float]],
) -> tuple[list[list[int]], list[dict[str, float]]]:
    """Pick the tree size that maximises expected tokens per unit of forward time.

    Args:
        trees: ``trees[n - 1]`` has n nodes (from :func:`grow_tree`).
        expected_tau: matching expected tokens per step.
        latency: forward time (any unit) by token count N = nodes + 1; either plain numbers or the
            output of :func:`measure_forward_latency`. Sizes in between are interpolated linearly.

    Returns:
        The best tree's paths and a table (one dict per size: nodes, tokens, expected_tau,
        latency, tau_per_latency) in size order.
    """
    if not trees or len(trees) != len(expected_tau):
        raise ValueError("choose_tree needs as many trees as expected_tau values, and at least one")
    lat = {int(n): float(v["seconds"] if isinstance(v, dict) else v) for n, v in latency.items()}
    xs = sorted(lat)
    ys = [lat[x] for x in xs]
    table = []
    for tree, tau in zip(trees, expected_tau, strict=True):
        n_tokens = len(tree) + 1
        cost = _interp(n_tokens, xs, ys)
        table.append(
            {
                "nodes": len(tree),
                "tokens": n_tokens,
                "expected_tau": float(tau),
                "latency": cost,
                "tau_per_latency": float(tau) / cost,
            }
        )
    best = max(range(len(table)), key=lambda i: table[i]["tau_per_latency"])
    return [list(p) for p in trees[best]], table
