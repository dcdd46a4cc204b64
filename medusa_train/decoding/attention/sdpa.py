"""Tree attention through PyTorch's ``scaled_dot_product_attention``.

:func:`sdpa_tree_attention` is the reference: the compact tree description expanded to a dense boolean
mask. It runs anywhere (CPU included) and defines what the kernels must compute; it materialises a
``(B, 1, M, W)`` mask per call, which is exactly the cost the kernels avoid.

:func:`packed_gqa_sdpa` is how the decoders' ``attention="sdpa"`` path runs a grouped-query layer:
the ``g = Hq / Hkv`` query heads that share a KV head are stacked as ``g * M`` query rows of that KV
head (the mask, shared by every head, repeated for them), so SDPA reads each KV head once. transformers'
own SDPA attention expands K and V to every query head first (``repeat_kv``: a copy of the whole
cache per layer) whenever a mask is given and the query has more than one token.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

PACKED_MAX_QUERIES = 256
"""Longest query :func:`packed_gqa_sdpa` takes: the mask is repeated g times, which for a long prompt
would cost more than the K/V copy it saves (a tree step has at most a few hundred nodes)."""


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
    chunk: int | None = None,
) -> torch.Tensor:
    """The boolean mask the kernels apply, written out: ``(B, 1, M, W)``, True where a query may attend.

    Row b's query node i sees columns ``[start_b, past_b)`` (the past; with a window only those whose
    position is less than ``window`` before its own, ``past_b + depth_i``) and the tree columns
    ``past_b + j`` of the nodes j whose bit is set in ``bits[i]``; every other column is masked. With a
    chunk, only keys whose position (a past column's is the column, a tree node's ``past_b + depth_j``;
    each less ``start_b``) lies in the query's chunk of ``chunk`` positions. ``bits`` carry the window's
    tree part (:meth:`~medusa_train.decoding.attention.TreeMask.bits_for`), not the chunk's.
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
    if chunk is not None:
        first = starts[:, None].long()  # (B, 1): the column of each row's position 0
        node_col = past_lens[:, None].long() + depth.long()[None, :]  # (B, M): a node's position's column
        key = torch.where(in_tree, node_col.gather(1, rel.clamp(0, m - 1)), col[None, :]) - first  # (B, W)
        query = node_col - first  # (B, M)
        same = (key[:, None, :] // chunk) == (query[:, :, None] // chunk)  # (B, M, W)
        past_ok, tree_ok = past_ok & same, tree_ok & same
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
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Tree attention through SDPA with the dense boolean mask (same arguments and result as
    :func:`~medusa_train.decoding.attention.triton_kernel.triton_tree_attention`). With ``sinks`` or
    ``softcap`` the softmax is written out instead, in fp32 (SDPA takes neither): the scores capped
    as Gemma 2's eager attention caps them, each head's sink logit appended as gpt-oss's appends it.

    Returns:
        ``(B, Hq, M, Dv)`` in the query's dtype (``Dv``: the values' head dim).
    """
    mask = dense_tree_mask(past_lens, starts, bits, depth, key.shape[2], window, chunk)  # (B, 1, M, W)
    if sinks is not None or softcap is not None:
        g = query.shape[1] // key.shape[1]
        keys = key.float().repeat_interleave(g, 1)  # (B, Hq, W, D)
        values = value.float().repeat_interleave(g, 1)  # (B, Hq, W, Dv)
        scores = query.float() @ keys.transpose(-1, -2) * scale  # (B, Hq, M, W)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)  # (B, Hq, M, 1)
            scores = torch.cat([scores, sink], -1)
        probs = torch.softmax(scores, -1)[..., : keys.shape[2]]  # (B, Hq, M, W): the sink's column dropped
        return (probs @ values.nan_to_num()).to(query.dtype)  # a stale column's 0 weight times NaN is NaN
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )  # (B, Hq, M, Dv)


def packed_gqa_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """SDPA of a grouped-query layer without expanding K/V: the g query heads of each KV head stacked as
    ``g * M`` rows (the same values as transformers' ``repeat_kv`` path; measured equal to it).

    Args:
        query: ``(B, Hq, M, D)``, ``Hq = g * Hkv``.
        key: ``(B, Hkv, W, D)``.
        value: ``(B, Hkv, W, Dv)``: as wide as the keys, or narrower (MiMo-V2-Flash's grouped layers:
            keys 192 wide, values 128).
        mask: ``(B, 1, M, W)`` float (added to the scores) or bool (True: attend), shared by every head.
        scale: score scale (None: ``1 / sqrt(D)``).
        dropout: attention dropout probability.

    Returns:
        ``(B, M, Hq, Dv)``: the layout transformers' attention functions return.
    """
    bsz, hq, m, d = query.shape
    hkv, width = key.shape[1], mask.shape[-1]
    g = hq // hkv
    rows = query.reshape(bsz, hkv, g * m, d)  # row j * M + i: query head kvh * g + j, node i
    # The mask repeated for the g heads: a new contiguous tensor, laid out as the decoders' own masks
    # (contiguous from an aligned start; a strided view made cuDNN's attention fault on an H100).
    packed = mask[:, :, None].expand(bsz, 1, g, m, width).reshape(bsz, 1, g * m, width)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=packed, dropout_p=dropout, scale=scale)
    # SDPA's output is (B, Hkv, g * M, Dv) in shape, not always in memory: CUDA's efficient and flash
    # kernels return a transposed (B, g * M, Hkv, Dv) buffer, which no view of (B, Hq, M, Dv) reads.
    # Splitting the rows is a view of any layout; the one copy makes (B, M, Hq, Dv), head kvh * g + j.
    return out.unflatten(2, (g, m)).permute(0, 3, 1, 2, 4).reshape(bsz, m, hq, value.shape[-1]).contiguous()
