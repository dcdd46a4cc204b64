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

:class:`RowProcessors` holds a decoder's settings and its rows' state and applies both; every decoder
(``medusa_generate``, ``medusa_generate_batch``, ``StaticDecoder``) uses it.
"""

from __future__ import annotations

from collections.abc import Sequence

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


Rows = Sequence[int] | slice
"""Which of the state's rows a call is about: their indices in order, or ``slice(None)`` for all."""


class RowProcessors:
    """The token-changing processors of a decoder of R rows: the settings, each row's state (its tokens
    so far, its first index allowed EOS, the call's EOS ids) and their application to the logits of a
    prompt's last position and of every step's nodes.

    Nothing here reads the device: the static decoder calls it inside a captured step, on state it
    updates in place (:meth:`state`). With neither processor set, :attr:`active` is False and the
    decoders skip it.

    Args:
        rows: R.
        vocab: V.
        tree: the decoder's tree (a depth prefix of it is verified near the end of a budget).
        device: where the state lives (the logits').
        repetition_penalty, min_new_tokens, min_length: ``generate``'s settings (1, 0, 0: none).
    """

    def __init__(
        self,
        rows: int,
        vocab: int,
        tree: TreeBuffers,
        device: torch.device,
        *,
        repetition_penalty: float = 1.0,
        min_new_tokens: int = 0,
        min_length: int = 0,
    ) -> None:
        self.penalty = repetition_penalty
        self.min_lengths = (min_new_tokens, min_length)
        self.seen: torch.Tensor | None = None  # (R, V) each row's tokens so far
        self.ancestors: torch.Tensor | None = None  # (M, D + 1)
        if repetition_penalty != 1.0:
            self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
            self.ancestors = tree_ancestors(tree)
        self.eos_mask: torch.Tensor | None = None  # (V,) the call's EOS ids
        self.eos_from: torch.Tensor | None = None  # (R,) each row's first new-token index allowed EOS
        self._eos_from_host = [0] * rows
        if min_new_tokens > 0 or min_length > 0:
            self.eos_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.eos_from = torch.zeros(rows, dtype=torch.long, device=device)

    @property
    def active(self) -> bool:
        return self.seen is not None or self.eos_mask is not None

    def state(self) -> list[torch.Tensor]:
        """The tensors updated in place between steps (what a compiled step must treat as static)."""
        return [t for t in (self.seen, self.eos_mask, self.eos_from) if t is not None]

    def set_eos(self, eos_ids: Sequence[int]) -> None:
        """The EOS ids of the call (those a minimum length keeps away)."""
        if self.eos_mask is None:
            return
        self.eos_mask.zero_()
        ids = [int(t) for t in eos_ids if 0 <= int(t) < self.eos_mask.shape[0]]
        if ids:
            self.eos_mask[torch.tensor(ids, device=self.eos_mask.device)] = True

    def start_row(self, row: int, prompt: torch.Tensor) -> None:
        """Row ``row`` begins with ``prompt`` ``(T,)`` (its own tokens, no padding)."""
        if self.seen is not None:
            self.seen[row].zero_()
            mark_seen(self.seen[row], prompt.to(self.seen.device))
        if self.eos_from is not None:
            self._eos_from_host[row] = eos_allowed_from(prompt.shape[-1], *self.min_lengths)
            self.eos_from[row] = self._eos_from_host[row]

    def prompt_logits(self, logits: torch.Tensor, rows: Rows) -> torch.Tensor:
        """``(R', V)`` logits of the rows' prompts' last positions, processed (float32)."""
        if self.seen is not None:
            logits = penalize(logits, self.seen[rows], self.penalty)
        if self.eos_mask is not None:
            logits = suppress_eos(logits, self.eos_mask, 0, self.eos_from[rows])
        return logits

    def node_logits(
        self,
        logits: torch.Tensor,
        rows: Rows,
        node_tokens: torch.Tensor,
        depth: torch.Tensor,
        emitted: torch.Tensor | Sequence[int],
    ) -> torch.Tensor:
        """``(R', M, V)`` node logits of a step, processed (float32).

        Args:
            logits: ``(R', M, V)``.
            rows: the state's rows, in the order of ``logits``.
            node_tokens: ``(R', M)`` the nodes' tokens.
            depth: ``(M,)`` the nodes' depths.
            emitted: ``(R',)`` tokens each row emitted before this step's root: a device tensor (the
                minimum length is then applied unconditionally) or host ints (skipped once every row
                is past its bound).
        """
        if self.seen is not None:
            logits = penalize(logits, self.seen[rows], self.penalty, node_tokens, self.ancestors)
        if self.eos_mask is not None:
            if isinstance(emitted, torch.Tensor):
                logits = suppress_eos(logits, self.eos_mask, emitted, self.eos_from[rows], depth)
            else:
                bounds = (
                    self._eos_from_host[rows]
                    if isinstance(rows, slice)
                    else [self._eos_from_host[r] for r in rows]
                )
                if any(e + 1 < f for e, f in zip(emitted, bounds, strict=True)):  # a node may be early
                    logits = suppress_eos(
                        logits, self.eos_mask, torch.tensor(list(emitted)), self.eos_from[rows], depth
                    )
        return logits

    def accepted(self, rows: Rows, tokens: torch.Tensor) -> None:
        """The rows emitted ``tokens`` ``(R', n)`` (a row's repeats of a token it emitted are harmless:
        the static step pads its paths with their root)."""
        if self.seen is None:
            return
        if isinstance(rows, slice):
            mark_seen(self.seen[rows], tokens)  # a view: marked in place
            return
        for i, row in enumerate(rows):
            mark_seen(self.seen[row], tokens[i])
