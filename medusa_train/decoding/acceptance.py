"""Acceptance rules for Medusa tree verification.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774): greedy matching and typical acceptance (section 2.3.1); plus exact
("distribution-preserving") sampling in the spirit of speculative sampling (Leviathan et al.,
arXiv:2211.17192) specialised to deterministic drafts.

Every rule sees the tree tokens ``(M,)`` and the backbone's logits at every tree node ``(M, V)``
(node i's logits predict the token that follows node i) and returns the accepted root-to-node path
(node indices, starting with the root 0) and the token that follows its last node (the next root).

- ``greedy``: a node is accepted if its token is the argmax at its parent; the next root is the
  argmax at the last accepted node. The output is exactly plain greedy decoding.
- ``typical``: a node is accepted if ``p(token | parent) > min(posterior_threshold,
  posterior_alpha * exp(-H(parent)))`` with p at the given temperature; longest accepted prefix,
  ties broken by the path's log-likelihood. The root and the next root are the argmax (Medusa's
  default "fast" mode); at temperature 0 this is greedy.
- ``sample``: draw x ~ p (temperature, then top-k, then top-p) at every node; starting at the root,
  descend to the child whose token is x while there is one; the x drawn at the last node is the next
  root. Each emitted token is a draw from the model's conditional given the emitted prefix, so the
  output has exactly the distribution of plain ancestral sampling. At temperature 0 this is greedy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .tree import TreeBuffers

ACCEPTANCE_RULES = ("greedy", "typical", "sample")


@dataclass
class Accepted:
    """Result of one verification.

    Attributes:
        path: node indices of the accepted path, root (0) first; ``len(path) - 1`` candidates accepted.
        next_token: the token that follows the path's last node (root of the next step).
        tokens: the tokens of the path's nodes (``tree_tokens[path]``), root first.
    """

    path: list[int]
    next_token: int
    tokens: list[int] = field(default_factory=list)


_NUCLEUS_RANKS = (64, 128, 256, 512, 1024)
"""How many of the highest scores top-p without a top-k may rank with ``topk`` before it sorts the
vocabulary: the first, then for the rows left undecided the least one that could hold their nucleus."""
_NUCLEUS_SLACK = 1e-4
"""How far past ``top_p`` the mass of the ranked scores must reach for the cutoff found among them to be
the vocabulary's: the mass ahead of every later token is at least theirs up to the rounding of sums of
at most 1, a few units in the last place of float32 (~6e-8 each), far below this."""


_SORTING_DEVICES = ("mps",)
"""Device types where top-p without a top-k sorts the vocabulary even with ``host_sync``: MPS has no
float64, which :func:`_nucleus_cutoff_searched` decides its rows in, and its ``nonzero_static`` and the
search's bit-identity with the sort (a prefix sum over the R highest scores equal to the sort's first
R) are unchecked there. The sort is the rule itself: the same probabilities, only slower."""


def _nucleus_cutoff(
    ranked: torch.Tensor, lse: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lowest of ``ranked`` that top-p keeps, the mass of all of them and that of the last.

    Args:
        ranked: ``(..., R)`` the R highest scores of each row in decreasing order.
        lse: ``(..., 1)`` the log-normaliser of the scores over the whole row.
        top_p: in (0, 1).

    Returns:
        ``(..., 1)`` the cutoff, ``(...)`` the mass of the R scores and ``(...)`` the R-th's.
    """
    mass = (ranked - lse).exp()  # (..., R) each one's probability
    total = mass.cumsum(dim=-1)  # (..., R)
    ahead = total - mass  # mass ranked before each
    keep = ahead < top_p
    keep[..., 0] = True  # at least the most likely token
    cutoff = ranked.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    return cutoff, total[..., -1], mass[..., -1]


