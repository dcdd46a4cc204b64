"""Choosing a Medusa tree for a model, its heads and a machine.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774), section 3.3.3 / appendix "optimized tree construction": with ``a[k][i]`` the
probability that head k's rank-i candidate is correct, a tree's expected accepted length is the sum
over its nodes of the product of ``a`` along the node's path; grow the tree greedily by adding the
frontier node with the largest path probability. The node count is then chosen to maximise expected
tokens per second, ``tau(N) / latency(N + 1)``, using the forward latency measured on this machine
with the tree attention the tree is decoded with (or, with a tolerance, the smallest count within
that fraction of the maximum: timing noise does not choose on a flat curve).

Pipeline: :func:`head_topk_counts` (or :func:`head_topk_accuracy` on logits you already have)
-> :func:`per_rank_accuracy` -> :func:`grow_tree` -> :func:`measure_forward_latency` ->
:func:`choose_tree` -> :func:`~medusa_train.decoding.tree.save_choices`; :func:`calibrate` runs it
all on held-out batches (what stage=train does after training, into ``calibration.json`` and
``medusa_choices.json``).
"""

from __future__ import annotations

import heapq
import platform
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..head_targets import (
    IGNORE_INDEX,
    chunked_topk_correct,
    last_hidden_state,
    medusa_targets,
    select_trained_rows,
)
from ..heads import MedusaHeads
from ..hf_compat import cache_kwargs
from .attention import one_call_per_model, resolve_attention
from .generate import attention_backends, context_limit, verify_forward
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


Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]


def _batch_tensors(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, loss_mask)``, each ``(B, T)``, from any accepted batch form."""
    if isinstance(batch, dict):
        ids = batch["input_ids"]
        attn = batch.get("attention_mask", torch.ones_like(ids))
        mask = batch.get("loss_mask", torch.ones_like(ids))
    elif isinstance(batch, (tuple, list)):
        ids, mask = batch
        attn = torch.ones_like(ids)
    else:
        ids = batch
        attn = mask = torch.ones_like(ids)
    return ids.to(device), attn.to(device), mask.to(device)


@torch.inference_mode()
def head_topk_counts(
    model: torch.nn.Module,
    heads: MedusaHeads,
    batches: Iterable[Batch],
    max_k: int = 10,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head top-1..max_k hit counts of ``heads`` on token batches, with the training targets.

    Head k (1-based) at position t is scored on token ``t+k+1`` where that token is loss-masked and
    real (:func:`medusa_train.head_targets.medusa_targets`, the targets the training loss uses). Targets are
    full-vocabulary ids for every projection variant: a truncated head's target outside its draft
    vocabulary counts as a miss, so the accuracies (and the tree grown from them) compare across
    variants. Shared heads must be bound to their lm_head (:meth:`MedusaHeads.attach`).

    Args:
        model: the backbone (its decoder's last hidden state feeds the heads).
        heads: the Medusa heads.
        batches: ``(B, T)`` token ids (every token a target), ``(input_ids, loss_mask)`` pairs, or dicts
            with ``input_ids``, ``attention_mask`` (0 on right padding) and ``loss_mask``.
        max_k: largest k.
        chunk_size: rows per chunk of logits (peak memory ``chunk_size * V``).

    Returns:
        ``(hits (K, max_k), count (K,))`` long on the CPU: ``hits[k, i]`` = scored positions whose
        target is within head k's top-(i + 1); ``count[k]`` = positions scored for head k.
    """
    device, dtype = heads.device, heads.dtype
    max_k = min(max_k, heads.draft_vocab_size)
    hits = torch.zeros(heads.num_heads, max_k, dtype=torch.long)
    count = torch.zeros(heads.num_heads, dtype=torch.long)
    for batch in batches:
        ids, attn, mask = _batch_tensors(batch, device)
        hidden = last_hidden_state(model, ids, attn)  # (B, T, d)
        targets = medusa_targets(ids, mask, attn, heads.num_heads)  # (B, T, K)
        rows, row_targets = select_trained_rows(hidden, targets)  # (N, d), (N, K)
        feats = heads.hidden(rows.to(dtype))  # (K, N, d)
        for k in range(heads.num_heads):
            y = row_targets[:, k]  # (N,) full-vocabulary ids
            # Truncated heads: a target outside the draft vocabulary is scored, and never hit.
            y_draft = heads.draft_targets(y)  # (N,)
            hits[k] += chunked_topk_correct(feats[k], heads.head_weight(k), y_draft, max_k, chunk_size).cpu()
            count[k] += int((y != IGNORE_INDEX).sum())
    return hits, count


