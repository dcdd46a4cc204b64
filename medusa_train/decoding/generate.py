"""Medusa tree-attention decoding on an unmodified Hugging Face causal LM.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774).

Each step: the K heads read the hidden state of the last token in the KV cache and propose their
top-k tokens; a tree of candidate continuations (the root is the token the backbone already chose)
is verified in ONE forward of the backbone through its own ``forward``: a 4-D float attention mask
``(1, 1, M, past + M)`` (0 where a node may attend, dtype-min elsewhere) and explicit position ids
``past + depth`` on top of a ``DynamicCache``. The accepted path is kept, its KV entries are moved
into place (no re-forward), and the logits/hidden state of its last node seed the next step.
With ``attention="triton" | "cuda"`` the verification forward builds no mask: the model's attention
layers run a tree-attention kernel that reads the tree's ancestor bits (:mod:`.attention`).
The per-step work around the forward is kept small: the mask and position ids are cut out of buffers
kept on the tree (the mask copied to a fresh aligned block when the cut is not one), a chain's candidates are written straight into the token buffer, acceptance is one
device-to-host copy and a walk over host-side children lists, and KV entries already in place are
not copied (the whole path, for a chain).

Why ``model(..., output_hidden_states=True)`` rather than the language model + ``lm_head``: the full
forward applies whatever the architecture does after the decoder (logit soft-capping or scaling in
Gemma-2, Cohere, Granite, ...), so the verification logits are exactly those ``generate`` sees;
``hidden_states[-1]`` is what ``lm_head`` reads and training reads, the decoder's ``last_hidden_state``
(checked per architecture in the tests), made so for Gemma 3n, whose decoder returns its AltUp streams
stacked there (:func:`last_hidden_state_tied`). The tuple only holds references to activations
computed anyway; the prefill keeps one position of logits (``logits_to_keep=1``).
"""

from __future__ import annotations

import contextlib
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache
from transformers.cache_utils import Cache

from ..head_targets import language_model
from ..heads import MedusaHeads
from ..hf_compat import cache_kwargs
from .acceptance import (
    ACCEPTANCE_RULES,
    accept_greedy,
    accept_sample,
    accept_typical,
    first_token,
)
from .attention import (
    AttentionBackendError,
    TreeMask,
    TreeStep,
    attention_chunk,
    layer_positions,
    model_window,
    one_call_per_model,
    packed_sdpa,
    resolve_attention,
    sliding_window_kinds,
    tree_step,
)
from .processors import RowProcessors
from .tree import TreeBuffers, as_tree


@dataclass
class MedusaOutput:
    """What :func:`medusa_generate` produced.

    Attributes:
        tokens: ``(n,)`` long, the new tokens (CPU).
        accepted_lengths: tokens emitted per step: 1 (the step's root, chosen by the backbone) plus the
            number of accepted head candidates. ``sum(accepted_lengths) == len(tokens)``.
        num_forwards: verification forwards run (the last step may need none: a root that is EOS or
            the last allowed token is emitted without one). The prefill is not counted.
        stop_reason: ``"max_new_tokens"``, ``"eos"``, ``"context"`` (model's context limit) or
            ``"empty"`` (no room for any token).
        prefill_s: seconds in the prefill forward (and the first root's choice).
        forward_s: seconds in verification forwards: the model calls only (masks, position ids,
            heads and everything else around them count as overhead); on CUDA the device's time from
            each call's first kernel to its last, timed with events (:class:`SpanTimer`).
        total_s: wall-clock seconds of the whole call, argument checks included.
        kv: the row's KV entries that ``generate``'s cache would hold after it (the prompt's and the
            new tokens' but the last token's), for a batched or static decoder asked to keep them
            (``keep_kv``): one ``(keys, values)`` pair of ``(H, n, D)`` copies per layer of its cache, None for
            a layer that keeps none (a KV-sharing layer); None otherwise, or without new tokens.
    """

    tokens: torch.Tensor
    accepted_lengths: list[int] = field(default_factory=list)
    num_forwards: int = 0
    stop_reason: str = "max_new_tokens"
    prefill_s: float = 0.0
    forward_s: float = 0.0
    total_s: float = 0.0
    kv: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None

    @property
    def num_steps(self) -> int:
        """Decode steps (entries of ``accepted_lengths``)."""
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens per step (plain decoding = 1.0, at most tree depth + 1)."""
        return len(self.tokens) / max(1, self.num_steps)

    @property
    def overhead_s(self) -> float:
        """Seconds outside the prefill and the model's verification calls: argument checks, setup,
        heads, candidates, masks, acceptance, KV compaction and the loop's Python."""
        return max(0.0, self.total_s - self.prefill_s - self.forward_s)

    @property
    def overhead_fraction(self) -> float:
        """``overhead_s`` over the decode time (total minus prefill)."""
        decode = self.total_s - self.prefill_s
        return self.overhead_s / decode if decode > 0 else 0.0


