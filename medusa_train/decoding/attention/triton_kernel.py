"""Tree attention as a Triton kernel: online softmax over the past without a mask, then the tree's nodes
masked by their ancestor bits.

One program per (row b, KV head, block of packed query rows, KV split). The ``g = Hq / Hkv`` query heads
that share a KV head are packed into one block of ``g * M`` query rows, so every key and value tile is
read once per KV head (GQA without expanding K/V). A program walks its share of row b's past columns
``[start_b, past_b)`` in tiles of ``BLOCK_N`` keys (bounds only: the past is fully visible), and the
program of the last split then the M tree columns ``[past_b, past_b + M)``, where query node i sees
node j iff bit ``j % 64`` of word ``j // 64`` of ``bits[i]`` is set (nodes are ordered so that a node's
ancestors precede it, as :class:`~medusa_train.decoding.tree.TreeBuffers` orders them: a program stops
at the tree column after its last node). Scores and the running max/sum
are fp32 (exp2 with the scale folded in). With several KV splits (long contexts, few programs) each
split writes its unnormalised partial output and (max, sum) to fp32 scratch and a second kernel
combines them (flash-decoding).

A sliding window or a chunk (Llama 4's chunked layers) gives each query row a first visible column,
from its position ``past_b - start_b + depth_i`` (row b's positions count from its first visible column
``start_b``): ``WINDOW - 1`` positions before it, or its chunk's first position. The past tiles mask the
columns before it (a program starts at the lowest such column of its rows); the window's tree part is in
the ancestor bits (depths differ by the same every step), the chunk's is not (where a chunk ends depends
on the row's past): the tree tiles mask a node whose position ``past_b + depth_j`` lies before it.

Softcapped scores (Gemma 2's ``attn_logit_softcapping``): each scaled score ``x`` becomes
``cap * tanh(x / cap)`` before the mask and the softmax (tanh through exp2).

Attention sinks (gpt-oss's ``sinks``, passed to the attention as ``s_aux``): one learned logit per query
head joins each row's softmax as a key with no value; it is added to the row's max and sum once, at the
end of an unsplit program or in the combine kernel.

Launch configuration (query rows and keys per tile, warps, pipeline stages). On a CUDA device the first
call of each shape class (:func:`tuning_key`) times every candidate of :func:`candidate_configs` on its
own inputs, in GPU time (:func:`gpu_ms`) over a few rounds (:func:`fastest`), and keeps the fastest for
the process (:func:`tuned_configs`). A call inside a CUDA-graph
capture never times anything: it takes the tuned configuration if its shape class was seen before (the
static decoder warms its step up before capturing it), else :func:`default_config`; a call traced by
``torch.compile`` always takes the default (the decoders' compiled steps call the kernel through a custom
op instead, :func:`medusa_train.decoding.attention.kernel_op`, which runs this launcher at run time). ``MEDUSA_TRITON_TUNE=0`` turns the tuning off (the
default configuration everywhere). triton's own ``triton.autotune`` is not used because it would time
candidates inside a capture or a trace. The interpreter always takes the default configuration.

Triton is optional: it is imported (and the kernels compiled) on first use. On a CPU the kernels run
in triton's interpreter when ``TRITON_INTERPRET=1`` is set before triton is imported.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

tl = None  # triton.language, bound by _kernels() (the jitted kernels resolve it as a module global)


def interpreter_enabled() -> bool:
    """Whether triton runs its kernels in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    """Whether triton is importable (the kernel then runs on CUDA tensors, or on CPU tensors in the
    interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    """Import triton and define the two kernels (once)."""
    global tl
    import triton
    import triton.language as language

    tl = language

    global _past_tile, _scores

    @triton.jit
    def _scores(q, k, qk_scale, cap, DOT_PREC: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
        """``q @ k`` scaled, in log2 units; softcapped, ``cap * tanh(s / cap)`` (``cap`` in log2 units
        too), where ``HAS_SOFTCAP``: tanh(y) = 1 - 2 / (e^(2y) + 1), 1 to fp32 precision from 2y = 44
        (2^64 in the exponent's place), -1 where e^(2y) vanishes."""
        s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale
        if HAS_SOFTCAP:
            e = tl.exp2(tl.minimum(s / cap * 2.8853900817779268, 64.0))  # e^(2y); 2.885...: 2 log2(e)
            s = cap * (1.0 - 2.0 / (e + 1.0))
        return s

    @triton.jit
    def _past_tile(
        q, k_base, v_base, n0, c_hi, lo_row, m_i, l_i, acc, dofs, d_ok, vofs, v_ok, skn, skd, svn, svd,
        qk_scale, cap, BLOCK_N: tl.constexpr, ROW_LO: tl.constexpr, BOUNDED: tl.constexpr,
        EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
    ):  # fmt: skip
        """One tile of past keys ``[n0, n0 + BLOCK_N)`` into the online softmax: ``(m_i, l_i, acc)``.
        ``BOUNDED``: the tile may pass ``c_hi`` (the last one), so its columns are checked; ``ROW_LO``:
        each row's first visible column ``lo_row`` is checked (a window or a chunk); otherwise every score
        is finite and no mask is built at all."""
        cols = n0 + tl.arange(0, BLOCK_N)
        k_ptr = k_base + cols[None, :] * skn + dofs[:, None] * skd  # (BLOCK_D, BLOCK_N)
        v_ptr = v_base + cols[:, None] * svn + vofs[None, :] * svd  # (BLOCK_N, BLOCK_DV)
        if BOUNDED:
            col_ok = cols < c_hi
            k = tl.load(k_ptr, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptr)
        else:
            k = tl.load(k_ptr, mask=d_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = _scores(q, k, qk_scale, cap, DOT_PREC, HAS_SOFTCAP)  # (BLOCK_M, BLOCK_N), log2 units
        if BOUNDED or ROW_LO:
            if BOUNDED:
                valid = col_ok[None, :]
                if ROW_LO:
                    valid = valid & (cols[None, :] >= lo_row[:, None])
            else:
                valid = cols[None, :] >= lo_row[:, None]
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every score is
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if BOUNDED:
            v = tl.load(v_ptr, mask=col_ok[:, None] & v_ok[None, :], other=0.0)
        elif EVEN_DV:
            v = tl.load(v_ptr)
        else:
            v = tl.load(v_ptr, mask=v_ok[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        else:
            p = p.to(v_base.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        return m_new, l_i, acc

    @triton.jit
    def tree_attn_fwd(
        Q, K, V, OUT, PART, ML, PAST, START, BITS, DEPTH, SINKS,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
        num_words, qk_scale, cap, M, G, HKV, WINDOW, CHUNK, S,
        D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        split = tl.program_id(2)
        b = (pid_bh // HKV).to(tl.int64)  # 64-bit offsets: a batch of long caches passes 2**31 values
        kvh = (pid_bh % HKV).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (query head in group, node)
        row_ok = rows < G * M
        node = rows % M
        head = kvh * G + rows // M
        dofs = tl.arange(0, BLOCK_D)
        d_ok = dofs < D
        vofs = tl.arange(0, BLOCK_DV)  # the values' head dim: the keys' or narrower (latent attention)
        v_ok = vofs < DV
        q = tl.load(
            Q + b * sqb + head[:, None] * sqh + node[:, None] * sqm + dofs[None, :] * sqd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_D)
        if UPCAST:
            q = q.to(tl.float32)
        past = tl.load(PAST + b)
        start = tl.load(START + b)
        depth = tl.load(DEPTH + node, mask=row_ok, other=0)  # (BLOCK_M,)
        lo = start
        lo_row = start + tl.zeros([BLOCK_M], dtype=tl.int32)
        if HAS_WINDOW:
            # Query i (position past + depth_i) sees key column j iff past + depth_i - j < WINDOW.
            lo = tl.maximum(start, past - WINDOW + 1)
            lo_row = tl.maximum(lo_row, past + depth - WINDOW + 1)
        if HAS_CHUNK:
            # Query i sees key column j iff both positions (columns less start) lie in one chunk: from
            # the first column of its chunk on. The root (depth 0) has the lowest.
            pos0 = past - start
            lo = tl.maximum(lo, start + pos0 - pos0 % CHUNK)
            pos = pos0 + depth  # (BLOCK_M,)
            lo_row = tl.maximum(lo_row, start + pos - pos % CHUNK)
        span = tl.maximum(past - lo, 0)
        share = tl.cdiv(tl.cdiv(span, S), BLOCK_N) * BLOCK_N  # each split's columns, whole tiles
        c_lo = lo + split * share
        c_hi = tl.minimum(c_lo + share, past)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        k_base = K + b * skb + kvh * skh
        v_base = V + b * svb + kvh * svh
        # 1. The past: fully visible, no mask read. Whole tiles without bounds checks (nor head-dim
        #    masks when D is a power of two), then the last, partial tile with them.
        n_full = c_lo + tl.maximum(c_hi - c_lo, 0) // BLOCK_N * BLOCK_N
        for n0 in range(c_lo, n_full, BLOCK_N):
            m_i, l_i, acc = _past_tile(
                q, k_base, v_base, n0, c_hi, lo_row, m_i, l_i, acc, dofs, d_ok, vofs, v_ok, skn, skd, svn,
                svd, qk_scale, cap, BLOCK_N, HAS_WINDOW or HAS_CHUNK, False, D == BLOCK_D, DV == BLOCK_DV,
                DOT_PREC, UPCAST, HAS_SOFTCAP,
            )  # fmt: skip
        if n_full < c_hi:
            m_i, l_i, acc = _past_tile(
                q, k_base, v_base, n_full, c_hi, lo_row, m_i, l_i, acc, dofs, d_ok, vofs, v_ok, skn, skd, svn,
                svd, qk_scale, cap, BLOCK_N, HAS_WINDOW or HAS_CHUNK, True, D == BLOCK_D, DV == BLOCK_DV,
                DOT_PREC, UPCAST, HAS_SOFTCAP,
            )  # fmt: skip
        # 2. The tree: M columns from past, masked by the ancestor bits (last split only). A node's
        #    ancestors precede it, so the block's rows see no node after its last one: a block of one
        #    head's nodes [n, n + BLOCK_M) reads the first n + BLOCK_M columns of the tree only.
        if split == S - 1:
            row0 = pid_m * BLOCK_M
            last_row = tl.minimum(row0 + BLOCK_M, G * M) - 1
            tree_hi = tl.where(row0 // M == last_row // M, last_row % M + 1, M)
            for t0 in range(0, tree_hi, BLOCK_N):
                nodes = t0 + tl.arange(0, BLOCK_N)
                n_ok = nodes < M
                cols = past + nodes
                k = tl.load(
                    k_base + cols[None, :] * skn + dofs[:, None] * skd,
                    mask=n_ok[None, :] & d_ok[:, None],
                    other=0.0,
                )  # (BLOCK_D, BLOCK_N)
                if UPCAST:
                    k = k.to(tl.float32)
                s = _scores(q, k, qk_scale, cap, DOT_PREC, HAS_SOFTCAP)
                if BLOCK_N <= 64:
                    # The tile's columns lie in one 64-bit word of each row's bits (t0 is a multiple
                    # of BLOCK_N, which divides 64): one load per row, not one per score.
                    word = tl.load(BITS + node * num_words + t0 // 64, mask=row_ok, other=0)  # (BLOCK_M,)
                    bit = (word[:, None] >> (nodes[None, :] % 64).to(tl.int64)) & 1
                else:
                    words = tl.load(
                        BITS + node[:, None] * num_words + nodes[None, :] // 64,
                        mask=row_ok[:, None] & n_ok[None, :],
                        other=0,
                    )  # (BLOCK_M, BLOCK_N) int64
                    bit = (words >> (nodes[None, :] % 64).to(tl.int64)) & 1
                seen = bit != 0
                if HAS_CHUNK:  # an ancestor in an earlier chunk than the node's (column past + its depth)
                    node_depth = tl.load(DEPTH + nodes, mask=n_ok, other=0)  # (BLOCK_N,)
                    seen = seen & ((past + node_depth)[None, :] >= lo_row[:, None])
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_use)
                p = tl.exp2(s - m_use[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(
                    v_base + cols[:, None] * svn + vofs[None, :] * svd,
                    mask=n_ok[:, None] & v_ok[None, :],
                    other=0.0,
                )  # (BLOCK_N, BLOCK_DV)
                if UPCAST:
                    v = v.to(tl.float32)
                else:
                    p = p.to(V.dtype.element_ty)
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
                m_i = m_new
        if SPLIT:
            r_base = (pid_bh * S + split) * (G * M) + rows  # (BLOCK_M,) rows of the scratch
            tl.store(
                PART + r_base[:, None] * BLOCK_DV + vofs[None, :], acc, mask=row_ok[:, None] & v_ok[None, :]
            )
            tl.store(ML + r_base * 2, m_i, mask=row_ok)
            tl.store(ML + r_base * 2 + 1, l_i, mask=row_ok)
        else:
            if HAS_SINKS:  # the sink's logit (natural units) joins the row's max and sum
                sink = tl.load(SINKS + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
                m_fin = tl.maximum(m_i, sink)
                alpha = tl.exp2(m_i - m_fin)
                l_i = l_i * alpha + tl.exp2(sink - m_fin)
                acc = acc * alpha[:, None]
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # 0 only in padding rows
            tl.store(
                OUT + b * sob + head[:, None] * soh + node[:, None] * som + vofs[None, :] * sod,
                out.to(OUT.dtype.element_ty),
                mask=row_ok[:, None] & v_ok[None, :],
            )

    @triton.jit
    def tree_attn_combine(  # D, BLOCK_D: the values' head dim
        OUT, PART, ML, SINKS, sob, soh, som, sod, M, G, HKV, S,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // HKV).to(tl.int64)
        kvh = (pid_bh % HKV).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < G * M
        node = rows % M
        head = kvh * G + rows // M
        dofs = tl.arange(0, BLOCK_D)
        d_ok = dofs < D
        m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for s in range(0, S):
            r = (pid_bh * S + s) * (G * M) + rows
            m_all = tl.maximum(m_all, tl.load(ML + r * 2, mask=row_ok, other=float("-inf")))
        if HAS_SINKS:  # the sink's logit (natural units) joins the row's max and sum
            sink = tl.load(SINKS + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_all = tl.maximum(m_all, sink)
        m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
        l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_SINKS:
            l_all = tl.exp2(sink - m_use)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for s in range(0, S):
            r = (pid_bh * S + s) * (G * M) + rows
            w = tl.exp2(tl.load(ML + r * 2, mask=row_ok, other=float("-inf")) - m_use)  # (BLOCK_M,)
            l_all += w * tl.load(ML + r * 2 + 1, mask=row_ok, other=0.0)
            part = tl.load(  # columns past D were never written
                PART + r[:, None] * BLOCK_D + dofs[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
            )
            acc += w[:, None] * part
        out = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]  # 0 only in padding rows
        tl.store(
            OUT + b * sob + head[:, None] * soh + node[:, None] * som + dofs[None, :] * sod,
            out.to(OUT.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )

    return tree_attn_fwd, tree_attn_combine


@functools.cache
def num_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def kv_splits(programs: int, past_width: int, device: torch.device) -> int:
    """KV splits so that about two waves of programs fill the GPU; 1 where there is little past."""
    if device.type != "cuda" or past_width < 1024:
        return 1
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(math.ceil(2 * sms / programs), past_width // 512, 64))


class LaunchConfig(NamedTuple):
    """How the forward kernel is launched: query rows and keys per tile, warps, pipeline stages (a
    named tuple: ``torch.compile`` traces it as plain values)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}/w{self.num_warps}/s{self.num_stages}"


def default_config(rows: int, block_d: int, dtype: torch.dtype, device_type: str) -> LaunchConfig:
    """The untuned configuration for ``rows = g * M`` packed query rows of head dim ``block_d``.

    On CUDA: 64-row programs (one warpgroup's tensor-core tile) of 64 keys, 3 pipeline stages (2 in
    fp32, whose tiles are twice the size). In the interpreter, whose cost is per operation: few large
    tiles."""
    if device_type != "cuda":
        return LaunchConfig(min(256, max(16, triton_next_pow2(rows))), 128, 4, 1)
    block_m = 64 if rows > 32 else max(16, triton_next_pow2(rows))
    block_n = 64 if block_d <= 128 else 32
    return LaunchConfig(block_m, block_n, 4, 2 if dtype == torch.float32 else 3)


def candidate_configs(rows: int, block_d: int, dtype: torch.dtype) -> list[LaunchConfig]:
    """The CUDA configurations the tuner times, the default first.

    Larger query tiles (128 rows, 8 warps) read each K/V tile once for twice the rows, which matters
    when many programs share one KV head (256-node trees: 16 programs of 64 rows per KV head at a GQA
    group of 4); fewer stages leave shared memory for them (an earlier 128-row variant with 3 stages
    asked for 256 KiB, over an H100's 227 KiB). A configuration that does not fit the device fails to
    compile and is skipped. Tiles never have more rows than the call (``rows`` rounded up to a power of two)."""
    first = default_config(rows, block_d, dtype, "cuda")
    max_rows = max(16, triton_next_pow2(rows))
    if dtype == torch.float32:
        shapes = [(64, 32, 4, 2), (32, 64, 4, 2), (128, 32, 8, 2)]
    elif block_d > 128:
        shapes = [(64, 32, 4, 2), (128, 32, 8, 2), (32, 32, 4, 3)]
    else:
        shapes = [(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)]
        shapes += [(32, 64, 4, 3), (16, 64, 4, 3)]
    out = [first]
    for bm, bn, warps, stages in shapes:
        bm = min(bm, max_rows)
        config = LaunchConfig(bm, bn, warps if bm >= 64 else 4, stages)  # 8 warps want 64+ rows
        if config not in out:
            out.append(config)
    return out


_TUNED: dict[tuple, LaunchConfig] = {}


def tuned_configs() -> dict[tuple, LaunchConfig]:
    """The configurations tuned so far in this process, by :func:`tuning_key` (a copy)."""
    return dict(_TUNED)


def tuning_key(
    query: torch.Tensor,
    key: torch.Tensor,
    splits: int,
    window: int | None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    value_dim: int | None = None,
    softcap: float | None = None,
) -> tuple:
    """The shape class a tuned configuration is kept for: device, dtype, head dims (the values' where
    they differ), GQA group, tree nodes, batch, KV splits, sliding window, chunks, sinks and softcapping
    or not, and the past's width rounded up to a power of two (an eager decoder's growing cache re-tunes
    a few times per generation, not every step)."""
    bsz, hq, m, d = query.shape
    hkv = key.shape[1]
    width = max(1, key.shape[2] - m)
    kinds = (window is not None, chunk is not None, sinks is not None, softcap is not None)
    dims = d if value_dim in (None, d) else (d, value_dim)
    shape = (dims, hq // hkv, m, bsz, splits, *kinds, width.bit_length())
    return (str(query.device), query.dtype, *shape)


def tuning_enabled() -> bool:
    """Whether CUDA calls time the candidate configurations (``MEDUSA_TRITON_TUNE`` is not ``0``)."""
    return os.environ.get("MEDUSA_TRITON_TUNE", "1") != "0"


TUNE_SLEEP_CYCLES = 2_000_000
"""GPU clock cycles (about 1 ms) the tuner's timed calls wait behind, so that the host has queued them
all before the first one runs and only GPU time is measured."""
TUNE_ROUNDS = 3
"""Rounds over all candidates; each candidate keeps its fastest round."""


def gpu_ms(
    fn: Callable[[], object], reps: int = 10, warmup: int = 1, sleep_cycles: int = TUNE_SLEEP_CYCLES
) -> float:
    """Milliseconds of GPU time per ``fn()`` on the current CUDA stream: ``warmup`` untimed calls
    (compilation), then ``reps`` calls queued behind a sleep kernel of ``sleep_cycles``, between two
    events (the bench scripts' timing too, with a longer sleep for more calls).

    Without the sleep the calls of a small tree (tens of microseconds on the GPU) are timed at the rate
    the host launches them, the same for every configuration: on one H100 the tuner then kept
    configurations that took up to 1.5x the default's GPU time (docs/benchmarks.md). GPU time is what a
    replayed CUDA graph pays, and the launch costs every configuration alike in an eager decoder."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(sleep_cycles)  # the host queues every call below while the GPU sleeps
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def fastest(
    candidates: list[LaunchConfig],
    launch: Callable[[LaunchConfig], object],
    measure: Callable[[Callable[[], object]], float],
    rounds: int = TUNE_ROUNDS,
) -> tuple[LaunchConfig, dict[LaunchConfig, float]]:
    """The candidate with the smallest ``measure(lambda: launch(config))``, and every time measured
    (each candidate's least over ``rounds`` rounds over all of them, so that a burst of noise in one
    round decides nothing). A candidate that raises (out of shared memory, too many registers) is
    skipped from then on; if all of them do, the first one's error propagates."""
    times: dict[LaunchConfig, float] = {}
    first_error: Exception | None = None
    for round_ in range(rounds):
        for config in candidates if round_ == 0 else list(times):
            try:
                t = measure(lambda config=config: launch(config))
            except Exception as err:  # noqa: BLE001 - a configuration this device cannot run
                log.debug("tree attention config %s skipped: %s", config, err)
                first_error = first_error or err
                times.pop(config, None)
                continue
            times[config] = min(t, times.get(config, math.inf))
        if not times:
            assert first_error is not None
            raise first_error
    return min(times, key=times.__getitem__), times


_FROZEN = [False]  # inside tuning_frozen()


@contextlib.contextmanager
def tuning_frozen() -> Iterator[None]:
    """Inside this block nothing is tuned: a shape class not tuned before takes the default
    configuration (not kept). For timed regions (stage=eval's timed calls): tuning a new shape class
    there would time the tuner, not the decoding."""
    saved, _FROZEN[0] = _FROZEN[0], True
    try:
        yield
    finally:
        _FROZEN[0] = saved


def select_config(
    key: tuple, candidates: list[LaunchConfig], launch: Callable[[LaunchConfig], object], device: torch.device
) -> LaunchConfig:
    """The configuration for shape class ``key``: the one tuned before, else the fastest candidate
    (timed now with :func:`gpu_ms`, and kept), else, inside a capture or a trace, with tuning off or
    inside :func:`tuning_frozen`, the first candidate (the default)."""
    if key in _TUNED:
        return _TUNED[key]
    if _capturing_or_tracing(device) or not tuning_enabled() or _FROZEN[0]:
        return candidates[0]
    config, times = fastest(candidates, launch, gpu_ms)
    _TUNED[key] = config
    default = candidates[0]
    base = f"{times[default]:.4f} ms" if default in times else "failed"
    log.info("tree attention %s: %s (%.4f ms; default %s %s)", key, config, times[config], default, base)
    return config


def _capturing_or_tracing(device: torch.device) -> bool:
    if torch.compiler.is_compiling():
        return True
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def triton_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_lens: torch.Tensor,
    starts: torch.Tensor,
    bits: torch.Tensor,
    depth: torch.Tensor,
    scale: float,
    window: int | None = None,
    num_splits: int | None = None,
    config: LaunchConfig | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Tree attention with the Triton kernel (see the module docstring and
    :func:`medusa_train.decoding.attention.tree_attention` for the contract).

    Args:
        query: ``(B, Hq, M, D)``; any strides.
        key, value: ``(B, Hkv, W, D)``; any strides; ``Hq % Hkv == 0``.
        past_lens: ``(B,)`` int32, row b's tree sits at columns ``[past_b, past_b + M)``.
        starts: ``(B,)`` int32, row b's first visible column (its left padding before it).
        bits: ``(M, ceil(M / 64))`` int64 ancestor bitmasks (node i sees only nodes j <= i).
        depth: ``(M,)`` int32 node depths.
        scale: softmax scale of the scores.
        window: sliding window (query sees a key iff their positions differ by less), None for none.
            ``bits`` must have it applied (:meth:`~medusa_train.decoding.attention.TreeMask.bits_for`).
        num_splits: KV splits (None: chosen from the shape and the device).
        config: launch configuration (None: tuned on CUDA, see the module docstring; the default in
            the interpreter).
        chunk: chunk size (a query sees a key iff their positions, counted from the row's first
            visible column, lie in one chunk of ``chunk``), None for none.
        sinks: ``(Hq,)`` attention sinks: each query head's logit (unscaled) of a key without a value
            that joins its softmax; None for none.
        softcap: each scaled score ``x`` becomes ``softcap * tanh(x / softcap)`` (Gemma 2); None for
            none.

    Returns:
        ``(B, Hq, M, Dv)`` in the query's dtype, a transposed view of a contiguous ``(B, M, Hq, Dv)``
        (``Dv``: the values' head dim, the keys' ``D`` or another: multi-head latent attention's).
    """
    fwd, combine = _kernels()
    bsz, hq, m, d = query.shape
    hkv, dv = key.shape[1], value.shape[-1]
    g = hq // hkv
    out = torch.empty(bsz, m, hq, dv, dtype=query.dtype, device=query.device)  # (B, M, Hq, Dv)
    out = out.transpose(1, 2)  # (B, Hq, M, Dv)
    block_d = max(16, triton_next_pow2(d))
    block_dv = max(16, triton_next_pow2(dv))
    device_type = query.device.type
    default = default_config(g * m, block_d, query.dtype, device_type)
    past_width = key.shape[2] - m
    # The split count follows the default tiling, so every candidate configuration splits alike.
    programs = math.ceil(g * m / default.block_m) * bsz * hkv
    splits = num_splits or kv_splits(programs, past_width, query.device)
    prec = "ieee" if query.dtype == torch.float32 else "tf32"
    # triton's CPU interpreter multiplies bf16 matrices wrongly: it gets them as fp32 there.
    upcast = query.dtype == torch.bfloat16 and device_type != "cuda"
    if splits > 1:
        part = torch.empty(bsz * hkv * splits * g * m, block_dv, dtype=torch.float32, device=query.device)
        ml = torch.empty(bsz * hkv * splits * g * m, 2, dtype=torch.float32, device=query.device)
    else:
        part = ml = out  # unused
    sink_arg = depth if sinks is None else sinks.contiguous()  # (Hq,); depth: a pointer never read

    def launch(cfg: LaunchConfig) -> None:
        fwd[(math.ceil(g * m / cfg.block_m), bsz * hkv, splits)](
            query, key, value, out, part, ml, past_lens, starts, bits, depth, sink_arg,
            *query.stride(), *key.stride(), *value.stride(), *out.stride(),
            bits.shape[1], scale * math.log2(math.e), (softcap or 1.0) * math.log2(math.e), m, g, hkv,
            window or 0, chunk or 1, splits,
            D=d, BLOCK_D=block_d, DV=dv, BLOCK_DV=block_dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            HAS_WINDOW=window is not None, HAS_CHUNK=chunk is not None, HAS_SINKS=sinks is not None,
            HAS_SOFTCAP=softcap is not None, SPLIT=splits > 1, DOT_PREC=prec, UPCAST=upcast,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        if splits > 1:
            combine[(math.ceil(g * m / default.block_m), bsz * hkv)](
                out, part, ml, sink_arg, *out.stride(), m, g, hkv, splits,
                D=dv, BLOCK_D=block_dv, BLOCK_M=default.block_m, HAS_SINKS=sinks is not None,
            )  # fmt: skip

    # triton launches (and the tuner times) on the current CUDA device: make it the tensors'.
    with torch.cuda.device(query.device) if device_type == "cuda" else contextlib.nullcontext():
        if config is None:
            config = default
            if device_type == "cuda" and not torch.compiler.is_compiling():
                key_ = tuning_key(query, key, splits, window, chunk, sinks, dv, softcap)
                config = _TUNED.get(key_) or select_config(  # the candidates only for a new shape class
                    key_, candidate_configs(g * m, block_d, query.dtype), launch, query.device
                )
        launch(config)
    return out


def triton_next_pow2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, (n - 1).bit_length())