def _nucleus_cutoff_searched(scores: torch.Tensor, lse: torch.Tensor, top_p: float) -> torch.Tensor:
    """:func:`_nucleus_cutoff` over the sorted vocabulary, from the highest scores alone where they hold
    enough mass.

    Each round ranks the R highest scores of the rows still undecided with ``topk`` (R from
    :data:`_NUCLEUS_RANKS`); a row whose R scores hold at least ``top_p`` plus
    :data:`_NUCLEUS_SLACK` keeps none beyond them, so its cutoff is the one found among them. The
    masses and their running sum are the same numbers the sorted vocabulary gives at its first R
    places (an elementwise ``exp``; a prefix sum in order), so the cutoff is bit for bit the sort's.
    No later token holds more than the R-th, so a row short of the mass by d needs at least d over
    the R-th's mass more ranks: the next round ranks that many, and a row needing more than the
    last of :data:`_NUCLEUS_RANKS` (a flat distribution after one round) sorts the vocabulary
    (those bounds only choose the work: any choice gives the same cutoff).

    A round decides its rows with masks on the device, in float64 (``enough`` and the bound on the
    ranks not rounded to float32), and waits on it once, to read how many rows it found, how many are
    left and the most ranks one of them needs; the rows left are gathered by ``nonzero_static`` of
    that size, which does not wait again (a boolean index would).

    Args:
        scores: ``(..., V)``.
        lse: ``(..., 1)`` ``scores.logsumexp(-1)``.
        top_p: in (0, 1).

    Returns:
        ``(..., 1)`` the cutoff.
    """
    vocab = scores.shape[-1]
    flat, flat_lse = scores.reshape(-1, vocab), lse.reshape(-1, 1)  # (N, V), (N, 1)
    cutoff = torch.full_like(flat_lse, math.nan)  # (N, 1) NaN: not found among the ranked scores
    enough = top_p + _NUCLEUS_SLACK
    rows = torch.arange(len(flat), device=flat.device)  # (n,) the rows searched
    left, settled = len(flat), 0  # len(rows), the rows found so far
    rank = _NUCLEUS_RANKS[0]
    while left and rank < vocab:
        part, part_lse = (flat, flat_lse) if left == len(flat) else (flat[rows], flat_lse[rows])
        ranked = part.topk(rank, dim=-1).values  # (n, R)
        found_cutoff, held, least = _nucleus_cutoff(ranked, part_lse, top_p)  # (n, 1), (n,), (n,)
        short = enough - held.double()  # (n,)
        found = short <= 0  # (n,) held >= enough
        ranks = rank + short / least  # (n,) no later one holds more; inf or NaN where least is 0 or NaN
        wanted = ~found & (ranks <= _NUCLEUS_RANKS[-1])  # (n,) the others sort the vocabulary
        read = torch.stack((found.sum(), wanted.sum(), ranks.where(wanted, 0).amax()))  # (3,) float64
        found_here, left, most = read.tolist()  # the round's one wait
        if found_here == len(flat):
            return found_cutoff.reshape(lse.shape)
        cutoff[rows] = found_cutoff.where(found[:, None], math.nan)  # a found cutoff is a score, not NaN
        settled += int(found_here)
        rows = rows[wanted.nonzero_static(size=int(left))[:, 0]]  # (n',) in order
        rank = next((r for r in _NUCLEUS_RANKS if r > rank and r >= most), vocab)
    sorting = len(flat) - settled
    if sorting == len(flat):
        ranked = flat.sort(dim=-1, descending=True).values  # (N, V)
        return _nucleus_cutoff(ranked, flat_lse, top_p)[0].reshape(lse.shape)
    if sorting:
        index = cutoff[:, 0].isnan().nonzero_static(size=sorting)[:, 0]  # (n,)
        ranked = flat[index].sort(dim=-1, descending=True).values  # (n, V)
        cutoff[index] = _nucleus_cutoff(ranked, flat_lse[index], top_p)[0]
    return cutoff.reshape(lse.shape)