class PackedHeads:
    """The K heads' weights stacked once, so one step's head logits are batched products.

    Stacking costs one copy of the heads' own weights (``K * (L * d * d + V_draft * d)`` values); pack
    once and pass the result to many :func:`medusa_generate` calls. Shared heads keep a reference to
    the backbone's lm_head (no copy: one ``(V, d)`` matrix read per step for all K heads); truncated
    heads return full-vocabulary logits with ``-inf`` outside their token map, so every decoder's
    top-k candidates are full-vocabulary ids without knowing the variant.

    Args:
        heads: trained :class:`MedusaHeads` (shared heads bound to their backbone's lm_head).
    """

    def __init__(self, heads: MedusaHeads) -> None:
        self.num_heads = heads.num_heads
        self.num_layers = heads.num_layers
        self.vocab_size = heads.vocab_size
        # N, the tokens each head proposes (V unless truncated): what a tree's ranks must stay below.
        self.draft_vocab_size = heads.draft_vocab_size
        with torch.no_grad():
            blocks = [
                [heads.blocks(k)[i].linear for i in range(heads.num_layers)] for k in range(heads.num_heads)
            ]
            d = heads.hidden_size
            ref = heads.head_weight(0)
            # Stored transposed and contiguous ((in, out) per head) so each step's batched products
            # read their right-hand side in order: measured ~25% faster than transposed views.
            self.w1t = (
                torch.stack([torch.stack([b.weight.t() for b in bl]) for bl in blocks]).detach().contiguous()
                if heads.num_layers
                else ref.new_zeros(heads.num_heads, 0, d, d)
            )  # (K, L, d_in, d_out)
            self.b1 = (
                torch.stack([torch.stack([b.bias for b in bl]) for bl in blocks]).detach()
                if heads.num_layers
                else ref.new_zeros(heads.num_heads, 0, d)
            )  # (K, L, d)
            shared = heads.head_projection == "shared"
            self.shared = ref.detach() if shared else None  # (V, d), the backbone's lm_head itself
            self.w2t = (
                None if shared else heads.projection_weight().detach().transpose(1, 2).contiguous()
            )  # (K, d, V_draft)
            token_map = heads.token_map  # (V_draft,) full-vocabulary ids, or None
            self.token_map = None if token_map is None else token_map.to(ref.device)

    def _views(self, k: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """Per-layer ``(b1 (k, 1, d), w1t (k, d, d))`` and ``w2t (k, d, V)`` views of the first k heads."""
        cache = self.__dict__.setdefault("_view_cache", {})
        if k not in cache:
            layers = [(self.b1[:k, i, None, :], self.w1t[:k, i]) for i in range(self.num_layers)]
            cache[k] = (layers, None if self.w2t is None else self.w2t[:k])
        return cache[k]

    def _project(self, x: torch.Tensor, w2t: torch.Tensor | None) -> torch.Tensor:
        """``(k, n, d)`` head features -> ``(k, n, V)`` full-vocabulary logits."""
        if self.shared is not None:
            return F.linear(x.to(self.shared.dtype), self.shared)  # (k, n, V): one lm_head for all heads
        logits = torch.bmm(x, w2t)  # (k, n, V_draft)
        if self.token_map is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))  # (k, n, V)
        return full.index_copy_(2, self.token_map, logits)

    def logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits of the first ``num_heads`` heads (default: all) at one position.

        Args:
            hidden: ``(d,)`` the backbone's last hidden state at that position.
            num_heads: compute only heads ``0 .. num_heads - 1`` (a tree of depth D needs D).

        Returns:
            ``(num_heads, V)`` over the full vocabulary (truncated heads: ``-inf`` outside the map).
        """
        k = self.num_heads if num_heads is None else num_heads
        layers, w2t = self._views(k)
        if hidden.dtype != self.dtype:
            hidden = hidden.to(self.dtype)
        x = hidden.expand(k, 1, -1)  # (k, 1, d)
        for b1, w1t in layers:
            # x + SiLU(W1 x + b1) for the k heads in one batched product.
            x = F.silu(torch.baddbmm(b1, x, w1t), inplace=True).add_(x)  # (k, 1, d)
        return self._project(x, w2t).squeeze(1)  # (k, V)

    def logits_rows(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits of the first ``num_heads`` heads at one position of each of B rows.

        Args:
            hidden: ``(B, d)`` the backbone's last hidden state of each row.
            num_heads: compute only heads ``0 .. num_heads - 1``.

        Returns:
            ``(B, num_heads, V)`` over the full vocabulary (truncated heads: ``-inf`` outside the map).
        """
        k = self.num_heads if num_heads is None else num_heads
        layers, w2t = self._views(k)
        if hidden.dtype != self.dtype:
            hidden = hidden.to(self.dtype)
        x = hidden.expand(k, -1, -1)  # (k, B, d)
        for b1, w1t in layers:
            x = F.silu(torch.baddbmm(b1, x, w1t), inplace=True).add_(x)  # (k, B, d)
        return self._project(x, w2t).transpose(0, 1)  # (B, k, V)

    @property
    def dtype(self) -> torch.dtype:
        return self.b1.dtype


def check_tree_fits(tree: TreeBuffers, heads: MedusaHeads | PackedHeads, model: torch.nn.Module) -> None:
    """Raise :class:`~medusa_train.decoding.tree.TreeError` if ``tree`` is deeper than ``heads`` or asks
    for a rank they cannot propose: ranks below their draft vocabulary (N of truncated heads, whose
    full-vocabulary logits are ``-inf`` elsewhere) and below the model's vocabulary."""
    vocab = model.get_output_embeddings().weight.shape[0]
    tree.check_heads(heads.num_heads, min(heads.draft_vocab_size, vocab))


