"""``generate``'s logits processors that change tokens, applied at every node of a tree.

A tree node's logits predict the token after the row's sequence followed by the node's path from the
root (the node included): the token at new-token index ``emitted + depth + 1`` of the row, where
``emitted`` counts the tokens the row emitted before this step's root. Each processor below is
applied to every node as ``generate`` applies it to that sequence, on float32 logits, before the
warpers and the argmax; greedy decoding then stays identical to ``generate`` with the same settings
and sampling draws from the same distribution.

- Repetition penalty (transformers' ``RepetitionPenaltyLogitsProcessor``, ``generate(repetition_penalty=p)``,
  set by some models' generation configs, e.g. Qwen2.5-Instruct's 1.05): the score of every token
  already in the sequence is divided by p where positive and multiplied by p where negative. A node's
  penalised set is the sequence's tokens plus its path's: :func:`penalize` takes the first as a
  ``(..., V)`` bool mask kept per row (the prompt, then every accepted token, :func:`mark_seen`) and
  adds the path's per node from :func:`tree_ancestors`.
- Minimum length (``MinNewTokensLengthLogitsProcessor`` and ``MinLengthLogitsProcessor``,
  ``generate(min_new_tokens=n)`` / ``min_length=n``): EOS is impossible while fewer than n new tokens
  (n tokens in all, the prompt counted) precede the one predicted: :func:`suppress_eos`, with the
  row's bound from :func:`eos_allowed_from`.
"""

from __future__ import annotations

import torch

from .tree import TreeBuffers


def tree_ancestors(tree: TreeBuffers) -> torch.Tensor:
    """``(M, D + 1)`` each node's path as node indices: itself and its ancestors, padded with the root
    (node 0, on every path already)."""
    nodes = torch.arange(tree.num_nodes, device=tree.attn_mask.device)  # (M,)
    on_path = torch.where(tree.attn_mask, nodes[None, :], 0)  # (M, M): j where j is i or an ancestor
    return on_path.sort(dim=1, descending=True).values[:, : tree.max_depth + 1]


def penalize(
    logits: torch.Tensor,
    seen: torch.Tensor,
    penalty: float,
    node_tokens: torch.Tensor | None = None,
    ancestors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 logits with the repetition penalty applied, as transformers applies it.

    Args:
        logits: ``(..., M, V)`` one row of M nodes per leading index (or ``(..., V)`` without a tree).
        seen: ``(..., V)`` bool, the tokens of each row's sequence so far.
        penalty: > 0; 1 changes nothing.
        node_tokens: ``(..., M)`` the token of every node (None: no tree, ``logits`` is ``(..., V)``).
        ancestors: ``(m', D + 1)`` from :func:`tree_ancestors`, of a tree with at least M nodes whose
            first M nodes are these (a depth prefix of the tree).

    Returns:
        ``logits.float()`` with every penalised token's score divided by ``penalty`` where positive,
        multiplied where negative.
    """
    scores = logits.float()
    if node_tokens is None:
        hit = seen
    else:
        m = node_tokens.shape[-1]
        path_tokens = node_tokens[..., ancestors[:m]]  # (..., M, D + 1)
        hit = seen.unsqueeze(-2).expand(scores.shape).clone()  # (..., M, V)
        hit.scatter_(-1, path_tokens, True)
    return torch.where(hit, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def mark_seen(seen: torch.Tensor, tokens: torch.Tensor) -> None:
    """Add ``tokens`` ``(..., n)`` (long) to the sequences' token sets ``seen`` ``(..., V)``, in place."""
    seen.scatter_(-1, tokens, True)


def eos_allowed_from(prompt_len: int, min_new_tokens: int, min_length: int) -> int:
    """The new-token index from which EOS may be predicted: ``generate``'s ``min_new_tokens`` and
    ``min_length`` (which counts the prompt's ``prompt_len`` tokens) together; 0: from the first."""
    return max(min_new_tokens, min_length - prompt_len, 0)


def suppress_eos(
    logits: torch.Tensor,
    eos_mask: torch.Tensor,
    emitted: torch.Tensor | int,
    allowed_from: torch.Tensor | int,
    depth: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 logits with EOS at -inf where the predicted token comes before ``allowed_from``.

    Args:
        logits: ``(..., M, V)`` (or ``(..., V)`` without a tree: the prompt's last position).
        eos_mask: ``(V,)`` bool, the EOS ids.
        emitted: ``(...)`` (or an int) tokens each row emitted before this step's root (0 at the prompt).
        allowed_from: ``(...)`` (or an int) each row's :func:`eos_allowed_from`.
        depth: ``(M,)`` the nodes' depths (None: no tree, the token predicted is at index ``emitted``).

    Returns:
        ``logits.float()`` with the EOS scores of the early positions at -inf.
    """
    device = logits.device  # ints and host tensors are moved there (the static step passes device ones)
    emitted = torch.as_tensor(emitted, device=device)
    allowed_from = torch.as_tensor(allowed_from, device=device)
    if depth is None:
        early = emitted < allowed_from  # (...)
    else:
        early = (emitted[..., None] + depth + 1) < allowed_from[..., None]  # (..., M)
    banned = early[..., None] & eos_mask  # (..., [M,] V)
    return logits.float().masked_fill(banned, float("-inf"))


def eos_mask_of(eos_ids, vocab: int, device: torch.device) -> torch.Tensor:
    """``(V,)`` bool, True at the EOS ids below ``vocab``."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    ids = [int(t) for t in eos_ids if 0 <= int(t) < vocab]
    if ids:
        mask[torch.tensor(ids, device=device)] = True
    return mask
