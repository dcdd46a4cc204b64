"""The reference tree attention: the compact tree description expanded to a dense boolean mask and
handed to PyTorch's ``scaled_dot_product_attention``.

Runs anywhere (CPU included) and defines what the kernels must compute; it materialises a
``(B, 1, M, W)`` mask per call, which is exactly the cost the kernels avoid.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def unpack_bits(bits: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """``(M, ceil(M / 64))`` int64 ancestor bitmasks -> ``(M, M)`` bool (node i sees node j)."""
    j = torch.arange(num_nodes, device=bits.device)  # (M,)
    words = bits[:, j // 64]  # (M, M)
    return ((words >> (j % 64)) & 1).bool()


def dense_tree_mask(
    past_lens: torch.Tensor,
    starts: torch.Tensor,
    bits: torch.Tensor,
    depth: torch.Tensor,
    width: int,
    window: int | None = None,
) -> torch.Tensor:
    """The boolean mask the kernels apply, written out: ``(B, 1, M, W)``, True where a query may attend.

    Row b's query node i sees columns ``[start_b, past_b)`` (the past; with a window only those whose
    position is less than ``window`` before its own, ``past_b + depth_i``) and the tree columns
    ``past_b + j`` of the nodes j whose bit is set in ``bits[i]``; every other column is masked.
    """
    m = depth.shape[0]
    col = torch.arange(width, device=bits.device)  # (W,)
    rel = col[None, :] - past_lens[:, None].long()  # (B, W): offset from the tree's first column
    past_ok = (col[None, :] >= starts[:, None].long()) & (rel < 0)  # (B, W)
    past_ok = past_ok[:, None, :].expand(-1, m, -1)  # (B, M, W)
    if window is not None:
        past_ok = past_ok & ((depth.long()[None, :, None] - rel[:, None, :]) < window)
    ancestors = unpack_bits(bits, m)  # (M, M)
    in_tree = (rel >= 0) & (rel < m)  # (B, W)
    tree_ok = ancestors[:, rel.clamp(0, m - 1)].permute(1, 0, 2) & in_tree[:, None, :]  # (B, M, W)
    return (past_ok | tree_ok)[:, None]  # (B, 1, M, W)


def sdpa_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_lens: torch.Tensor,
    starts: torch.Tensor,
    bits: torch.Tensor,
    depth: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Tree attention through SDPA with the dense boolean mask (same arguments and result as
    :func:`~medusa_train.decoding.attention.triton_kernel.triton_tree_attention`).

    Returns:
        ``(B, Hq, M, D)`` in the query's dtype.
    """
    mask = dense_tree_mask(past_lens, starts, bits, depth, key.shape[2], window)  # (B, 1, M, W)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )  # (B, Hq, M, D)
