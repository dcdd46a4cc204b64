"""Medusa tree decoding for a batch of prompts: every row verifies its own tree in one shared forward.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774), applied per row of a batch. The Medusa reference code asserts batch size 1;
here each row of a batch keeps its own accepted length, so rows drift apart in the KV cache and
the decoder tracks one cache length per row.

Layout. The prompts are left-padded to a common length and prefilled in one forward with a 4-D float
mask (causal, padding columns masked) and per-row position ids. After that, row b's cache holds its
tokens in columns ``[pad_b, L_b)`` of a :class:`RowKVCache`, a cache preallocated once for the whole
call (``(B, H, capacity, D)`` per layer). Each step writes row b's M tree nodes at columns
``[L_b, L_b + M)`` (one indexed write per layer, no concatenation), attends through a mask whose row b
is the batch-1 tree mask shifted to ``L_b`` (a gather from one right-aligned buffer) with padding
columns masked, and then moves the KV entries of row b's accepted path to ``[L_b, L_b + n_b)``
(one indexed gather/scatter per layer for all rows; entries already in place are not copied) and
advances ``L_b`` by n_b. Entries beyond ``L_b`` are stale and masked. A row that finishes (EOS,
budget, context limit) leaves the batch: the remaining rows are moved down in place and later
forwards run only on them.

Per row, every rule sees exactly what batch-1 :func:`~medusa_train.decoding.medusa_generate` sees:
the same sub-tree near the end of its budget, the same acceptance call on its own ``(m, V)`` logits,
and under ``sample`` its own generator consumed in the same order (first token, then one draw per
node of each step), so a row's tokens do not depend on its batch mates. Greedy output equals each
row's plain greedy ``generate`` up to float rounding of the batched forward (see docs/decoding.md).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from .. import hf_compat
from ..heads import MedusaHeads
from ..hf_compat import NoKVLayer
from .acceptance import (
    accept_sample,
    accept_typical,
    argmax_list,
    first_token,
    walk_matches,
)
from .attention import (
    TreeMask,
    TreeStep,
    attention_chunk,
    layer_positions,
    model_window,
    one_call_per_model,
    resolve_attention,
    sliding_window_kinds,
    tree_step,
)
from .generate import (
    MedusaOutput,
    PackedHeads,
    SpanTimer,
    _check_generators,
    _check_settings,
    _forward,
    _mask_slab,
    _now,
    check_cache_positions,
    check_tree_fits,
    context_limit,
    dynamic_entries,
    eos_ids,
    medusa_generate,
)
from .processors import RowProcessors
from .tree import TreeBuffers, as_tree


class PreallocatedLayer(CacheLayerMixin):
    """One layer of a preallocated cache (:class:`RowKVCache`, ``StaticKVCache``): ``(B, H, C, D)``
    keys and ``(B, H, C, Dv)`` values (``Dv``: the width its first update's values have) allocated on
    its first update.

    Every layer whose shape and dtype match the first layer's is a view of one ``(L, 2, B, H, C, D)``
    tensor, the owner's ``storage``, so moving entries or rows is one indexed read and write for the
    whole model instead of two per layer (:func:`shared_storage`): 0.42 against 1.44 ms per compaction
    at the 8B shape (32 layers, 2,112 columns, 5 entries, fp32; 2-core AMD EPYC, 2026-11-27); on a GPU
    one gather and one scatter in place of four per layer (not timed there).
    A layer of another shape keeps tensors of its own, and so does every layer where the first layer's
    keys and values differ in shape (multi-head latent attention caches a latent and a rotary key of
    different widths). The owner has ``kv_layers`` (its layers of this class,
    :func:`preallocated_layers`), ``capacity``, ``shared`` (False: every layer its own tensors) and
    ``storage``; ``index`` is the layer's place among ``kv_layers``.
    """

    is_sliding = False

    def __init__(self, owner: Cache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.in_storage = False  # keys and values are views of the owner's storage

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        o = self.owner
        b, h, _, d = key_states.shape
        shape = (self.rows(b), h, o.capacity, d)  # (B, H, C, D)
        same_kv = value_states.shape == key_states.shape and value_states.dtype == key_states.dtype
        if o.shared and o.storage is None and self.index == 0 and same_kv:
            o.storage = key_states.new_zeros(len(o.kv_layers), 2, *shape)  # (L, 2, B, H, C, D)
        s = o.storage
        fits = s is not None and same_kv and s.shape[2:] == shape
        if fits and s.dtype == key_states.dtype and s.device == key_states.device:
            self.keys, self.values = s[self.index, 0], s[self.index, 1]
            self.in_storage = True
        else:  # another shape or dtype than the first layer's: tensors of its own
            self.keys = key_states.new_zeros(shape)
            self.values = value_states.new_zeros(*shape[:3], value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def rows(self, batch: int) -> int:
        """Rows to allocate for a first update of ``batch`` rows."""
        return batch


def preallocated_layers(
    owner: Cache, layer_class: type[PreallocatedLayer], num_layers: int, reusing: Collection[int]
) -> list[PreallocatedLayer | NoKVLayer]:
    """The ``num_layers`` layers of a preallocated cache: ``layer_class`` for a layer with KV of its own,
    a ``NoKVLayer`` (transformers' ``DummyLayer``: no KV, never written) for one in ``reusing``
    (:func:`kv_reusing_layers`).
    ``owner.kv_layers`` are then the former: what moving entries or rows moves, and what ``storage``
    holds."""
    layers: list[PreallocatedLayer | NoKVLayer] = []
    owner.kv_layers = []
    for i in range(num_layers):
        if i in reusing:
            layers.append(NoKVLayer())
        else:
            owner.kv_layers.append(layer_class(owner, len(owner.kv_layers)))
            layers.append(owner.kv_layers[-1])
    return layers


def row_entries(
    cache: Cache, row: int, columns: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Row ``row``'s KV entries at ``columns`` ``(n,)`` of a preallocated cache (:class:`RowKVCache`,
    ``StaticKVCache``): per layer of the cache ``(H, n, D)`` keys and ``(H, n, Dv)`` values, copies (the
    cache is written again), or None for a layer that keeps none (:func:`preallocated_layers`)."""
    own = {id(layer) for layer in cache.kv_layers}
    return [
        (layer.keys[row, :, columns], layer.values[row, :, columns]) if id(layer) in own else None
        for layer in cache.layers
    ]


def shared_storage(cache: Cache) -> torch.Tensor | None:
    """The cache's ``(L, 2, B, H, C, D)`` storage if every layer with KV lives in it, else None."""
    if cache.storage is None or not all(layer.in_storage for layer in cache.kv_layers):
        return None
    return cache.storage


class _RowLayer(PreallocatedLayer):
    """One layer of a :class:`RowKVCache`: written where the cache says."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new entries (prefill: columns ``[0, T)``; a step: the owner's per-row columns)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        n = key_states.shape[0]  # active rows
        if o.write_cols is None:
            t = key_states.shape[2]
            self.keys[:n, :, :t] = key_states
            self.values[:n, :, :t] = value_states
        else:
            # (n, M, H, D) through advanced indexing on rows and columns at once.
            self.keys[o.row_index, :, o.write_cols] = key_states.transpose(1, 2)
            self.values[o.row_index, :, o.write_cols] = value_states.transpose(1, 2)
        return self.keys[:n, :, : o.width], self.values[:n, :, : o.width]  # (n, H, W, D) views

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return self.owner.capacity


class RowKVCache(Cache):
    """A KV cache with one length per row, allocated once (``(B, H, capacity, D)`` per layer).

    The decoder sets, before each forward, ``width`` (columns the attention reads), and for a tree
    step ``write_cols`` ``(n, M)`` (the columns each active row's new entries go to) and
    ``row_index`` ``(n, 1)``; ``write_cols=None`` writes columns ``[0, T)`` (the prefill). Only the
    first n rows (the active ones) are read and written; :meth:`keep_rows` moves rows down.

    Args:
        num_layers: attention layers of the model.
        capacity: columns per row (longest padded prompt + largest budget + tree nodes).
        shared: every layer's keys and values in one tensor when their shapes agree
            (:class:`PreallocatedLayer`).
        reusing: layers that read an earlier layer's KV and keep none (:func:`kv_reusing_layers`).
    """

    def __init__(
        self, num_layers: int, capacity: int, shared: bool = True, reusing: Collection[int] = ()
    ) -> None:
        super().__init__(layers=preallocated_layers(self, _RowLayer, num_layers, reusing))
        self.capacity = capacity
        self.shared = shared
        self.storage: torch.Tensor | None = None  # (L, 2, B, H, C, D): see PreallocatedLayer
        self.width = 0
        self.write_cols: torch.Tensor | None = None
        self.row_index: torch.Tensor | None = None

    def move_entries(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """For each i: entry ``(rows[i], src[i])`` is copied to ``(rows[i], dst[i])`` in every layer.

        All sources are read before any destination is written.
        """
        kv = shared_storage(self)
        if kv is not None:
            kv[:, :, rows, :, dst] = kv[:, :, rows, :, src]  # (N, L, 2, H, D)
            return
        for layer in self.kv_layers:
            layer.keys[rows, :, dst] = layer.keys[rows, :, src]  # (N, H, D)
            layer.values[rows, :, dst] = layer.values[rows, :, src]

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Rows ``keep`` (ascending slot indices) become rows ``0 .. len(keep) - 1``, in place."""
        n = keep.numel()
        kv = shared_storage(self)
        if kv is not None:  # a layer at a time: the gather's copy is one layer's, not the whole cache's
            for layer_kv in kv:  # (2, B, H, C, D)
                layer_kv[:, :n] = layer_kv.index_select(1, keep)
            return
        for layer in self.kv_layers:
            layer.keys[:n] = layer.keys.index_select(0, keep)
            layer.values[:n] = layer.values.index_select(0, keep)


@dataclass
class MedusaBatchOutput:
    """What :func:`medusa_generate_batch` produced.

    Attributes:
        rows: one :class:`MedusaOutput` per prompt, in the prompts' order (``tokens``,
            ``accepted_lengths``, ``stop_reason``; ``num_forwards`` counts the forwards the row took
            part in; the timing fields of the rows are 0: the batch shares its forwards).
        num_forwards: batched verification forwards (the prefill is not counted).
        prefill_s: seconds in the batched prefill forward (and the first roots' choice).
        forward_s: seconds in the verification forwards (the model calls only).
        total_s: wall-clock seconds of the whole call.
    """

    rows: list[MedusaOutput] = field(default_factory=list)
    num_forwards: int = 0
    prefill_s: float = 0.0
    forward_s: float = 0.0
    total_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        """New tokens over all rows."""
        return sum(len(r.tokens) for r in self.rows)

    @property
    def tau(self) -> float:
        """Mean tokens per row-step over all rows (plain decoding = 1.0)."""
        return self.num_tokens / max(1, sum(r.num_steps for r in self.rows))

    @property
    def overhead_s(self) -> float:
        """Seconds outside the prefill and the verification forwards."""
        return max(0.0, self.total_s - self.prefill_s - self.forward_s)


def _as_prompt(p: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(p, torch.Tensor):
        if p.ndim == 2 and p.shape[0] == 1:
            p = p[0]
        if p.ndim != 1:
            raise ValueError(f"each prompt must be 1-D token ids (or (1, T)), got shape {tuple(p.shape)}")
        return [int(t) for t in p.tolist()]
    return [int(t) for t in p]


class _BatchMask:
    """Every step's ``(n, 1, m, W)`` masks as gathers from one right-aligned buffer.

    ``ext`` is the batch-1 slab (``(M, S + M)``: the past in the first S columns, the tree in the last
    M) followed by S masked columns. Row b with ``L_b`` cached columns (padding included) reads the
    window starting at ``S - L_b``: the past before its tree, the tree at ``[L_b, L_b + M)``, masked
    columns after. Left padding columns are masked afterwards.
    """

    def __init__(self, model: torch.nn.Module, tree: TreeBuffers, max_past: int, dtype: torch.dtype):
        self.max_past = max_past
        self.neg = torch.finfo(dtype).min
        self.depth = tree.depth  # (M,)
        self.chunk = attention_chunk(model)
        slab = _mask_slab(model, tree, max_past, dtype)
        slabs = slab if isinstance(slab, dict) else {"": slab}
        extended: dict[int, torch.Tensor] = {}  # one per slab (chunked layers share the full one)
        for v in slabs.values():
            if id(v) not in extended:
                pad = torch.full((tree.num_nodes, max_past), self.neg, dtype=dtype, device=v.device)
                extended[id(v)] = torch.cat([v[0, 0], pad], 1)  # (M, 2S + M)
        self.ext = {k: extended[id(v)] for k, v in slabs.items()}
        self.is_dict = isinstance(slab, dict)

    def build(
        self, lens: torch.Tensor, pads: torch.Tensor, m: int, width: int, reach: int
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Masks ``(n, 1, m, width)`` for rows with ``lens`` ``(n,)`` cached columns and ``pads`` ``(n,)``;
        ``reach``: the last position a node of any row may have (chunked layers: from the first chunk's
        end on, each row's nodes are cut to their chunks)."""
        start = self.max_past - lens  # (n,)
        col = torch.arange(width, device=lens.device)  # (W,)
        pad_cols = (col[None, :] < pads[:, None])[:, None, None, :]  # (n, 1, 1, W)
        out = {}
        for k, ext in self.ext.items():
            windows = ext[:m].unfold(1, width, 1).transpose(0, 1)  # (2S + M - W + 1, m, W), a view
            mask = windows.index_select(0, start)  # (n, m, W)
            out[k] = mask[:, None].masked_fill_(pad_cols, self.neg)  # (n, 1, m, W)
        if "chunked_attention" in out and reach >= self.chunk:
            # Positions: column - pad in the past, L - pad + depth for the tree's columns [L, L + m).
            depth = self.depth[:m]  # (m,)
            rel = col[None, :] - lens[:, None]  # (n, W)
            in_tree = (rel >= 0) & (rel < m)  # (n, W)
            key = (
                torch.where(in_tree, lens[:, None] + depth[rel.clamp(0, m - 1)], col[None, :]) - pads[:, None]
            )
            query = (lens - pads)[:, None] + depth  # (n, m)
            first = query - query % self.chunk  # (n, m) first position of each query's chunk
            out["chunked_attention"].masked_fill_((key[:, None, :] < first[:, :, None])[:, None], self.neg)
        return out if self.is_dict else out[""]


CUDA_WIDTH_STEP = 64
"""Columns a step's key width is rounded up to on CUDA: a GPU attention kernel that
plans per shape (cuDNN's) then sees one width per 64 columns of growth instead of a new one every
step; the extra columns are masked (stale or empty cache entries). On a CPU every masked column
still costs its dot products, so the width stays exact there."""


def _bucket(width: int, step: int) -> int:
    return -(-width // step) * step


def _prefill_masks(
    model: torch.nn.Module, allowed: torch.Tensor, dtype: torch.dtype, positions: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Float masks ``(n, 1, T, T)`` from the causal/padding ``allowed`` ``(n, T, T)``, windowed like
    :func:`~medusa_train.decoding.generate._mask_slab` (query i sees key j only if ``i - j < window``);
    chunked layers see only keys of their query's chunk of ``positions`` ``(n, T)``."""
    neg = torch.finfo(dtype).min

    def to_float(a: torch.Tensor) -> torch.Tensor:
        return torch.zeros(a.shape, dtype=dtype, device=a.device).masked_fill_(~a, neg)[:, None]

    window, kind = sliding_window_kinds(model)
    chunk = attention_chunk(model)
    masks = {"full_attention": to_float(allowed)}
    if chunk is not None:
        chunks = positions // chunk  # (n, T)
        masks["chunked_attention"] = to_float(allowed & (chunks[:, :, None] == chunks[:, None, :]))
    if kind == "full":
        return masks if chunk is not None else masks["full_attention"]
    col = torch.arange(allowed.shape[-1], device=allowed.device)  # (T,)
    windowed = allowed & ((col[:, None] - col[None, :]) < window)[None]  # (n, T, T)
    if kind == "sliding" and chunk is None:
        return to_float(windowed)
    return {**masks, "sliding_attention": to_float(windowed)}


def _num_layers(model: torch.nn.Module) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return cfg.num_hidden_layers


def kv_reusing_layers(model: torch.nn.Module) -> frozenset[int]:
    """The decoder layers of ``model`` that keep no KV of their own (its text config's
    ``kv_sharing_modes`` "reuse": Gemma 4's last ``num_kv_shared_layers``; read by
    :func:`~medusa_train.hf_compat.kv_reusing_layers`). Such a layer attends the keys and values that the
    last earlier layer of its type got back from its cache entry in the same forward, under its type's
    mask, and never touches its own (transformers gives it a ``DummyLayer``): moving or keeping that
    layer's entries serves both."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return hf_compat.kv_reusing_layers(cfg)


def model_devices(model: torch.nn.Module) -> list[str]:
    """The devices holding the model's parameters, sorted (several under a ``device_map``)."""
    return sorted({str(p.device) for p in model.parameters()})


def check_one_device(
    model: torch.nn.Module, decoder: str, remedy: str = "decode its rows one at a time with medusa_generate"
) -> None:
    """Refuse a model whose parameters are spread over several devices (``device_map``): the batched
    and static decoders keep their row indices and cache columns on one device, and a layer on
    another would fail on them mid-call.

    Raises:
        ValueError: one line naming the devices, and what decodes such a model (``remedy``).
    """
    devices = model_devices(model)
    if len(devices) > 1:
        raise ValueError(
            f"{decoder} needs the model on one device, this one is spread over {', '.join(devices)}: {remedy}"
        )


@one_call_per_model
@torch.inference_mode()
def medusa_generate_batch(
    model: torch.nn.Module,
    heads: MedusaHeads | PackedHeads,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    *,
    max_new_tokens: int,
    tree: TreeBuffers | Sequence[Sequence[int]],
    acceptance: str = "greedy",
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    eos_token_id: int | Sequence[int] | None = None,
    generators: torch.Generator | Sequence[torch.Generator | None] | None = None,
    pad_token_id: int | None = 0,
    batch1_fast_path: bool = True,
    attention: str = "sdpa",
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
    min_new_tokens: int = 0,
    min_length: int = 0,
    keep_kv: bool = False,
    stop_at_context: bool = True,
) -> MedusaBatchOutput:
    """Generate with Medusa heads for several prompts of any lengths at once.

    Args:
        model: as for :func:`~medusa_train.decoding.medusa_generate` (a 4-D float mask, explicit
            position ids; "sdpa" or "eager" attention).
        heads: the Medusa heads (or :class:`PackedHeads`).
        prompts: B prompts, each 1-D token ids (a list or a ``(T,)`` / ``(1, T)`` tensor), T >= 1.
        max_new_tokens: most tokens per row; each row also stops before ``max_position_embeddings``
            with ``stop_at_context``.
        tree: one tree for every row.
        acceptance, temperature, top_p, top_k, min_p, posterior_threshold, posterior_alpha, eos_token_id,
            repetition_penalty, min_new_tokens, min_length: as for
            :func:`~medusa_train.decoding.medusa_generate`, applied to each row (the penalty over the
            row's own tokens and ``min_length`` counting its own prompt, its padding not included).
        generators: for ``sample``: one generator per row (a row's draws then depend on its
            generator only), or one generator shared by all rows (draws in row order each step); on
            the model's device.
        pad_token_id: the token placed in left-padding positions (masked; any valid id; None: 0, for a
            tokenizer without a pad token).
        batch1_fast_path: with one prompt, run :func:`medusa_generate` (its batch-1 fast paths).
        attention: tree attention of the verification forwards, as for
            :func:`~medusa_train.decoding.medusa_generate` ("sdpa", "triton", "cuda" or "auto"); a
            kernel reads each row's past length and left padding instead of a ``(B, 1, M, W)`` mask.
        keep_kv: keep each row's KV entries as ``generate``'s cache holds them after it (its output's
            ``kv``: copied from the cache as the row finishes).
        stop_at_context: as for :func:`~medusa_train.decoding.medusa_generate`.

    Returns:
        :class:`MedusaBatchOutput`, rows in the prompts' order.

    Raises:
        ValueError: no prompts, an empty prompt, an unknown rule, bad settings, a generator list of
            the wrong length, a flash-attention model, or a model spread over several devices.
        AttentionBackendError: ``attention`` names a kernel that cannot run here, or the model is one
            no tree verification computes (ALiBi; layers of a type other than full, sliding-window or
            chunked attention: :func:`~.attention.unserved_layer_types`; a recurrent state:
            :func:`~.attention.stateful_model`; no position ids: :func:`~.attention.positionless_model`;
            masks of its own: XLM; attention both ways: :func:`~.attention.attends_both_ways`, the BERT
            family without ``is_decoder=True``; Llama 4's query scaling past ``floor_scale - 1``).
        TreeError: the tree is malformed, deeper than the number of heads, or asks for a rank >= V.
    """
    t_start = time.perf_counter()
    check_one_device(model, "medusa_generate_batch")
    rows_in = [_as_prompt(p) for p in prompts]
    if not rows_in:
        raise ValueError("prompts is empty: give at least one prompt")
    if any(len(r) == 0 for r in rows_in):
        raise ValueError("a prompt is empty: give at least one token per prompt")
    _check_settings(
        model, acceptance, max_new_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
        min_p=min_p, min_new_tokens=min_new_tokens, min_length=min_length,
    )  # fmt: skip
    bsz = len(rows_in)
    if generators is None or isinstance(generators, torch.Generator):
        gens = [generators] * bsz
    else:
        gens = list(generators)
        if len(gens) != bsz:
            raise ValueError(f"got {len(gens)} generators for {bsz} prompts: give one per prompt")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if acceptance == "sample":
        _check_generators(gens, device)
    backend = resolve_attention(
        attention, device, context=max(map(len, rows_in)) + max_new_tokens, model=model
    )
    tree = as_tree(tree).to(device)
    check_tree_fits(tree, heads, model)  # depth <= K, ranks < N
    packed = heads if isinstance(heads, PackedHeads) else PackedHeads(heads)
    rule = dict(
        acceptance=acceptance,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        posterior_threshold=posterior_threshold,
        posterior_alpha=posterior_alpha,
        eos_token_id=eos_token_id,
        repetition_penalty=repetition_penalty,
        min_new_tokens=min_new_tokens,
        min_length=min_length,
    )

    if bsz == 1 and batch1_fast_path:
        ids = torch.tensor([rows_in[0]], device=device)  # (1, T)
        kept = DynamicCache() if keep_kv else None
        one = medusa_generate(
            model, packed, ids, max_new_tokens=max_new_tokens, tree=tree, generator=gens[0],
            attention=backend, stop_at_context=stop_at_context, cache=kept, **rule,
        )  # fmt: skip
        if kept is not None and len(one.tokens):
            one.kv = dynamic_entries(kept)
        timing = dict(prefill_s=one.prefill_s, forward_s=one.forward_s)
        one.prefill_s = one.forward_s = one.total_s = 0.0
        return MedusaBatchOutput(
            rows=[one], num_forwards=one.num_forwards, total_s=time.perf_counter() - t_start, **timing
        )

    eos = set(eos_ids(eos_token_id))
    limit = context_limit(model) if stop_at_context else None
    lengths = [len(r) for r in rows_in]
    budgets = [max_new_tokens if limit is None else min(max_new_tokens, limit - t) for t in lengths]
    outs = [MedusaOutput(tokens=torch.empty(0, dtype=torch.long)) for _ in range(bsz)]
    for b in range(bsz):
        outs[b].stop_reason = "context" if budgets[b] < max_new_tokens else "max_new_tokens"
    result = MedusaBatchOutput(rows=outs)
    live = [b for b in range(bsz) if budgets[b] > 0]  # original row of each batch slot
    for b in range(bsz):
        if budgets[b] <= 0:
            outs[b].stop_reason = "empty"
    if not live:
        result.total_s = time.perf_counter() - t_start
        return result

    # Per-call setup. Cache columns: the longest padded prompt, then at most budget - 1 accepted
    # tokens (the last step needs no room after it) and one tree.
    t_max = max(lengths[b] for b in live)
    width_step = CUDA_WIDTH_STEP if device.type == "cuda" else 1
    capacity = _bucket(t_max + max(budgets[b] for b in live) + tree.num_nodes, width_step)
    check_cache_positions(model, capacity + tree.num_nodes)  # a step counts from the cache's width
    # A kernel reads each row's past length and padding and the tree's ancestor bits: no mask.
    kernel = backend != "sdpa"
    masks = None if kernel else _BatchMask(model, tree, capacity, dtype)
    tree_mask = TreeMask.of(tree) if kernel else None
    # Each layer's place, for a model whose layers mix windows and whose attention does not say it.
    positions = layer_positions(model) if kernel else {}
    text_config = model.config.get_text_config()  # its layer_types: the layers the window applies to
    window = model_window(model) if kernel else None  # the window its masks apply
    chunk = attention_chunk(model) if kernel else None  # the chunk of its chunked layers
    cache = RowKVCache(_num_layers(model), capacity, reusing=kv_reusing_layers(model))
    depth = tree.depth  # (M,)
    pos_cap = None if limit is None else limit - 1

    # 1. Prefill the left-padded prompts in one forward: a causal 4-D mask with padding columns masked
    #    (a padding row sees itself only), per-row position ids from 0 at the first real token.
    n = len(live)
    pads = [t_max - lengths[b] for b in live]
    ids = torch.full((n, t_max), 0 if pad_token_id is None else pad_token_id, dtype=torch.long)
    for i, b in enumerate(live):
        ids[i, pads[i] :] = torch.tensor(rows_in[b])
    ids = ids.to(device)  # (n, T)
    pads_t = torch.tensor(pads, device=device)  # (n,)
    col = torch.arange(t_max, device=device)  # (T,)
    allowed = (col[None, :] <= col[:, None])[None] & (
        col[None, None, :] >= pads_t[:, None, None]
    )  # (n, T, T)
    allowed |= torch.eye(t_max, dtype=torch.bool, device=device)[None]
    position_ids = (col[None, :] - pads_t[:, None]).clamp(min=0)  # (n, T)
    prefill_mask = _prefill_masks(model, allowed, dtype, position_ids)  # (n, 1, T, T), or one per layer type
    t0 = _now(device)
    cache.width = t_max
    logits, hidden = _forward(model, cache, ids, prefill_mask, position_ids, logits_to_keep=1)
    hidden = hidden[:, -1]  # (n, d)
    last = logits[:, -1]  # (n, V)
    processors = RowProcessors(
        bsz, last.shape[-1], tree, device,
        repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens, min_length=min_length,
    )  # fmt: skip
    if processors.active:  # the repetition penalty, the minimum length; state by original row
        processors.set_eos(sorted(eos))
        for b in range(bsz):
            processors.start_row(b, torch.tensor(rows_in[b]))
        last = processors.prompt_logits(last, live)
    # 2. Each row's first root, drawn with its own generator under "sample".
    roots = [
        first_token(
            last[i],
            acceptance,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            generator=gens[b],
            min_p=min_p,
        )
        for i, b in enumerate(live)
    ]
    result.prefill_s = _now(device) - t0
    del logits, prefill_mask, allowed

    cache_len = np.full(n, t_max, dtype=np.int64)  # L per slot: cached columns, padding included
    pad_np = np.asarray(pads, dtype=np.int64)
    emitted: list[list[int]] = [[] for _ in range(bsz)]
    steps: list[list[int]] = [[] for _ in range(bsz)]
    node_range = torch.arange(tree.num_nodes, device=device)  # (M,)
    forwards = SpanTimer(device)

    def keep(i: int, b: int, path: Sequence[int] = ()) -> None:
        """With keep_kv: row b's (slot i's) entries of generate's cache as it finishes: its columns
        [pad, L) and those of the nodes ``path`` (its emitted tokens but the last) of the step's tree."""
        if keep_kv:
            base = int(cache_len[i])
            cols = [*range(int(pad_np[i]), base), *(base + p for p in path)]
            outs[b].kv = row_entries(cache, i, torch.tensor(cols, device=device))

    while live:
        n = len(live)
        # 3. Rows whose root is EOS or their last allowed token emit it without a forward and leave.
        done: list[int] = []
        for i, b in enumerate(live):
            room = budgets[b] - len(emitted[b])
            if roots[i] in eos or room == 1:
                emitted[b].append(roots[i])
                steps[b].append(1)
                if roots[i] in eos:
                    outs[b].stop_reason = "eos"
                done.append(i)
                keep(i, b)
        if done:
            if len(done) == n:
                break
            live, roots, hidden, cache_len, pad_np = _drop(
                cache, done, live, roots, hidden, cache_len, pad_np
            )
            n = len(live)
        # 4. Candidates for every row from its last hidden state: the tree is cut to the depth the
        #    roomiest row can still emit; rows with less room use their own prefix at acceptance.
        rooms = [budgets[b] - len(emitted[b]) for b in live]
        sub = tree.prefix(max(rooms) - 1)
        m = sub.num_nodes
        head_logits = packed.logits_rows(hidden, sub.max_depth)  # (n, D, V)
        top = head_logits.topk(sub.topk, dim=-1).indices  # (n, D, topk)
        root_t = torch.tensor(roots, device=device)[:, None]  # (n, 1)
        flat = torch.cat([root_t, top.reshape(n, -1)], dim=1)  # (n, 1 + D * topk)
        tree_tokens = flat[:, sub.tree_indices]  # (n, m)
        # 5. One forward for all rows: row b's nodes go to cache columns [L_b, L_b + m), its mask is the
        #    tree mask shifted to L_b, its position ids continue its own sequence.
        lens = torch.from_numpy(cache_len).to(device)  # (n,)
        pads_t = torch.from_numpy(pad_np).to(device)  # (n,)
        width = min(capacity, _bucket(int(cache_len.max()) + m, width_step))
        reach = int((cache_len - pad_np).max()) + sub.max_depth  # the last position of a node
        mask = None if kernel else masks.build(lens, pads_t, m, width, reach)  # (n, 1, m, W)
        position_ids = (lens - pads_t)[:, None] + depth[:m]  # (n, m)
        if pos_cap is not None:
            position_ids = position_ids.clamp(max=pos_cap)  # nodes past a row's room are discarded
        cache.width = width
        cache.write_cols = lens[:, None] + node_range[:m]  # (n, m)
        cache.row_index = torch.arange(n, device=device)[:, None]  # (n, 1)
        step = (
            TreeStep(
                lens.int(), pads_t.int(), tree_mask.prefix(m), backend, positions, text_config, window, chunk
            )
            if kernel
            else None
        )
        if kernel:
            with forwards.span(), tree_step(model, step):
                logits, node_hidden = _forward(model, cache, tree_tokens, None, position_ids)
        else:
            with forwards.span():  # (n, m, V), (n, m, d)
                logits, node_hidden = _forward(model, cache, tree_tokens, mask, position_ids)
        result.num_forwards += 1
        if processors.active:
            logits = processors.node_logits(
                logits, live, tree_tokens, sub.depth, [len(emitted[b]) for b in live]
            )
        # 6. Acceptance per row on its own sub-tree (the first m_b nodes).
        host_tokens = tree_tokens.tolist()
        preds = argmax_list(logits) if acceptance == "greedy" or temperature <= 0 else None
        new_roots: list[int] = []
        last_nodes: list[int] = []
        finished: list[int] = []
        moves: list[tuple[int, int, int]] = []  # (slot, src column, dst column)
        for i, b in enumerate(live):
            outs[b].num_forwards += 1
            sub_b = tree.prefix(rooms[i] - 1)
            m_b = sub_b.num_nodes
            if preds is not None:
                path = walk_matches(host_tokens[i], preds[i], sub_b.child_lists())
                nxt = preds[i][path[-1]]
            elif acceptance == "typical":
                acc = accept_typical(
                    tree_tokens[i, :m_b],
                    logits[i, :m_b],
                    sub_b,
                    temperature=temperature,
                    posterior_threshold=posterior_threshold,
                    posterior_alpha=posterior_alpha,
                )
                path, nxt = acc.path, acc.next_token
            else:
                acc = accept_sample(
                    tree_tokens[i, :m_b], logits[i, :m_b], sub_b, temperature=temperature, top_p=top_p,
                    top_k=top_k, generator=gens[b], min_p=min_p,
                )  # fmt: skip
                path, nxt = acc.path, acc.next_token
            path_tokens = [host_tokens[i][p] for p in path]
            # 7. EOS inside the path: emit up to and including it; the row is done.
            if eos and not eos.isdisjoint(path_tokens):
                cut = next(j + 1 for j, tok in enumerate(path_tokens) if tok in eos)
                emitted[b].extend(path_tokens[:cut])
                steps[b].append(cut)
                outs[b].stop_reason = "eos"
                finished.append(i)
                keep(i, b, path[: cut - 1])
                new_roots.append(0)
                last_nodes.append(0)
                continue
            emitted[b].extend(path_tokens)
            steps[b].append(len(path))
            if processors.active:
                processors.accepted([b], torch.tensor([path_tokens], device=device))
            new_roots.append(nxt)
            last_nodes.append(path[-1])
            if len(emitted[b]) >= budgets[b]:
                finished.append(i)
                keep(i, b, path[:-1])
                continue
            # 8. The accepted entries out of place move to [L_b, L_b + n_b).
            base = int(cache_len[i])
            moves.extend((i, base + p, base + j) for j, p in enumerate(path) if p != j)
            cache_len[i] = base + len(path)
        if moves:
            mv = torch.tensor(moves, device=device)  # (N, 3)
            cache.move_entries(mv[:, 0], mv[:, 1], mv[:, 2])
        # 9. The last accepted node's hidden state feeds the heads; finished rows leave the batch.
        hidden = node_hidden[
            torch.arange(n, device=device), torch.tensor(last_nodes, device=device)
        ]  # (n, d)
        roots = new_roots
        if finished:
            if len(finished) == n:
                break
            live, roots, hidden, cache_len, pad_np = _drop(
                cache, finished, live, roots, hidden, cache_len, pad_np
            )
        cache.write_cols = None

    for b in range(bsz):
        outs[b].tokens = torch.tensor(emitted[b], dtype=torch.long)
        outs[b].accepted_lengths = steps[b]
    result.forward_s = forwards.seconds()
    result.total_s = time.perf_counter() - t_start
    return result


def _drop(cache: RowKVCache, gone: list[int], live, roots, hidden, cache_len, pad_np):
    """Remove the finished batch slots ``gone`` (distinct, not all of them): move the others' cache
    rows down in place and select their state."""
    out = set(gone)
    keep = [i for i in range(len(live)) if i not in out]
    idx = torch.tensor(keep, device=hidden.device)
    cache.keep_rows(idx)
    return (
        [live[i] for i in keep],
        [roots[i] for i in keep],
        hidden.index_select(0, idx),
        cache_len[keep],
        pad_np[keep],
    )