def context_limit(model: torch.nn.Module) -> int | None:
    """The model's maximum number of positions (``max_position_embeddings``), if it declares one (in its
    text config: a multimodal model such as Gemma 3 from 4B on nests it there)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)


def position_bound(model: torch.nn.Module) -> str | None:
    """Why the decoders must stop at the model's ``max_position_embeddings`` (:func:`context_limit`) to
    decode what ``generate`` decodes; None where they may go on past it, as ``generate`` does (with a
    warning) for a model whose positions go on (RoPE and its static scalings; no such limit).

    They must stop where the model looks its positions up in a table of that many rows: learned
    absolute positions (GPT-2's and GPT-BigCode's ``wpe``, OPT's and BioGPT's ``embed_positions``,
    which keep 2 rows more, the position embeddings of BERT-like decoders), found as an
    ``nn.Embedding`` other than the input embeddings with that many rows (up to 2 more), or a fixed
    table (CTRL's sinusoidal ``pos_encoding``, GPT-J's and CodeGen's rotary ``embed_positions``), found as
    a 2-D floating-point buffer of that many rows (not of a module that grows it: XGLM's ``make_weights``):
    ``generate`` fails past the table (an IndexError). And where its RoPE is dynamic NTK (a rotary
    embedding's ``rope_type`` "dynamic"): past that length every forward recomputes the frequencies from
    its largest position, which a tree's deeper nodes raise, so the tokens would not be ``generate``'s.
    Checked on transformers 5.24's causal LMs the decoders serve (each tiny, 128 positions, greedy
    ``generate`` from 120 tokens to 140; GPT-J and CodeGen with a ``rotary_dim`` their heads fit): this
    names exactly those whose ``generate`` fails past the limit (2026-12-07)."""
    limit = context_limit(model)
    if limit is None:
        return None
    inputs = model.get_input_embeddings()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module is not inputs:
            if limit <= module.num_embeddings <= limit + 2:
                rows = module.num_embeddings
                return f"its positions are a learned table of {rows} rows (plain generate fails past it)"
        kind = getattr(module, "rope_type", None)
        if "dynamic" in (kind.values() if isinstance(kind, dict) else [kind]):
            return (
                "past it, its dynamic NTK RoPE recomputes the frequencies from each forward's largest "
                "position, which a tree's deeper nodes raise (plain generate goes on, with other tokens)"
            )
        if callable(getattr(module, "make_weights", None)):
            continue  # fairseq's sinusoidal tables (XGLM's) grow past it
        for buffer in module.buffers(recurse=False):
            if buffer.dim() == 2 and buffer.is_floating_point() and limit <= buffer.shape[0] <= limit + 2:
                rows = buffer.shape[0]
                return f"its positions are a fixed table of {rows} rows (plain generate fails past it)"
    return None


def check_cache_positions(model: torch.nn.Module, reach: int) -> None:
    """Refuse a call whose forwards reach positions a model counts from its KV cache's length instead of
    the position ids: Llama 4's NoPE layers scale their queries by ``1 + attn_scale * log1p(floor((p +
    1) / floor_scale))`` (``attn_temperature_tuning``) at ``p = cache length + index``, which is not a
    tree node's position (its depth counts, not its index) nor, in the batched and static decoders'
    preallocated caches, a row's (their length is the cache's width). Below ``floor_scale - 1`` every
    scale is 1, whatever the count.

    Args:
        reach: one more than the largest position a forward of the call may count that way.

    Raises:
        AttentionBackendError: the call may reach ``floor_scale - 1``, in one line.
    """
    config = model.config.get_text_config()
    nope = not all(getattr(config, "no_rope_layers", None) or [1])
    floor = getattr(config, "floor_scale", None)
    if not (getattr(config, "attn_temperature_tuning", False) and nope and floor) or reach < floor:
        return
    raise AttentionBackendError(
        f"{type(model).__name__} scales its NoPE layers' queries (attn_temperature_tuning) by positions it "
        "counts from the KV cache's length, not by the position ids tree verification passes, and from "
        f"position {floor - 1} (floor_scale - 1) on that scale is not 1: this call's forwards may count "
        f"{reach - 1}; decode less (prompt, new tokens, tree nodes, capacity) or use model.generate"
    )


def _mask_slab(
    model: torch.nn.Module, tree: TreeBuffers, max_past: int, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Masks for every cache length up to ``max_past`` at once, right-aligned on the tree.

    ``(1, 1, M, max_past + M)``: the last M columns are the tree's own mask, the ``max_past`` before
    them the past (column ``max_past - k`` is the cached token k places before the tree). The mask
    for ``past_len`` cached tokens is the view ``[..., max_past - past_len :]``, and for the sub-tree
    of the first m nodes (:meth:`TreeBuffers.prefix`) the view ``[..., :m, max_past - past_len :
    max_past + m]``. A sliding window depends only on the distance between query and key positions,
    ``depth_i - offset_j``, which is the same for every ``past_len``, so one slab serves every step.
    Chunked attention layers (:func:`~.attention.attention_chunk`) depend on the positions themselves:
    their entry ``"chunked_attention"`` is the full slab, cut to each query's chunk per step
    (:func:`_chunk_masked`).
    """
    device = tree.depth.device
    m = tree.num_nodes
    allowed = torch.ones(m, max_past + m, dtype=torch.bool, device=device)  # (M, max_past + M)
    allowed[:, max_past:] = tree.attn_mask
    neg = torch.finfo(dtype).min

    def to_float(a: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(a.shape, dtype=dtype, device=device)
        return out.masked_fill_(~a, neg)[None, None]

    window, kind = sliding_window_kinds(model)
    chunked = attention_chunk(model) is not None
    full = to_float(allowed)
    masks = {"full_attention": full, "chunked_attention": full} if chunked else {"full_attention": full}
    if kind == "full":
        return masks if chunked else full
    # Key offsets relative to the tree's root position: -max_past .. -1 for the past, depth for nodes.
    k_off = torch.cat([torch.arange(-max_past, 0, device=device), tree.depth])  # (max_past + M,)
    windowed = allowed & ((tree.depth[:, None] - k_off[None, :]) < window)  # (M, max_past + M)
    if kind == "sliding" and not chunked:
        return to_float(windowed)
    return {**masks, "sliding_attention": to_float(windowed)}


def _chunk_masked(mask: torch.Tensor, past_len: int, depth: torch.Tensor, chunk: int) -> torch.Tensor:
    """``mask`` ``(1, 1, m, past_len + m)`` of the nodes of depths ``depth`` ``(m,)`` on ``past_len``
    cached tokens, with every key before its query's chunk of positions masked (a fresh tensor): the
    key at position j is visible to the query at p only if ``j // chunk == p // chunk``, and a key the
    tree rule lets a query see is never after it."""
    query = past_len + depth  # (m,) positions
    first = query - query % chunk  # (m,) first position of each query's chunk
    key = torch.cat([torch.arange(past_len, device=depth.device), query])  # (past_len + m,) positions
    return mask.masked_fill(key[None, :] < first[:, None], torch.finfo(mask.dtype).min)


class _TreeInputs:
    """Every step's attention mask and position ids cut out of two per-tree buffers.

    Built by :func:`_tree_inputs` (cached on the tree, grown when a longer context comes), so a
    step costs two ``narrow`` views (and, for the mask, a copy when the view is not contiguous and
    aligned) instead of building a ``(M, past + M)`` mask.
    """

    def __init__(self, model: torch.nn.Module, tree: TreeBuffers, max_past: int, dtype: torch.dtype):
        self.max_past = max_past
        self.num_nodes = tree.num_nodes
        self.depth, self.max_depth = tree.depth, tree.max_depth
        self.chunk = attention_chunk(model)
        self.slab = _mask_slab(model, tree, max_past, dtype)  # (1, 1, M, max_past + M) or a dict
        # positions[p] = p + depth: the position ids on p cached tokens.
        self.positions = (
            torch.arange(max_past + 1, device=tree.depth.device)[:, None] + tree.depth
        )  # (P+1, M)

    def mask(self, past_len: int, m: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """``(1, 1, m, past_len + m)`` mask of the first m nodes on ``past_len`` cached tokens.

        Cropped out of the slab and handed over contiguous and aligned (:func:`aligned`): the crop
        starts at an arbitrary column, and attention kernels read masks with vector loads (cuDNN's
        SDPA faulted with ``misaligned address`` on such a view).
        """
        start = self.max_past - past_len
        if not isinstance(self.slab, dict):
            return aligned(_crop_slab(self.slab, start, past_len, m, self.num_nodes))
        crops: dict[int, torch.Tensor] = {}  # one crop per slab (chunked layers share the full one)
        out = {}
        for kind, slab in self.slab.items():
            if id(slab) not in crops:
                crops[id(slab)] = aligned(_crop_slab(slab, start, past_len, m, self.num_nodes))
            out[kind] = crops[id(slab)]
        # Chunked layers: only a node at a position past the first chunk loses keys.
        if "chunked_attention" in out and past_len + self.max_depth >= self.chunk:
            out["chunked_attention"] = _chunk_masked(
                out["chunked_attention"], past_len, self.depth[:m], self.chunk
            )
        return out

    def position_ids(self, past_len: int, m: int) -> torch.Tensor:
        """``(1, m)`` position ids ``past_len + depth`` of the first m nodes (a view)."""
        row = self.positions.narrow(0, past_len, 1)  # (1, M)
        return row if m == self.num_nodes else row[:, :m]


ALIGN_BYTES = 16
"""Alignment of every tensor our decoders hand to attention as a mask (the widest vector load of
the CUDA attention kernels; the caching allocators align fresh blocks to far more)."""


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is contiguous and starts on an :data:`ALIGN_BYTES` boundary, else a copy that does."""
    if t.is_contiguous() and t.data_ptr() % ALIGN_BYTES == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # a fresh, aligned block
    return out.copy_(t)


# cuDNN's fused attention builds an execution plan per new shape, and an eager tree decoder's key
# width grows every step: on an H100 a bf16 tree forward of the 3M demo model cost 60 ms with it and
# 7.6 ms with SDPA's memory-efficient kernel. The decoders (and the plain baselines they are timed
# against, so the comparison stays fair) run with it excluded; flash serves mask-free calls (the
# prefill), the memory-efficient kernel masked ones, math whatever neither takes.
_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The context our decoders' model calls run in on ``device``: SDPA without cuDNN on CUDA, nothing
    to change elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(_SDPA_BACKENDS))


def _crop_slab(slab: torch.Tensor, start: int, past_len: int, m: int, num_nodes: int) -> torch.Tensor:
    view = slab.narrow(3, start, past_len + m)
    return view if m == num_nodes else view[:, :, :m]


def _tree_inputs(model: torch.nn.Module, tree: TreeBuffers, max_past: int, dtype: torch.dtype) -> _TreeInputs:
    """The tree's :class:`_TreeInputs` for this model's mask kind and ``dtype``, covering ``max_past``.

    Kept on the tree (one per dtype / window kind) and rebuilt at least twice as wide when a call
    needs more: its size is ``M x (max_past + M)`` mask values (two for mixed sliding/full models).
    """
    window, kind = sliding_window_kinds(model)
    key = (dtype, window, kind, attention_chunk(model))
    store = tree.__dict__.setdefault("_inputs_cache", {})
    built = store.get(key)
    if built is None or built.max_past < max_past:
        width = max_past if built is None else max(max_past, 2 * built.max_past)
        width += -(width + tree.num_nodes) % 16  # rows 16-element aligned (GPU attention kernels)
        built = store[key] = _TreeInputs(model, tree, width, dtype)
    return built


def tree_attention_mask(
    model: torch.nn.Module, tree: TreeBuffers, past_len: int, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4-D float mask for verifying ``tree`` on top of ``past_len`` cached tokens.

    Returns:
        ``(1, 1, M, past_len + M)`` with 0 where attention is allowed and ``finfo(dtype).min``
        elsewhere; a dict ``{"full_attention": ..., "sliding_attention": ...}`` for models whose
        layers mix full and sliding-window (or chunked) attention.
    """
    return _TreeInputs(model, tree, past_len, dtype).mask(past_len, tree.num_nodes)


def verify_forward(
    model: torch.nn.Module,
    cache: DynamicCache,
    tree_tokens: torch.Tensor,
    tree: TreeBuffers,
    past_len: int,
    backend: str = "sdpa",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree-attention forward through the model's own ``forward``, as the decoders' step 5 runs it;
    appends M entries to ``cache``.

    Args:
        tree_tokens: ``(M,)`` token of every node.
        tree: buffers on the model's device.
        past_len: tokens already in ``cache``.
        backend: the tree attention, resolved (:func:`~.attention.resolve_attention`): "sdpa" (the
            dense float mask) or a kernel, "triton" or "cuda" (:func:`~.attention.tree_step`, no mask).

    Returns:
        logits ``(M, V)`` and last hidden states ``(M, d)``.
    """
    position_ids = (past_len + tree.depth)[None]  # (1, M)
    if backend == "sdpa":
        mask = tree_attention_mask(model, tree, past_len, next(model.parameters()).dtype)
        logits, hidden = _forward(model, cache, tree_tokens[None], mask, position_ids)  # (1, M, V), (1, M, d)
    else:
        device = tree_tokens.device
        past = torch.full((1,), past_len, dtype=torch.int32, device=device)  # (1,)
        no_pad = torch.zeros(1, dtype=torch.int32, device=device)  # (1,)
        text = model.config.get_text_config()
        step = TreeStep(
            past,
            no_pad,
            TreeMask.of(tree),
            backend,
            layer_positions(model),
            text,
            model_window(model),
            attention_chunk(model),
        )
        with tree_step(model, step):
            logits, hidden = _forward(model, cache, tree_tokens[None], None, position_ids)
    return logits[0], hidden[0]  # (M, V), (M, d)


def _forward(
    model: torch.nn.Module,
    cache: Cache,
    input_ids: torch.Tensor,
    mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
    position_ids: torch.Tensor | None = None,
    logits_to_keep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoders' model call: B rows of T tokens (a prompt, or tree nodes) appended to ``cache``.

    Args:
        input_ids: ``(B, T)`` tokens.
        mask: ``(B, 1, T, W)`` float mask (or one per layer type), W the cache width after the call;
            None: the model's causal mask.
        position_ids: ``(B, T)``; None: the model's own (following the cache).
        logits_to_keep: logits of the last this many positions only (0: all), as the model takes it.

    Returns:
        logits ``(B, T or logits_to_keep, V)`` and last hidden states ``(B, T, d)``; the other layers'
        hidden states are dropped here.
    """
    # A masked forward of a grouped-query model (a tree's nodes) stacks each KV head's query heads
    # instead of expanding K/V (packed_sdpa); an unmasked one is the model's own causal attention.
    packing = contextlib.nullcontext() if mask is None else packed_sdpa(model)
    with attention_backends(input_ids.device), packing, last_hidden_state_tied(model):
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=logits_to_keep,
            **cache_kwargs(model, cache),
        )
    return out.logits, out.hidden_states[-1]


UNTIED_LAST_HIDDEN_STATES = ("gemma3n", "gemma3n_text")
"""Model types (``config.model_type``) whose decoder returns as ``hidden_states[-1]`` other states than
its ``last_hidden_state``, what ``lm_head`` reads: Gemma 3n (its multimodal model, how its checkpoints
load, and its text model), whose decoder opts out of transformers' tie
(``capture_outputs(tie_last_hidden_states=False)``) and returns its AltUp streams stacked,
``(altup_num_inputs, B, T, d)``, which it unembeds and norms into ``last_hidden_state``. transformers
5.24's other language models tie the two."""


def last_hidden_state_tied(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Inside the block, ``model``'s forward returns as ``hidden_states[-1]`` its decoder's
    ``last_hidden_state``, what ``lm_head`` reads and the heads are trained on
    (:func:`~medusa_train.head_targets.last_hidden_state`): a forward hook on its language model
    (:func:`~medusa_train.head_targets.language_model`) ties them as transformers does for its other
    language models, for the model types of :data:`UNTIED_LAST_HIDDEN_STATES`; nothing for the others,
    which tie them already (held on every model, the lookup and the hook would add ~18 us to each eager
    forward: 2% of a 2-layer tiny Llama's, 2-core AMD EPYC, 2026-12-07). The hook is the same function
    at every call: a step under
    ``torch.compile`` traces it into its one graph."""
    if getattr(model.config, "model_type", None) not in UNTIED_LAST_HIDDEN_STATES:
        return contextlib.nullcontext()
    return _forward_hook(language_model(model), _tie_last_hidden_state)


@contextlib.contextmanager
def _forward_hook(module: torch.nn.Module, hook: Callable) -> Iterator[None]:
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _tie_last_hidden_state(module: torch.nn.Module, args: tuple, out) -> None:
    """The decoder's forward hook of :func:`last_hidden_state_tied`: its output's ``hidden_states[-1]``
    set to its ``last_hidden_state`` where it returned both."""
    last, states = getattr(out, "last_hidden_state", None), getattr(out, "hidden_states", None)
    if last is not None and states:
        out.hidden_states = (*states[:-1], last)


def dynamic_entries(cache: DynamicCache, row: int = 0) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Row ``row``'s KV entries of a ``DynamicCache``: per layer ``(H, n, D)`` keys and ``(H, n, Dv)``
    values (views), None for a layer that holds none (a KV-sharing layer's, never written)."""
    return [
        (layer.keys[row], layer.values[row])
        if layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4
        else None
        for layer in cache.layers
    ]


def compact_cache(cache: DynamicCache, past_len: int, path: Sequence[int]) -> None:
    """Keep the KV entries of the accepted ``path`` (tree node indices) right after ``past_len``.

    Layer tensors are ``(B, H, T, D)``; entry ``past_len + path[j]`` moves to ``past_len + j`` and
    the cache is cropped to ``past_len + len(path)``. Path nodes have strictly increasing depth and
    nodes are sorted by depth, so ``path[j] >= j``; the gather copies before it writes. The leading
    entries with ``path[j] == j`` are already in place and are not copied (a chain prefix
    ``[0, 1, 2, ...]`` moves nothing).
    """
    n = len(path)
    first = 0  # first entry out of place
    while first < n and path[first] == first:
        first += 1
    if first < n:
        index: dict[torch.device, torch.Tensor] = {}  # one host-to-device copy per device, not per layer
        src = [past_len + p for p in path[first:]]
        lo, hi = past_len + first, past_len + n
        for layer in cache.layers:
            if layer.keys is None:  # a layer that keeps no KV (a KV-sharing layer's DummyLayer)
                continue
            dev = layer.keys.device
            if dev not in index:
                index[dev] = torch.tensor(src, device=dev)  # (n - first,)
            idx = index[dev]
            layer.keys[:, :, lo:hi] = layer.keys[:, :, idx]  # (B, H, n - first, D)
            layer.values[:, :, lo:hi] = layer.values[:, :, idx]  # (B, H, n - first, D)
    # A negative argument removes that many tokens, in every transformers 5.x release we support.
    surplus = cache.get_seq_length() - (past_len + n)
    if surplus > 0:
        cache.crop(-surplus)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class SpanTimer:
    """Seconds a call spends in some of its spans (its verification forwards), without synchronising
    the device around each: on CUDA a span is a pair of events on the current stream, read once when
    the call asks for :meth:`seconds` (the device time from the span's start to its end, launch gaps
    included); elsewhere the host clock.

    Synchronising before and after every forward only to time it kept the host from queueing the
    forward while the heads' kernels ran, which slows an eager decoder bound by its launches."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host_s = 0.0

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._host_s += time.perf_counter() - t0

    def seconds(self) -> float:
        """The spans' total (on CUDA this waits for the last span to end)."""
        if not self.cuda:
            return self._host_s
        if self._events:
            self._events[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self._events) / 1000.0


def eos_ids(eos_token_id: int | Sequence[int] | torch.Tensor | None) -> list[int]:
    """The EOS ids in the order given (the first is generate's padding when it has no ``pad_token_id``),
    from what generate accepts: None, an int (numpy's included), a list, a 0-d or 1-d tensor."""
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):  # 0-d or 1-d, as generation configs may hold them
        return [int(e) for e in eos_token_id.reshape(-1).tolist()]
    try:
        return [operator.index(eos_token_id)]  # int, numpy integer
    except TypeError:
        return [int(e) for e in eos_token_id]


def _check_generators(generators: Sequence[torch.Generator | None], device: torch.device) -> None:
    """Each generator given for sampling lives where the draws are made (the model's device).

    Raises:
        ValueError: one on another device (``torch.multinomial`` would fail there mid-generation).
    """
    for gen in generators:
        if gen is None:
            continue
        where = gen.device
        if where.type != device.type or (device.type == "cuda" and where.index != device.index):
            raise ValueError(
                f"a generator on {where} for a model on {device}: make it with "
                f"torch.Generator(device={str(device)!r}) (draws are made where the logits are)"
            )


def _check_settings(
    model: torch.nn.Module,
    acceptance: str,
    max_new_tokens: int,
    *,
    temperature: float,
    top_p: float,
    top_k: int = 0,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
    min_new_tokens: int = 0,
    min_length: int = 0,
) -> None:
    """The checks every Medusa decoder makes before any work: a known rule, sane sampling settings and
    an attention implementation that takes a 4-D float mask.

    Raises:
        ValueError: the first setting that is off, with what to do about it.
    """
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {acceptance!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: no top-k), got {top_k!r}")
    for name, value in (("min_new_tokens", min_new_tokens), ("min_length", min_length)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0 (0: none), got {value!r}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0: no min-p), got {min_p!r}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1: none), got {repetition_penalty!r}")
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    if attn.startswith("flash"):
        raise ValueError(
            f"tree verification needs a 4-D float attention mask, which {attn} cannot take: "
            "load the model with attn_implementation='sdpa' or 'eager'"
        )


@one_call_per_model
@torch.inference_mode()
def medusa_generate(
    model: torch.nn.Module,
    heads: MedusaHeads | PackedHeads,
    input_ids: torch.Tensor,
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
    generator: torch.Generator | None = None,
    attention: str = "sdpa",
    on_tokens: Callable[[list[int]], object] | None = None,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
    min_new_tokens: int = 0,
    min_length: int = 0,
    cache: DynamicCache | None = None,
    stop_at_context: bool = True,
) -> MedusaOutput:
    """Generate with Medusa heads and tree verification (batch size 1).

    Args:
        model: a Hugging Face causal LM in eval mode whose forward accepts a 4-D float mask,
            ``position_ids`` and a ``DynamicCache`` (Llama, Qwen2, Mistral, GPT-2, ... with the
            "sdpa" or "eager" attention implementation) whose layers are full, sliding-window or
            chunked attention (by ``config.layer_types``; windows and chunks are honoured).
        heads: the Medusa heads (or :class:`PackedHeads` built once from them).
        input_ids: ``(1, T)`` prompt.
        max_new_tokens: most tokens to generate; generation also stops before the model's
            ``max_position_embeddings`` (prompt + new tokens never exceed it) with ``stop_at_context``.
        tree: :class:`TreeBuffers` or a list of index paths; depth must not exceed the number of heads.
        acceptance: "greedy" (identical to ``generate(do_sample=False)``), "typical" (Medusa's
            rule) or "sample" (same distribution as ``generate(do_sample=True)``); see
            :mod:`medusa_train.decoding.acceptance`.
        temperature: sampling temperature for "typical" and "sample" (0 means greedy).
        top_p: nucleus filtering for "sample".
        top_k: top-k filtering for "sample", before top_p as ``generate`` applies them (0: none).
        min_p: min-p filtering for "sample", after top_p as ``generate`` applies it (0: none).
        posterior_threshold: epsilon of typical acceptance.
        posterior_alpha: delta of typical acceptance (threshold = min(epsilon, delta * exp(-H))).
        eos_token_id: one id or several; an EOS inside an accepted path is emitted and ends generation.
        generator: random generator for "sample" (on the model's device); the typical rule is
            deterministic given the heads.
        attention: tree attention of the verification forwards: "sdpa" (the model's attention with
            a dense float mask), "triton" or "cuda" (the fused kernels of
            :mod:`medusa_train.decoding.attention`, no mask built), or "auto" (the fastest that runs
            on the device; sdpa on a CPU). The prefill always runs the model's own attention.
        on_tokens: called with each step's newly emitted tokens as they are decided, in order (what
            a streamer's ``put`` gets); their concatenation is the output's ``tokens``.
        repetition_penalty: ``generate``'s repetition penalty (1: none), applied to every node's
            logits before any rule (:mod:`medusa_train.decoding.processors`).
        min_new_tokens, min_length: ``generate``'s minimum lengths (new tokens; tokens in all, the
            prompt counted): EOS cannot end the reply earlier (0: none).
        cache: a ``DynamicCache`` whose layers hold every token (no sliding-window layer; a layer
            that keeps no KV, a KV-sharing layer's, holds none) to decode on: it holds the keys and
            values of the first ``cache.get_seq_length()`` tokens of ``input_ids`` (a cache this
            function or ``generate`` left), and only the others are prefilled. On return it holds
            what ``generate``'s cache holds after it: the entries of
            the prompt and of the new tokens but the last (the tree's other columns cut off); where
            no token was generated, as given. None: a cache of the call's own.
        stop_at_context: stop before the model's ``max_position_embeddings`` (``stop_reason``
            "context"); False: go on past it, as ``generate`` does, for a model whose positions go on
            (:func:`position_bound` None).

    Returns:
        :class:`MedusaOutput`.

    Raises:
        ValueError: batch size is not 1, an unknown acceptance rule, bad sampling settings, or a
            ``cache`` that holds as many tokens as ``input_ids`` or more.
        AttentionBackendError: ``attention`` names a kernel that cannot run here, or the model is one
            no tree verification computes (ALiBi; layers of a type other than full, sliding-window or
            chunked attention: :func:`~.attention.unserved_layer_types`; a recurrent state:
            :func:`~.attention.stateful_model`; no position ids: :func:`~.attention.positionless_model`;
            masks of its own: XLM; attention both ways: :func:`~.attention.attends_both_ways`, the BERT
            family without ``is_decoder=True``; Llama 4's query scaling past ``floor_scale - 1``).
        TreeError: the tree is malformed, deeper than the number of heads, or asks for a rank >= V.
    """
    t_start = time.perf_counter()
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"medusa_generate decodes one sequence: input_ids must be (1, T), got {tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    _check_settings(
        model, acceptance, max_new_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
        min_p=min_p, min_new_tokens=min_new_tokens, min_length=min_length,
    )  # fmt: skip
    device = input_ids.device
    if acceptance == "sample":
        _check_generators([generator], model.get_output_embeddings().weight.device)
    tree = as_tree(tree).to(device)
    check_tree_fits(tree, heads, model)  # depth <= K, ranks < N
    packed = heads if isinstance(heads, PackedHeads) else PackedHeads(heads)
    eos = set(eos_ids(eos_token_id))

    prompt_len = input_ids.shape[1]
    cached = 0 if cache is None else cache.get_seq_length()
    if cached >= prompt_len:
        raise ValueError(
            f"the cache holds {cached} tokens and input_ids {prompt_len}: pass input_ids that go on from "
            "the cached tokens (the cached ones, then at least one more)"
        )
    keep_cache = cache is not None  # left as generate's cache would be (otherwise: dropped at return)
    limit = context_limit(model) if stop_at_context else None
    budget = max_new_tokens if limit is None else min(max_new_tokens, limit - prompt_len)
    backend = resolve_attention(attention, device, context=prompt_len + max(budget, 0), model=model)
    if tree.num_nodes > tree.max_depth + 1:  # a chain's node indices are its depths
        check_cache_positions(model, prompt_len + max(budget, 0) + tree.num_nodes)
    if budget <= 0:
        return MedusaOutput(tokens=torch.empty(0, dtype=torch.long), stop_reason="empty")
    stop_at_limit = budget < max_new_tokens

    def accept(node_tokens, tree_tokens: torch.Tensor, logits: torch.Tensor, sub: TreeBuffers):
        # node_tokens: tree_tokens itself, or the same tokens already on the host (greedy reads them).
        if acceptance == "greedy":
            return accept_greedy(node_tokens, logits, sub)
        if acceptance == "typical":
            return accept_typical(
                tree_tokens,
                logits,
                sub,
                temperature=temperature,
                posterior_threshold=posterior_threshold,
                posterior_alpha=posterior_alpha,
            )
        return accept_sample(
            tree_tokens,
            logits,
            sub,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            generator=generator,
            min_p=min_p,
        )

    # Per-call setup (counted as overhead: it runs inside total_s, outside prefill and forwards).
    # Every step's mask and position ids are cut out of per-tree buffers; the cache never holds more
    # than prompt_len + budget tokens before a verification.
    # With a kernel: no mask at all, the tree's ancestor bits and the row's past length instead.
    kernel = backend != "sdpa"
    if kernel:
        tree_mask = TreeMask.of(tree)
        no_pad = torch.zeros(1, dtype=torch.int32, device=device)  # (1,)
        positions = layer_positions(model)  # each layer's type, where its attention does not say it
        text_config = model.config.get_text_config()  # its layer_types: the layers the window applies to
        window = model_window(model)  # the window its masks apply (once: it reads the model's classes)
        chunk = attention_chunk(model)  # the chunk of its chunked layers
    else:
        inputs = _tree_inputs(model, tree, prompt_len + budget, next(model.parameters()).dtype)
    # A chain (every node is rank 0) on the CPU: topk(1) of each head writes straight into a buffer
    # that a numpy array shares, [root, head 1 top-1, ..., head D top-1], so the step builds no
    # tensor and its tokens are on the host for the acceptance. Elsewhere: topk, cat and a gather on
    # the device, no sync before the forward.
    host_chain = tree.topk == 1 and device.type == "cpu"
    if host_chain:
        chain_np = np.empty(tree.num_nodes, dtype=np.int64)
        chain_tokens = torch.from_numpy(chain_np)  # (M,), the same memory
        chain_views: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

        def chain_out(m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            """topk's ``out=`` for a chain of m nodes: values ``(m - 1, 1)``, indices in the buffer."""
            if (m, dtype) not in chain_views:
                values = torch.empty(m - 1, 1, dtype=dtype)
                chain_views[m, dtype] = (values, chain_tokens[1:m].view(m - 1, 1))
            return chain_views[m, dtype]

    # 1. Prefill: the prompt goes into the cache; keep the last position's logits and hidden state.
    t0 = _now(device)
    cache = DynamicCache() if cache is None else cache
    # positions 0..T-1 given, as generate and the tree steps give them (RoBERTa's own start past its pad id);
    # those of the tokens a given cache holds, [0, cached), are not run again
    prompt_positions = torch.arange(cached, prompt_len, device=device)[None]  # (1, T - cached)
    logits, hidden = _forward(
        model, cache, input_ids[:, cached:], None, prompt_positions, logits_to_keep=1
    )  # (1, 1, V), (1, T - cached, d)
    hidden = hidden[0, -1]  # (d,)
    last = logits[0, -1]  # (V,)
    processors = RowProcessors(
        1, last.shape[-1], tree, device,
        repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens, min_length=min_length,
    )  # fmt: skip
    if processors.active:  # the repetition penalty, the minimum length
        processors.set_eos(sorted(eos))
        processors.start_row(0, input_ids[0])
        last = processors.prompt_logits(last[None], [0])[0]
    # 2. The first root: the backbone's own choice after the prompt.
    root = first_token(
        last, acceptance, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator, min_p=min_p
    )
    prefill_s = _now(device) - t0
    del logits

    tokens: list[int] = []
    lengths: list[int] = []
    forwards = SpanTimer(device)
    num_forwards = 0
    stop_reason = "context" if stop_at_limit else "max_new_tokens"
    while True:
        past_len = prompt_len + len(tokens)  # tokens in the cache; the root is not yet in it
        room = budget - len(tokens)  # >= 1: tokens we may still emit, root included
        # 3. A root that is EOS or the last allowed token is emitted without a forward.
        if root in eos or room == 1:
            tokens.append(root)
            lengths.append(1)
            if on_tokens is not None:
                on_tokens([root])
            if root in eos:
                stop_reason = "eos"
            break
        # 4. Candidates: the first D heads in one batched product on the last hidden state; nodes
        #    deeper than room - 1 could not be emitted (and might pass the position limit), so cut them.
        sub = tree if room > tree.max_depth else tree.prefix(room - 1)
        m = sub.num_nodes
        host_tokens = None  # the M tokens as host ints, when known without a device-to-host copy
        if sub.max_depth == 0:
            tree_tokens = torch.tensor([root], device=device)  # (1,)
        else:
            head_logits = packed.logits(hidden, sub.max_depth)  # (D, V)
            if host_chain:
                chain_np[0] = root
                values, indices = chain_out(m, head_logits.dtype)  # (D, 1); indices is chain_tokens[1:m]
                torch.topk(head_logits, 1, dim=-1, out=(values, indices))
                tree_tokens = chain_tokens if m == tree.num_nodes else chain_tokens[:m]  # (M,)
                host_tokens = chain_np[:m].tolist()
            else:
                top = head_logits.topk(sub.topk, dim=-1).indices  # (D, topk)
                flat = torch.cat([torch.tensor([root], device=device), top.view(-1)])  # (1 + D * topk,)
                tree_tokens = flat if tree.topk == 1 else flat[sub.tree_indices]  # (M,)
        # 5. Verify the whole tree in one forward of the backbone; only the model call is timed as
        #    the forward, everything around it counts as the decoder's overhead.
        if kernel:
            position_ids = (past_len + sub.depth)[None]  # (1, M)
            past = torch.full((1,), past_len, dtype=torch.int32, device=device)  # (1,)
            step = TreeStep(past, no_pad, tree_mask.prefix(m), backend, positions, text_config, window, chunk)
            with forwards.span(), tree_step(model, step):
                logits, node_hidden = _forward(model, cache, tree_tokens[None], None, position_ids)
        else:
            mask = inputs.mask(past_len, m)  # (1, 1, M, past + M), contiguous and aligned
            position_ids = inputs.position_ids(past_len, m)  # (1, M), a view
            with forwards.span():
                logits, node_hidden = _forward(model, cache, tree_tokens[None], mask, position_ids)
        num_forwards += 1
        logits, node_hidden = logits[0], node_hidden[0]  # (M, V), (M, d)
        if processors.active:
            logits = processors.node_logits(logits[None], [0], tree_tokens[None], sub.depth, [len(tokens)])[0]
        # 6. Acceptance: the path of nodes to keep, its tokens and the token after it (the next root);
        #    one device-to-host copy.
        result = accept(tree_tokens if host_tokens is None else host_tokens, tree_tokens, logits, sub)
        path, path_tokens = result.path, result.tokens
        # 7. EOS inside the path: emit up to and including it, then stop (a kept cache: with the
        #    entries of the emitted tokens but the last, generate's).
        if eos and not eos.isdisjoint(path_tokens):
            cut = next(j + 1 for j, tok in enumerate(path_tokens) if tok in eos)
            tokens.extend(path_tokens[:cut])
            lengths.append(cut)
            if on_tokens is not None:
                on_tokens(path_tokens[:cut])
            stop_reason = "eos"
            if keep_cache:
                compact_cache(cache, past_len, path[: cut - 1])
            break
        tokens.extend(path_tokens)
        lengths.append(len(path))
        if on_tokens is not None:
            on_tokens(path_tokens)
        if processors.active:
            processors.accepted([0], torch.tensor([path_tokens], device=device))
        if len(tokens) >= budget:
            if keep_cache:
                compact_cache(cache, past_len, path[:-1])
            break
        # 8. Keep the accepted nodes' KV entries in place; no re-forward (a chain prefix moves nothing).
        compact_cache(cache, past_len, path)
        # 9. The last accepted node's hidden state feeds the heads; its successor is the next root.
        hidden = node_hidden[path[-1]]  # (d,)
        root = result.next_token

    return MedusaOutput(
        tokens=torch.tensor(tokens, dtype=torch.long),
        accepted_lengths=lengths,
        num_forwards=num_forwards,
        stop_reason=stop_reason,
        prefill_s=prefill_s,
        forward_s=forwards.seconds(),
        total_s=time.perf_counter() - t_start,
    )
