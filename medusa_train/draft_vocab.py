"""The draft vocabulary of truncated heads (``head_projection=truncated``): the token map.

A truncated head projects to N < V tokens; ``token_map`` ``(N,)`` gives the full-vocabulary id of
every draft index (vLLM's ``truncated_vocab_size`` + ``token_map``, EAGLE-3's draft vocabulary).
:func:`draft_token_map` chooses it (the N most frequent targets of the distilled data) and
:func:`check_token_map` checks one read from a file or given by a caller.
"""

from __future__ import annotations

import torch

from medusa_train.errors import HeadsFormatError

TOKEN_MAP = "token_map"
"""Name of the draft vocabulary's ``(N,)`` int64 tensor in the weights file (vLLM reads the same name)."""


def check_token_map(token_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``token_map`` as a ``(N,)`` int64 tensor, checked: 1 <= N <= V distinct ids in ``[0, V)``.

    Raises:
        HeadsFormatError: otherwise (the message names what is wrong).
    """
    if token_map.ndim != 1 or token_map.numel() == 0 or token_map.is_floating_point():
        raise HeadsFormatError(
            f"token_map must be a non-empty 1-D integer tensor, got {token_map.dtype} of shape {tuple(token_map.shape)}"
        )
    token_map = token_map.detach().to("cpu", torch.long)
    if token_map.numel() > vocab_size:
        raise HeadsFormatError(
            f"token_map has {token_map.numel()} ids, more than the vocabulary's {vocab_size}"
        )
    low, high = int(token_map.min()), int(token_map.max())
    if low < 0 or high >= vocab_size:
        raise HeadsFormatError(
            f"token_map holds ids in [{low}, {high}], outside the vocabulary of {vocab_size} tokens"
        )
    if torch.unique(token_map).numel() != token_map.numel():
        raise HeadsFormatError("token_map repeats ids: each draft index must name a different token")
    return token_map.clone()


def draft_token_map(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """The draft vocabulary: the ``size`` most frequent tokens, in increasing id order.

    Args:
        counts: ``(V,)`` how often each token is a training target.
        size: N, tokens kept (ties go to the smaller id).

    Returns:
        ``(token_map (N,) int64, coverage)``: coverage = share of the counted targets whose token is
        in the map (1.0 when nothing was counted).

    Raises:
        HeadsFormatError: ``size`` outside ``1..V``.
    """
    vocab = counts.numel()
    if not 1 <= size <= vocab:
        raise HeadsFormatError(f"a draft vocabulary of {size} tokens does not fit a vocabulary of {vocab}")
    # Stable sort on -count: equal counts keep increasing-id order, so ties go to the smaller id.
    order = torch.sort(-counts.to(torch.long), stable=True).indices  # (V,)
    token_map = order[:size].sort().values
    total = int(counts.sum())
    coverage = float(counts[token_map].sum()) / total if total else 1.0
    return token_map, coverage