def warp_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    *,
    host_sync: bool = True,
) -> torch.Tensor:
    """Temperature, then top-k, then nucleus (top-p), then min-p filtering, as ``generate(do_sample=True)``
    applies them (its warpers, in that order).

    Nucleus filtering keeps a token iff the mass of the tokens ranked before it is below ``top_p`` (the
    rule of transformers' ``TopPLogitsWarper``, which drops a token iff the mass of it and every token
    below it is at most ``1 - top_p``), and then every token scoring as high as the lowest one kept.
    With a top-k the ranking needs only the k scores ``topk`` already returned: no sort over the
    vocabulary, the most of the cost at a 128K vocabulary (Llama-3-Instruct's generation config sets
    top-p 0.9 and ``generate`` adds its default top-k of 50). Without one, ``host_sync`` ranks only the
    highest 64 to 1,024 scores of a row where they hold the nucleus (:func:`_nucleus_cutoff_searched`,
    the same cutoff bit for bit), else sorts the vocabulary; without ``host_sync``, and on MPS (no
    float64: :data:`_SORTING_DEVICES`), it sorts.

    Args:
        logits: ``(..., V)``.
        temperature: > 0.
        top_p: in (0, 1]; the smallest set of tokens whose mass reaches ``top_p`` is kept (at least one).
        top_k: keep the k highest scores (and any tied with the k-th); 0: no top-k.
        min_p: in [0, 1]; keep the tokens whose probability is at least ``min_p`` times the most
            likely one's (after the filters above); 0: none.
        host_sync: whether top-p without a top-k may wait on the device to choose how many scores to
            rank (not on MPS); False (a captured CUDA graph, ``torch.compile``): it sorts the vocabulary.

    Returns:
        ``(..., V)`` float32 probabilities.
    """
    scores = logits.float() / temperature  # (..., V)
    ranked = None  # the highest scores in decreasing order, (..., R)
    if 0 < top_k < scores.shape[-1]:
        ranked = scores.topk(top_k, dim=-1).values  # (..., k)
        scores = scores.masked_fill(scores < ranked[..., -1:], float("-inf"))
    if top_p < 1.0:
        lse = scores.logsumexp(dim=-1, keepdim=True)  # (..., 1)
        if ranked is not None:
            cutoff = _nucleus_cutoff(ranked, lse, top_p)[0]  # (..., 1)
        elif host_sync and scores.device.type not in _SORTING_DEVICES:
            cutoff = _nucleus_cutoff_searched(scores, lse, top_p)
        else:
            cutoff = _nucleus_cutoff(scores.sort(dim=-1, descending=True).values, lse, top_p)[0]
        scores = scores.masked_fill(scores < cutoff, float("-inf"))
    if min_p > 0.0:
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return scores.softmax(dim=-1)


