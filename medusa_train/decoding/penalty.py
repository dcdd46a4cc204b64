"""``generate``'s repetition penalty, applied at every node of a tree.

transformers' ``RepetitionPenaltyLogitsProcessor`` (``generate(repetition_penalty=p)``, set by some
models' generation configs, e.g. Qwen2.5-Instruct's 1.05) divides the score of every token already
in the sequence by p where the score is positive and multiplies it by p where it is negative, on
float32 logits, before the warpers and the argmax. A tree node's logits predict the token after the
row's sequence followed by the node's path from the root (the node included), so its penalised set
is the sequence's tokens plus that path's: :func:`penalize` takes the first as a ``(..., V)`` bool
mask kept per row (the prompt, then every accepted token) and adds the path's per node from
:func:`tree_ancestors`. Greedy decoding with it is then identical to ``generate`` with the same
penalty; sampling draws from the same distribution.
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