def compute_head_accuracy(
    model: torch.nn.Module,
    heads: MedusaHeads,
    batches: Iterable[Batch],
    max_k: int = 10,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Per-head cumulative top-k accuracy of ``heads`` on held-out token batches.

    Args:
        model, heads, batches, max_k, chunk_size: as :func:`head_topk_counts`.

    Returns:
        ``(K, max_k)`` cumulative accuracies, as :func:`head_topk_accuracy`.

    Raises:
        ValueError: no position could be scored for any head.
    """
    hits, count = head_topk_counts(model, heads, batches, max_k, chunk_size)
    if int(count.sum()) == 0:
        raise ValueError("compute_head_accuracy got no position to score (sequences longer than 2 tokens)")
    return hits.float() / count.clamp(min=1)[:, None].float()


def grow_tree(
    acc: torch.Tensor | Sequence[Sequence[float]], max_nodes: int
) -> tuple[list[list[list[int]]], list[float]]:
    """Medusa's greedy tree construction.

    Growth stops at the first node of path probability 0 (every node left then has 0): such a node
    never adds to the expected accepted length and costs its verification, so no tree of the result
    holds one, except the 1-node tree when even the first node has 0 (a calibration needs a tree).

    Args:
        acc: ``(K, R)`` per-rank accuracies ``a[k][i]`` (see :func:`per_rank_accuracy`): probability
            that head k's rank-i candidate is the right token.
        max_nodes: largest tree size (nodes besides the root).

    Returns:
        ``(trees, expected_tau)``: ``trees[n - 1]`` is the n-node tree (a list of paths, in the order
        they were added, so each tree extends the previous one) and ``expected_tau[n - 1]`` its
        expected tokens per step (expected accepted length + 1). Fewer than ``max_nodes`` entries if
        the nodes of nonzero probability (at most the K x R tree) run out first.
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
        if frontier[0][0] == 0 and chosen:  # the most likely node left has probability 0
            break
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


def timed_attention(
    attention: str, device: torch.device, context_len: int, model: torch.nn.Module | None = None
) -> str:
    """The tree attention a calibration at ``context_len`` cached tokens times for the decoders'
    ``attention`` choice ("sdpa", "triton", "cuda" or "auto"): the implementation a decoder call of that
    many keys on ``model`` resolves it to (:func:`~medusa_train.decoding.attention.resolve_attention`;
    ``auto`` is "sdpa" on a CPU, below :data:`~medusa_train.decoding.attention.AUTO_MIN_CONTEXT` keys
    and for a model the kernels cannot compute; None: any model they can).

    Raises:
        AttentionBackendError: a choice that cannot run on ``device`` or compute ``model``'s attention.
    """
    return resolve_attention(attention, device, context=context_len, model=model)


@torch.inference_mode()
@one_call_per_model
def measure_forward_latency(
    model: torch.nn.Module,
    sizes: Sequence[int],
    context_len: int,
    *,
    attention: str = "sdpa",
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
    interleave: bool = True,
) -> dict[int, dict[str, float]]:
    """Time one verification forward of N tree tokens on top of a KV cache of ``context_len`` tokens.

    The N tokens form a chain-shaped tree (the mask's shape does not change the cost of a dense
    attention kernel; the tree kernels read as many words of ancestor bits per node whatever the
    shape); the cache is cropped back after every forward. Each forward runs the tree attention the
    decoders run for ``attention`` (:func:`timed_attention`): the dense mask on SDPA, or a kernel
    inside :func:`~medusa_train.decoding.attention.tree_step`, whose cost grows differently with N
    from SDPA's (:data:`~medusa_train.decoding.attention.AUTO_MIN_CONTEXT`), so a curve timed on the
    one chooses the tree for the other; the model's lock is held as in a decoder call (the kernel's
    step switches ``model.config``'s attention). The forwards run under the decoders' attention
    backends (:func:`~medusa_train.decoding.generate.attention_backends`: on CUDA, SDPA without
    cuDNN), so the curve is that of the kernel the tree steps run on, not of the one PyTorch picks by
    default (cuDNN for a masked bf16 call on Hopper, whose cost grows otherwise with N:
    docs/benchmarks.md, ``--sdpa``). The sizes are timed in rounds,
    each round timing every size once (ascending, then descending in the next round), so a machine
    that slows down or speeds up while it measures shifts every size alike instead of the sizes timed
    last (``scripts/bench_calibration.py`` compares the picks of both orders; docs/benchmarks.md).

    Args:
        model: the backbone.
        sizes: token counts N to time (tree nodes + 1).
        context_len: tokens in the cache.
        attention: the decoders' tree attention, "sdpa", "triton", "cuda" or "auto".
        warmup: untimed rounds.
        repeats: timed rounds; the median of each size is reported.
        seed: for the random context tokens.
        interleave: False times each size's warm-up and repeats before the next size
            (``scripts/bench_calibration.py`` compares the two orders).

    Returns:
        ``{N: {"seconds": median, "relative": median / median at N = 1}}``. N = 1 is always timed.

    Raises:
        AttentionBackendError: ``attention`` cannot run on the model's device.
    """
    limit = context_limit(model)
    sizes = sorted(set(sizes) | {1})
    if limit is not None and context_len + max(sizes) > limit:
        raise ValueError(
            f"context_len {context_len} + {max(sizes)} tree tokens exceeds the model's {limit} positions"
        )
    device = next(model.parameters()).device
    backend = timed_attention(attention, device, context_len, model)
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(0, vocab, (1, context_len), generator=gen).to(device)  # (1, C)
    trees = {n: TreeBuffers.from_choices([[0] * d for d in range(1, n)]).to(device) for n in sizes}
    tokens = {n: torch.randint(0, vocab, (n,), generator=gen).to(device) for n in sizes}  # (N,) each
    rounds = range(warmup + repeats)
    if interleave:  # (round, size) in the order they run
        schedule = [(r, n) for r in rounds for n in (sizes if r % 2 == 0 else sizes[::-1])]
    else:
        schedule = [(r, n) for n in sizes for r in rounds]
    times: dict[int, list[float]] = {n: [] for n in sizes}
    cache = DynamicCache()
    with attention_backends(device):
        if context_len:
            model(input_ids=context, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
        for r, n in schedule:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            verify_forward(model, cache, tokens[n], trees[n], context_len, backend)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if r >= warmup:
                times[n].append(time.perf_counter() - t0)
            cache.crop(-n)
    results = {n: {"seconds": statistics.median(times[n])} for n in sizes}
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
    tolerance: float = 0.0,
) -> tuple[list[list[int]], list[dict[str, float]]]:
    """Pick the tree size that maximises expected tokens per unit of forward time, or the smallest one
    within ``tolerance`` of that maximum (:func:`pick_size`).

    Args:
        trees: ``trees[n - 1]`` has n nodes (from :func:`grow_tree`).
        expected_tau: matching expected tokens per step.
        latency: forward time (any unit) by token count N = nodes + 1; either plain numbers or the
            output of :func:`measure_forward_latency`. Sizes in between are interpolated linearly.
        tolerance: fraction in [0, 1): a smaller tree whose expected tokens/s is at least
            ``1 - tolerance`` times the best one's is preferred.

    Returns:
        The chosen tree's paths and a table (one dict per size: nodes, tokens, expected_tau,
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
    nodes = pick_size(table, tolerance)
    chosen = next(tree for tree, row in zip(trees, table, strict=True) if row["nodes"] == nodes)
    return [list(p) for p in chosen], table


def pick_size(table: Sequence[dict[str, float]], tolerance: float = 0.0) -> int:
    """The node count of the smallest tree in ``table`` (:func:`choose_tree`'s) whose expected tokens/s
    (``tau_per_latency``) is at least ``1 - tolerance`` times the best.

    With ``tolerance`` 0 that is the best tree. A tolerance of a few percent, the size of the timing
    noise, keeps noise from choosing: where the curve is flat (a forward costs nearly the same over a
    range of sizes while the expected tau rises slowly) the pick otherwise moves between sizes from one
    calibration to the next, and the smaller tree also costs less in batched decoding.
    """
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    best = max(row["tau_per_latency"] for row in table)
    return min(int(row["nodes"]) for row in table if row["tau_per_latency"] >= (1.0 - tolerance) * best)


TREE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Tree node counts whose forward latency is timed (up to the largest grown tree; others interpolated)."""


def calibrate_tree(
    model: torch.nn.Module,
    topk_acc: torch.Tensor,
    max_nodes: int,
    topk: int,
    context_len: int,
    *,
    attention: str = "sdpa",
    interleave: bool = True,
    tolerance: float = 0.0,
) -> dict:
    """Grow Medusa trees from an accuracy table and choose the size with the best expected tokens/s.

    Args:
        model: the backbone whose tree forwards are timed on this machine.
        topk_acc: ``(K, R)`` cumulative top-k accuracy per head, ``R >= topk``.
        max_nodes: largest tree considered.
        topk: candidates per head considered.
        context_len: KV-cache length of the timed forwards (lowered to fit the model's positions).
        attention: the tree attention the tree will be decoded with ("sdpa", "triton", "cuda" or
            "auto"; the stages pass ``eval.attention``): the forwards are timed with it
            (:func:`measure_forward_latency`).
        interleave: as :func:`measure_forward_latency`.
        tolerance: as :func:`choose_tree`.

    Returns:
        ``{"choices", "table", "latency", "context_len", "best", "grown_nodes", "calibrated_for"}``:
        the chosen tree's paths, the table of :func:`choose_tree`, :func:`measure_forward_latency`'s
        timings, the context length used, the table row of the chosen size, the largest tree grown
        (``max_nodes``, or fewer where the heads' accuracies give no more nodes of nonzero
        probability: :func:`grow_tree`) and :func:`device_label` with the attention timed
        (:func:`timed_attention`).

    Raises:
        AttentionBackendError: ``attention`` cannot run on the model's device.
    """
    per_rank = per_rank_accuracy(topk_acc[:, :topk])  # (K, topk)
    trees, taus = grow_tree(per_rank, max_nodes)
    n_max = len(trees)
    sizes = sorted({n + 1 for n in TREE_SIZES if n <= n_max} | {n_max + 1})
    limit = context_limit(model)
    if limit is not None:
        context_len = max(0, min(context_len, limit - max(sizes)))
    backend = timed_attention(attention, next(model.parameters()).device, context_len, model)
    latency = measure_forward_latency(model, sizes, context_len, attention=backend, interleave=interleave)
    choices, table = choose_tree(trees, taus, latency, tolerance)
    best = next(row for row in table if row["nodes"] == len(choices))
    return {
        "choices": choices,
        "table": table,
        "latency": latency,
        "context_len": context_len,
        "best": best,
        "grown_nodes": n_max,
        "calibrated_for": device_label(model, backend),
    }


def device_label(model: torch.nn.Module, attention: str) -> dict[str, str]:
    """What a tree's latency curve depends on: ``{"device": <GPU name, or "cpu: <CPU model>">, "dtype",
    "attention"}``, ``attention`` the tree attention timed, resolved ("sdpa", "triton" or "cuda").

    A tree calibrated on one device is re-calibrated for another (the latency curve of a GPU is flat
    where a CPU's climbs), and for another tree attention (a kernel's cost grows differently with the
    tree from SDPA's), so this is stored with the calibration and compared at decode time.
    """
    param = next(model.parameters())
    if param.device.type == "cuda":
        name = torch.cuda.get_device_name(param.device)
    else:
        name = f"{param.device.type}: {_cpu_model()}"
    return {"device": name, "dtype": str(param.dtype).removeprefix("torch."), "attention": attention}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class Calibration:
    """What :func:`calibrate` measured and chose.

    Attributes:
        choices: the chosen tree's paths (for ``medusa_choices.json``).
        acc: ``(K, max_k)`` cumulative top-k accuracy per head.
        count: ``(K,)`` positions scored per head.
        tree: :func:`calibrate_tree`'s result.
    """

    choices: list[list[int]]
    acc: torch.Tensor
    count: torch.Tensor
    tree: dict

    def to_json(self) -> dict:
        """The measured part of ``calibration.json``: ``count``, ``head_topk_accuracy``, ``tree``
        (choices, table, context_len, best, grown_nodes, calibrated_for) and ``latency``.

        ``tree.choices`` are the chosen tree's paths: a reader matches the calibration to a tree by
        them (another tree of the same size is not the one it chose)."""
        keys = ("choices", "table", "context_len", "best", "grown_nodes", "calibrated_for")
        return {
            "count": self.count.tolist(),
            "head_topk_accuracy": [[round(float(x), 6) for x in row] for row in self.acc],
            "tree": {k: self.tree[k] for k in keys},
            "latency": {str(n): v for n, v in self.tree["latency"].items()},
        }


def calibrate(
    model: torch.nn.Module,
    heads: MedusaHeads,
    batches: Iterable[Batch],
    *,
    max_nodes: int,
    topk: int,
    context_len: int,
    chunk_size: int = 1024,
    max_k: int = 10,
    tolerance: float = 0.0,
    attention: str = "sdpa",
) -> Calibration:
    """Held-out accuracy of ``heads`` -> the tree with the best expected tokens/s on this machine.

    Args:
        model: the backbone (eval mode: no dropout while measuring).
        heads: the trained heads.
        batches: held-out batches, as :func:`head_topk_counts` takes them.
        max_nodes, topk, context_len, tolerance, attention: as :func:`calibrate_tree`.
        chunk_size: rows per chunk of logits.
        max_k: length of the top-k table.

    Returns:
        :class:`Calibration`.
    """
    hits, count = head_topk_counts(model, heads, batches, max_k, chunk_size)
    acc = hits.float() / count.clamp(min=1)[:, None].float()  # (K, max_k)
    tree = calibrate_tree(model, acc, max_nodes, topk, context_len, attention=attention, tolerance=tolerance)
    return Calibration(tree["choices"], acc, count, tree)