def _candidate_rows(tree_tokens: torch.Tensor, tree: TreeBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens along every root-to-leaf path and which entries are real (not padding).

    Returns:
        ``(L, D + 1)`` tokens (padding entries hold 0) and ``(L, D)`` bool validity of entries 1..D.
    """
    retrieve = tree.retrieve_indices  # (L, D + 1)
    rows = tree_tokens[retrieve.clamp(min=0)]  # (L, D + 1)
    return rows, retrieve[:, 1:] >= 0


def _path_from_row(tree: TreeBuffers, lengths: torch.Tensor, row: torch.Tensor) -> list[int]:
    """Node indices of the first ``lengths[row] + 1`` entries of retrieve row ``row``."""
    nodes = tree.retrieve_indices[row]  # (D + 1,)
    return nodes[: int(lengths[row]) + 1].tolist()


def argmax_list(x: torch.Tensor) -> list[int]:
    """Row-wise argmax of ``(..., V)`` as host ints: the first maximal index, as ``torch.argmax``.

    On CPU float32/float64 tensors numpy's argmax is used (the same first-maximum and NaN rules,
    several times faster than torch's CPU argmax on a few rows of a vocabulary); elsewhere
    ``torch.argmax`` and one device-to-host copy.
    """
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return (x.detach() if x.requires_grad else x).numpy().argmax(-1).tolist()
    return x.argmax(dim=-1).tolist()


def accept_greedy(
    tree_tokens: torch.Tensor | Sequence[int], logits: torch.Tensor, tree: TreeBuffers
) -> Accepted:
    """Longest path whose every token is the argmax at its parent.

    Args:
        tree_tokens: ``(M,)`` token of every node (a tensor, or the same ints already on the host).
        logits: ``(M, V)`` backbone logits at every node.
        tree: the buffers the tokens were laid out with.
    """
    node_tokens = tree_tokens.tolist() if isinstance(tree_tokens, torch.Tensor) else tree_tokens
    return _accept_by_match(node_tokens, argmax_list(logits), tree)


def accept_sample(
    tree_tokens: torch.Tensor,
    logits: torch.Tensor,
    tree: TreeBuffers,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    min_p: float = 0.0,
) -> Accepted:
    """Distribution-preserving acceptance: draw at every node, follow the draws down the tree.

    A draw at every node (one batched ``multinomial``) is equivalent to drawing lazily while
    walking, because the draws are independent and only those on the walked path are used.
    """
    if temperature <= 0:
        return accept_greedy(tree_tokens, logits, tree)
    probs = warp_probs(logits, temperature, top_p, top_k, min_p)  # (M, V)
    draws = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (M,)
    node_tokens, draw_list = torch.stack((tree_tokens, draws)).tolist()  # one device-to-host copy
    return _accept_by_match(node_tokens, draw_list, tree)


def walk_matches(
    node_tokens: Sequence[int], pred: Sequence[int], children: Sequence[Sequence[int]]
) -> list[int]:
    """From the root, descend to the child whose token equals ``pred`` at the current node.

    Children of a node hold distinct tokens (different ranks of the same head's top-k), so at most
    one child matches and the path is the unique longest path whose every token equals ``pred`` at
    its parent. (Given repeated sibling tokens, the first matching child in node order is taken.)

    Args:
        node_tokens: ``(M,)`` token of every node (host list).
        pred: ``(M,)`` the token each node predicts for its successor (argmax or draw; host list).
        children: per node, its child node indices (:meth:`TreeBuffers.child_lists`).

    Returns:
        node indices of the path, root (0) first.
    """
    path = [0]
    node = 0
    while True:
        want = pred[node]
        for child in children[node]:
            if node_tokens[child] == want:
                node = child
                break
        else:
            return path
        path.append(node)


def _accept_by_match(node_tokens: list[int], pred: list[int], tree: TreeBuffers) -> Accepted:
    """Accept the longest path whose tokens equal ``pred`` at their parents; ``pred`` gives the next root.

    Host lists of M ints each; the walk visits at most depth x children nodes.
    """
    path = walk_matches(node_tokens, pred, tree.child_lists())
    return Accepted(path=path, next_token=pred[path[-1]], tokens=[node_tokens[n] for n in path])


def accept_typical(
    tree_tokens: torch.Tensor,
    logits: torch.Tensor,
    tree: TreeBuffers,
    *,
    temperature: float = 1.0,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> Accepted:
    """Medusa's typical acceptance (longest prefix above an entropy-adaptive threshold)."""
    if temperature <= 0:
        return accept_greedy(tree_tokens, logits, tree)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (M, V)
    entropy = -(probs * torch.log(probs + 1e-10)).sum(dim=-1)  # (M,)
    threshold = torch.minimum(
        torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy)
    )  # (M,)
    rows, valid = _candidate_rows(tree_tokens, tree)  # (L, D + 1), (L, D)
    parent = tree.retrieve_indices[:, :-1].clamp(min=0)  # (L, D)
    cand_p = probs[parent, rows[:, 1:]]  # (L, D)
    ok = (cand_p > threshold[parent]) & valid  # (L, D)
    lengths = ok.long().cumprod(dim=1).sum(dim=1)  # (L,)
    longest = lengths.max()
    if int(longest) == 0:
        path = [0]
    else:
        depth_idx = torch.arange(rows.shape[1] - 1, device=rows.device)  # (D,)
        in_prefix = depth_idx[None, :] < lengths[:, None]  # (L, D)
        loglik = torch.where(in_prefix, torch.log(cand_p + 1e-10), torch.zeros_like(cand_p)).sum(
            dim=1
        )  # (L,)
        loglik = torch.where(lengths == longest, loglik, torch.full_like(loglik, -math.inf))
        best = int(loglik.argmax())
        path = _path_from_row(tree, lengths, best)
    node_tokens = tree_tokens.tolist()
    return Accepted(
        path=path, next_token=int(logits[path[-1]].argmax()), tokens=[node_tokens[n] for n in path]
    )


def first_token(
    logits: torch.Tensor,
    acceptance: str,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    min_p: float = 0.0,
) -> int:
    """The first new token, chosen from the prefill's last logits ``(V,)`` under the same rule."""
    if acceptance == "sample" and temperature > 0:
        probs = warp_probs(logits, temperature, top_p, top_k, min_p)  # (V,)
        return int(torch.multinomial(probs, 1, generator=generator))
    return int(logits.argmax())
