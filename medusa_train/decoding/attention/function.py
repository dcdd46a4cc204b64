"""The tree-attention function the package's docstring describes: :func:`tree_attention` (one of the
three implementations on the compact tree description), the description itself (:class:`TreeMask`,
:func:`pack_bits`) and a kernel's call as one custom op for ``torch.compile`` (:func:`kernel_op`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..tree import TreeBuffers
from .cuda_kernel import cuda_tree_attention
from .sdpa import sdpa_tree_attention, unpack_bits
from .triton_kernel import triton_tree_attention


@dataclass(eq=False)
class TreeMask:
    """The compact tree description the kernels read.

    Attributes:
        bits: ``(M, ceil(M / 64))`` int64: bit ``j % 64`` of word ``j // 64`` of row i is set iff node i
            attends node j (j is i or one of its ancestors).
        depth: ``(M,)`` int32 depth of each node (its position is the row's past length + depth).
    """

    bits: torch.Tensor
    depth: torch.Tensor
    _prefixes: dict[int, TreeMask] = field(default_factory=dict, repr=False)
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, tree: TreeBuffers) -> TreeMask:
        """The tree's mask, on the tree's device (built once and kept on the tree)."""
        built = tree.__dict__.get("_tree_mask")
        if built is None:
            built = cls(bits=pack_bits(tree.attn_mask), depth=tree.depth.to(torch.int32).contiguous())
            tree.__dict__["_tree_mask"] = built
        return built

    @property
    def num_nodes(self) -> int:
        return self.depth.shape[0]

    def prefix(self, m: int) -> TreeMask:
        """The first m nodes (nodes are sorted by depth, so a node's ancestors precede it)."""
        if m == self.num_nodes:
            return self
        if m not in self._prefixes:
            words = math.ceil(m / 64)
            self._prefixes[m] = TreeMask(self.bits[:m, :words].contiguous(), self.depth[:m].contiguous())
        return self._prefixes[m]

    def bits_for(self, window: int | None) -> torch.Tensor:
        """The bits with a sliding window applied: node j stays visible to node i iff
        ``depth_i - depth_j < window``."""
        if window is None or window >= self.num_nodes:
            return self.bits
        if window not in self._windowed:
            allowed = unpack_bits(self.bits, self.num_nodes)
            near = (self.depth[:, None] - self.depth[None, :]) < window  # (M, M)
            self._windowed[window] = pack_bits(allowed & near)
        return self._windowed[window]


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """``(M, M)`` bool -> ``(M, ceil(M / 64))`` int64 bitmasks (bit ``j % 64`` of word ``j // 64``)."""
    m = allowed.shape[0]
    words = math.ceil(m / 64)
    padded = torch.zeros(m, words * 64, dtype=torch.long, device=allowed.device)
    padded[:, :m] = allowed.long()
    weights = torch.ones(64, dtype=torch.long, device=allowed.device) << torch.arange(
        64, device=allowed.device
    )
    return (padded.view(m, words, 64) * weights).sum(-1).contiguous()  # (M, words); bit 63 is the sign


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_lens: torch.Tensor,
    starts: torch.Tensor,
    mask: TreeMask,
    *,
    scale: float | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Attention of M tree nodes per row over the row's past and the tree (see the module docstring).

    Args:
        query: ``(B, Hq, M, D)``.
        key, value: ``(B, Hkv, W, D)`` and ``(B, Hkv, W, Dv)`` with ``W >= past_b + M`` for every row;
            ``Hq % Hkv == 0``.
        past_lens: ``(B,)`` integer, the column of each row's first tree node.
        starts: ``(B,)`` integer, each row's first visible column (0 without left padding).
        mask: the tree (``mask.num_nodes == M``).
        scale: score scale; None: ``1 / sqrt(D)``.
        window: sliding window of the layer (a query sees a key iff their positions differ by less
            than ``window``); None: none.
        chunk: chunk size of the layer (a query sees a key iff their positions, counted from the row's
            first visible column, lie in one chunk of ``chunk``: Llama 4's chunked layers); None: none.
            The CUDA kernel takes none.
        sinks: ``(Hq,)`` attention sinks (gpt-oss's): each query head's logit, unscaled, of a key with
            no value that joins its softmax; None: none. The CUDA kernel takes none.
        softcap: each scaled score ``x`` becomes ``softcap * tanh(x / softcap)`` (Gemma 2's
            ``attn_logit_softcapping``); None: none. The CUDA kernel takes none.
        backend: "sdpa", "triton" or "cuda".

    Returns:
        ``(B, Hq, M, Dv)`` in the query's dtype: ``Dv`` the values' head dim (the keys' ``D``, or, in
        multi-head latent attention, narrower: DeepSeek-V3's 128 against 192; not the CUDA kernel's).
    """
    m, d = query.shape[2:]
    if (
        mask.num_nodes != m
        or query.shape[1] % key.shape[1]
        or key.shape[2] < m
        or key.shape[-1] != d
        or value.shape[:3] != key.shape[:3]
    ):
        raise ValueError(
            f"tree attention got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
            f"{tuple(value.shape)} and a tree of {mask.num_nodes} nodes: need M tree nodes, Hq a multiple "
            "of Hkv, W >= M, one head dim D for queries and keys, values as many as the keys"
        )
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    bits = mask.bits_for(window)
    args = (query, key, value, past_lens.to(torch.int32), starts.to(torch.int32), bits, mask.depth, scale)
    if backend in ("triton", "cuda") and torch.compiler.is_compiling():
        return kernel_op(*args, window, chunk, sinks, softcap, backend)
    kinds = dict(window=window, chunk=chunk, sinks=sinks, softcap=softcap)
    if backend == "triton":
        return triton_tree_attention(*args, **kinds)
    if backend == "cuda":
        return cuda_tree_attention(*args, **kinds)
    if backend == "sdpa":
        return sdpa_tree_attention(*args, **kinds)
    raise ValueError(f"backend must be sdpa, triton or cuda, got {backend!r}")


@torch.library.custom_op("medusa_train::tree_attention", mutates_args=())
def kernel_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_lens: torch.Tensor,
    starts: torch.Tensor,
    bits: torch.Tensor,
    depth: torch.Tensor,
    scale: float,
    window: int | None,
    chunk: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
    backend: str,
) -> torch.Tensor:
    """A kernel's call as one custom op (``torch.ops.medusa_train.tree_attention``), for
    ``torch.compile``: the compiler keeps it whole, and the launcher (tuning, KV splits) runs as in
    eager mode. Arguments as :func:`~.triton_kernel.triton_tree_attention`; ``backend``: "triton" or
    "cuda". Eager callers call the kernels directly (a custom op costs a dispatch per call)."""
    kernel = triton_tree_attention if backend == "triton" else cuda_tree_attention
    kinds = dict(window=window, chunk=chunk, sinks=sinks, softcap=softcap)
    return kernel(query, key, value, past_lens, starts, bits, depth, scale, **kinds)


@kernel_op.register_fake
def _kernel_op_shape(
    query, key, value, past_lens, starts, bits, depth, scale, window, chunk, sinks, softcap, backend
):
    bsz, hq, m, _ = query.shape
    return query.new_empty(bsz, m, hq, value.shape[-1]).transpose(1, 2)  # the kernels' (B, M, Hq, Dv)
