"""Medusa tree decoding with fixed shapes: one step is a function of preallocated tensors, so it can be
captured once (a CUDA graph, or ``torch.compile``) and replayed for every step of every prompt.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774); the fixed-shape layout follows gpt-fast and vLLM (preallocated KV cache, masks of
fixed width, no host synchronisation inside a step).

What is static. A :class:`StaticDecoder` is built once per (model, heads, tree, capacity):

- the KV cache is allocated once, ``(1, H, C, D)`` per layer (C = ``capacity``); a step writes its M tree
  nodes at columns ``[L, L + M)`` (an ``index_copy_`` at positions held on the device) and attention
  reads all C columns through a ``(1, 1, M, C)`` float mask, masked beyond the current length L;
- the whole tree is verified every step (nodes deeper than the remaining budget are verified too but
  never emitted; their position ids are clamped to the model's last position);
- the cache length L, the root token, the last hidden state, the emitted tokens and the per-step
  accepted lengths live in device tensors; candidates (top-k of the heads, :class:`PackedHeads`),
  greedy acceptance (each node's token against its parent's argmax, the longest accepted root-to-leaf
  row of ``retrieve_indices``), KV compaction (the accepted path's entries gathered to
  ``[L, L + n)``) and the bookkeeping are tensor operations.

What syncs. The host reads the number of emitted tokens (and the new tokens, to look for EOS) once
every ``sync_every`` steps; nothing else leaves the device. Steps run past the stopping point (at most
``sync_every - 1``) are discarded. The prefill (variable prompt length) runs eagerly.

Greedy output equals plain greedy ``generate`` (on the tiny test models exactly; on other models up
to the float rounding of a different attention width, as for :func:`medusa_generate`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..heads import MedusaHeads
from ..hf_compat import cache_kwargs
from .generate import (
    MedusaOutput,
    PackedHeads,
    _check_settings,
    _eos_set,
    _forward,
    _now,
    _sliding_window_kinds,
    context_limit,
)
from .tree import TreeBuffers, as_tree

CAPTURES = ("eager", "compile", "cuda_graph")
SDPA_BACKENDS = ("math", "efficient", "cudnn", "flash")


class _StaticLayer(CacheLayerMixin):
    """One layer of a :class:`StaticKVCache`: ``(1, H, C, D)`` keys/values written at the owner's columns."""

    is_sliding = False

    def __init__(self, owner: StaticKVCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        o = self.owner
        _, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(1, h, o.capacity, d)  # (1, H, C, D)
        self.values = value_states.new_zeros(1, h, o.capacity, value_states.shape[-1])  # (1, H, C, Dv)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the T new entries ``(1, H, T, D)`` at columns ``owner.write_pos`` ``(T,)``; return all C."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pos = self.owner.write_pos
        self.keys.index_copy_(2, pos, key_states)
        self.values.index_copy_(2, pos, value_states)
        return self.keys, self.values  # (1, H, C, D): the mask hides what is not the past or the tree

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.capacity, 0

    def get_seq_length(self) -> int:
        return self.owner.capacity

    def get_max_length(self) -> int:
        return self.owner.capacity


class StaticKVCache(Cache):
    """A KV cache of fixed width: ``(1, H, capacity, D)`` per layer, new entries written at ``write_pos``.

    The decoder sets ``write_pos`` (a ``(T,)`` long device tensor) before each forward; attention always
    reads all ``capacity`` columns, so every forward of the same T has the same shapes.

    Args:
        num_layers: attention layers of the model.
        capacity: columns (prompt + budget + tree nodes of the longest call).
    """

    def __init__(self, num_layers: int, capacity: int) -> None:
        super().__init__(layers=[_StaticLayer(self) for _ in range(num_layers)])
        self.capacity = capacity
        self.write_pos: torch.Tensor | None = None

    def move_entries(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Entry ``src[i]`` is copied to ``dst[i]`` in every layer; all sources are read first."""
        for layer in self.layers:
            layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))  # (1, H, n, D)
            layer.values.index_copy_(2, dst, layer.values.index_select(2, src))


class StaticDecoder:
    """Greedy Medusa decoding (batch 1) whose step has fixed shapes; built once, reused across prompts.

    Args:
        model: a Hugging Face causal LM in eval mode (Llama, Qwen2, Mistral, GPT-2, ... with the "sdpa"
            or "eager" attention implementation); every layer full attention, or every layer the same
            sliding window.
        heads: the Medusa heads (or :class:`PackedHeads`).
        tree: :class:`TreeBuffers` or a list of index paths; verified whole every step.
        capacity: KV columns; a call needs ``prompt + max_new_tokens + tree nodes <= capacity``.
        capture: "eager" (the step as plain tensor ops), "compile" (``torch.compile(step,
            mode=compile_mode)``) or "cuda_graph" (``torch.cuda.CUDAGraph``, captured here; CUDA only).
        compile_mode: ``torch.compile`` mode for capture="compile" (None: the default mode; on CUDA
            "reduce-overhead" adds CUDA graphs).
        sync_every: steps between the host's reads of the emitted tokens (1: stop exactly; more: fewer
            syncs, up to ``sync_every - 1`` wasted steps at the end).
        sdpa_backend: None (PyTorch's choice) or one of "math", "efficient", "cudnn", "flash": the
            scaled-dot-product backend for every forward of this decoder (``torch.nn.attention.sdpa_kernel``).

    Raises:
        ValueError: an unknown capture or backend, cuda_graph off CUDA, a model mixing full and
            sliding-window layers, a flash-attention model, or a capacity too small for the tree.
        TreeError: the tree does not fit the heads.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        heads: MedusaHeads | PackedHeads,
        tree: TreeBuffers | Sequence[Sequence[int]],
        capacity: int,
        *,
        capture: str = "eager",
        compile_mode: str | None = None,
        sync_every: int = 1,
        sdpa_backend: str | None = None,
    ) -> None:
        if capture not in CAPTURES:
            raise ValueError(f"capture must be one of {CAPTURES}, got {capture!r}")
        if sdpa_backend is not None and sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"sdpa_backend must be None or one of {SDPA_BACKENDS}, got {sdpa_backend!r}")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        _check_settings(model, "greedy", 0, 1.0, 1.0)
        self.window, kind = _sliding_window_kinds(model.config)
        if kind == "mixed":
            raise ValueError(
                "the static decoder takes models whose layers all use the same attention (full, or one "
                "sliding window); this one mixes both: use medusa_generate"
            )
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if capture == "cuda_graph" and self.device.type != "cuda":
            raise ValueError(f"capture='cuda_graph' needs a CUDA model, this one is on {self.device}")
        self.tree = as_tree(tree).to(self.device)
        self.tree.check_heads(heads.num_heads, model.get_output_embeddings().weight.shape[0])
        m = self.tree.num_nodes
        if capacity < m + 2:
            raise ValueError(f"capacity {capacity} cannot hold a prompt, a token and the {m}-node tree")
        self.model, self.capacity, self.sync_every = model, capacity, sync_every
        self.packed = heads if isinstance(heads, PackedHeads) else PackedHeads(heads)
        self.limit = context_limit(model)
        self.sdpa_backend = sdpa_backend
        self.capture = capture

        dev, d_depth = self.device, self.tree.max_depth
        # Constants of the step (allocated once: nothing is built from host values inside a step).
        self._cols = torch.arange(capacity, device=dev)  # (C,)
        self._nodes = torch.arange(m, device=dev)  # (M,)
        self._path_steps = torch.arange(d_depth + 1, device=dev)  # (D + 1,)
        self._retrieve = self.tree.retrieve_indices.clamp(min=0)  # (Lf, D + 1)
        self._retrieve_valid = self.tree.retrieve_indices[:, 1:] >= 0  # (Lf, D)
        self._parents = self.tree.parents.clamp(min=0)  # (M,)
        self._root = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) the root placeholder of flat
        # State, updated in place by every step.
        with torch.inference_mode():
            self.cache = StaticKVCache(_num_layers(model), capacity)
            self._cache_kwargs = cache_kwargs(model, self.cache)
            self.length = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) L: tokens in the cache
            self.root = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) next root token
            hidden_size = model.get_output_embeddings().weight.shape[1]
            self.hidden = torch.zeros(hidden_size, dtype=self.dtype, device=dev)  # (d,)
            self.out_tokens = torch.zeros(capacity, dtype=torch.long, device=dev)  # (C,) emitted tokens
            self.num_out = torch.zeros(1, dtype=torch.long, device=dev)  # (1,)
            self.step_lengths = torch.zeros(capacity, dtype=torch.long, device=dev)  # (C,) n per step
            self.num_steps = torch.zeros(1, dtype=torch.long, device=dev)  # (1,)
            # 1. Allocate the cache with a one-token forward (its tensors must exist before a capture).
            self.cache.write_pos = self._cols[:1]
            with self._backend():
                _forward(model, self.cache, self._root[None], self._prefill_mask(1), self._cols[None, :1])
        self._static = [
            self.length,
            self.root,
            self.hidden,
            self.out_tokens,
            self.num_out,
            self.step_lengths,
            self.num_steps,
        ] + [t for layer in self.cache.layers for t in (layer.keys, layer.values)]
        self._run: Callable[[], None] = self._step
        self._graph = None
        if capture == "compile":
            for t in self._static:
                torch._dynamo.mark_static_address(t)
            self._run = torch.compile(self._step, mode=compile_mode)
        elif capture == "cuda_graph":
            self._capture_graph()

    def _backend(self):
        if self.sdpa_backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {
            "math": SDPBackend.MATH,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION,
        }
        return sdpa_kernel(names[self.sdpa_backend])

    @torch.inference_mode()
    def _capture_graph(self) -> None:
        """Warm the step up on a side stream, then capture one step into a CUDA graph (state is reset by
        every call's prefill, so the warm-up steps leave nothing behind)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), self._backend():
            for _ in range(3):
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), self._backend():
            self._step()
        torch.cuda.synchronize(self.device)
        self._graph = graph
        self._run = graph.replay

    def _prefill_mask(self, t: int) -> torch.Tensor:
        """``(1, 1, T, C)`` causal mask of a T-token prompt at columns ``[0, T)`` (windowed if the model is)."""
        q = self._cols[:t, None]  # (T, 1)
        allowed = self._cols[None, :] <= q  # (T, C)
        if self.window is not None:
            allowed &= (q - self._cols[None, :]) < self.window
        return _float_mask(allowed, self.dtype)[None, None]  # (1, 1, T, C)

    def _tree_mask(self, length: torch.Tensor) -> torch.Tensor:
        """``(1, 1, M, C)`` mask of the tree written at ``[L, L + M)`` over the L cached tokens."""
        m = self.tree.num_nodes
        rel = self._cols - length  # (C,) column relative to the tree's first column
        in_tree = (rel >= 0) & (rel < m)  # (C,)
        rel_c = rel.clamp(0, m - 1)  # (C,)
        allowed = (self._cols < length)[None, :] | (
            self.tree.attn_mask[:, rel_c] & in_tree[None, :]
        )  # (M, C)
        if self.window is not None:
            # Distance between the query's position and the key's: L + depth_i - col for the past,
            # depth_i - depth_j inside the tree.
            key_pos = torch.where(in_tree, length + self.tree.depth[rel_c], self._cols)  # (C,)
            allowed &= (length + self.tree.depth[:, None] - key_pos[None, :]) < self.window
        return _float_mask(allowed, self.dtype)[None, None]  # (1, 1, M, C)

    def _step(self) -> None:
        """One Medusa step on the device state: candidates, verification, acceptance, compaction."""
        tree, length = self.tree, self.length
        depth = tree.max_depth
        # 1. Candidates: top-k of the first D heads on the last hidden state, laid out on the tree.
        if depth == 0:
            tree_tokens = self.root  # (1,)
        else:
            head_logits = self.packed.logits(self.hidden, depth)  # (D, V)
            top = head_logits.topk(tree.topk, dim=-1).indices  # (D, topk)
            flat = torch.cat([self.root, top.view(-1)])  # (1 + D * topk,)
            tree_tokens = flat[tree.tree_indices]  # (M,)
        # 2. Verify the whole tree at columns [L, L + M) through a mask of fixed width C.
        positions = length + tree.depth  # (M,)
        if self.limit is not None:
            positions = positions.clamp(max=self.limit - 1)  # nodes past the limit are never emitted
        self.cache.write_pos = (length + self._nodes).clamp(max=self.capacity - 1)  # (M,)
        out = self.model(
            input_ids=tree_tokens[None],
            attention_mask=self._tree_mask(length),
            position_ids=positions[None],
            use_cache=True,
            output_hidden_states=True,
            **self._cache_kwargs,
        )  # the model's own call, as _forward makes it (the cache's name decided here, outside the step)
        logits, hidden = out.logits, out.hidden_states[-1]  # (1, M, V), (1, M, d)
        # 3. Greedy acceptance: a node is accepted when its token is its parent's argmax; the longest
        #    accepted prefix of a root-to-leaf row is the path (siblings hold distinct tokens, so every
        #    row of maximal length carries the same path).
        pred = logits[0].argmax(dim=-1)  # (M,)
        path, n = greedy_path(tree_tokens, pred, self._retrieve, self._retrieve_valid, self._parents)
        last = path.gather(0, n - 1)  # (1,)
        path_tokens = tree_tokens[path]  # (D + 1,)
        # 4. KV compaction: entry L + path[j] moves to L + j (entries past n are stale and masked).
        src = (length + path).clamp(max=self.capacity - 1)  # (D + 1,)
        dst = (length + self._path_steps).clamp(max=self.capacity - 1)  # (D + 1,)
        self.cache.move_entries(src, dst)
        # 5. Emit the path's tokens, record n, seed the next step.
        out_pos = (self.num_out + self._path_steps).clamp(max=self.capacity - 1)  # (D + 1,)
        self.out_tokens.index_copy_(0, out_pos, path_tokens)
        self.step_lengths.index_copy_(0, self.num_steps.clamp(max=self.capacity - 1), n)
        self.num_out.add_(n)
        self.num_steps.add_(1)
        length.add_(n)
        self.root.copy_(pred[last])
        self.hidden.copy_(hidden[0].index_select(0, last)[0])

    @torch.inference_mode()
    def _prefill(self, input_ids: torch.Tensor) -> None:
        """The prompt into columns ``[0, T)`` (eager); the state is reset for a new call."""
        t = input_ids.shape[1]
        self.cache.write_pos = self._cols[:t]
        logits, hidden = _forward(
            self.model, self.cache, input_ids, self._prefill_mask(t), self._cols[None, :t], logits_to_keep=1
        )  # (1, 1, V), (1, T, d)
        self.root.copy_(logits[0, -1].argmax().view(1))
        self.hidden.copy_(hidden[0, -1])
        self.length.fill_(t)
        self.num_out.zero_()
        self.num_steps.zero_()

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> MedusaOutput:
        """Greedy Medusa generation of one prompt; the same result as :func:`medusa_generate` greedy.

        Args:
            input_ids: ``(1, T)`` prompt on the model's device.
            max_new_tokens: most tokens to generate (also stops before ``max_position_embeddings``).
            eos_token_id: one id or several; an EOS is emitted and ends generation.

        Returns:
            :class:`MedusaOutput`; ``num_forwards`` counts the steps run (with ``sync_every > 1``, the
            discarded ones too).

        Raises:
            ValueError: batch size is not 1, an empty prompt, or prompt + budget + tree over capacity.
        """
        t_start = time.perf_counter()
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be (1, T), got {tuple(input_ids.shape)}")
        prompt_len = input_ids.shape[1]
        if prompt_len == 0:
            raise ValueError("input_ids is empty: give at least one prompt token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        budget = max_new_tokens if self.limit is None else min(max_new_tokens, self.limit - prompt_len)
        if budget <= 0:
            return MedusaOutput(tokens=torch.empty(0, dtype=torch.long), stop_reason="empty")
        need = prompt_len + budget + self.tree.num_nodes
        if need > self.capacity:
            raise ValueError(
                f"prompt ({prompt_len}) + max_new_tokens ({budget}) + tree ({self.tree.num_nodes} nodes) "
                f"need capacity {need}; this StaticDecoder has {self.capacity}: build one with capacity >= {need}"
            )
        eos = _eos_set(eos_token_id)
        with self._backend():
            t0 = _now(self.device)
            self._prefill(input_ids)
            prefill_s = _now(self.device) - t0
            tokens: list[int] = []
            steps = 0
            stop_reason = "max_new_tokens" if budget == max_new_tokens else "context"
            while True:
                for _ in range(self.sync_every):
                    self._run()
                steps += self.sync_every
                n = int(self.num_out)  # the host's one read per sync_every steps
                tokens.extend(self.out_tokens[len(tokens) : min(n, budget)].tolist())
                cut = next((i + 1 for i, tok in enumerate(tokens) if tok in eos), None) if eos else None
                if cut is not None:
                    tokens = tokens[:cut]
                    stop_reason = "eos"
                    break
                if len(tokens) >= budget:
                    break
            lengths = _cut_lengths(self.step_lengths[: min(steps, self.capacity)].tolist(), len(tokens))
        total = time.perf_counter() - t_start
        return MedusaOutput(
            tokens=torch.tensor(tokens, dtype=torch.long),
            accepted_lengths=lengths,
            num_forwards=steps,
            stop_reason=stop_reason,
            prefill_s=prefill_s,
            forward_s=0.0,  # the forward is inside the captured step: not timed apart
            total_s=total,
        )


def greedy_path(
    tree_tokens: torch.Tensor,
    pred: torch.Tensor,
    retrieve: torch.Tensor,
    retrieve_valid: torch.Tensor,
    parents: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance as tensor operations (no host sync): the longest path whose every token is its
    parent's prediction.

    Args:
        tree_tokens: ``(M,)`` token of every node.
        pred: ``(M,)`` the token each node predicts for its successor (the argmax of its logits).
        retrieve: ``(Lf, D + 1)`` root-to-leaf node indices, padding clamped to 0.
        retrieve_valid: ``(Lf, D)`` which of entries 1..D of ``retrieve`` are real nodes.
        parents: ``(M,)`` parent node of each node (the root's clamped to 0).

    Returns:
        ``(D + 1,)`` the path's node indices (root first; entries from n on are padding) and ``(1,)`` n,
        the number of accepted nodes, the root included. Siblings hold distinct tokens, so every row of
        maximal accepted length carries the same path.
    """
    ok = tree_tokens == pred[parents]  # (M,)
    ok_rows = ok[retrieve[:, 1:]] & retrieve_valid  # (Lf, D)
    accepted = ok_rows.long().cumprod(dim=1).sum(dim=1)  # (Lf,)
    best = accepted.argmax().view(1)  # (1,); index_select/gather: a 0-d tensor index would sync
    n = accepted.gather(0, best) + 1  # (1,)
    return retrieve.index_select(0, best)[0], n  # (D + 1,), (1,)


def _cut_lengths(step_lengths: list[int], num_tokens: int) -> list[int]:
    """The per-step accepted lengths of the first ``num_tokens`` tokens (the last step cut to fit)."""
    lengths, total = [], 0
    for n in step_lengths:
        if total >= num_tokens:
            break
        lengths.append(min(n, num_tokens - total))
        total += lengths[-1]
    return lengths


def _float_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, dtype-min elsewhere (a new contiguous tensor)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )


def _num_layers(model: torch.nn.Module) -> int:
    config = model.config
    return getattr(config, "num_hidden_layers", None) or config.n_layer


def medusa_generate_static(
    model: torch.nn.Module,
    heads: MedusaHeads | PackedHeads,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    tree: TreeBuffers | Sequence[Sequence[int]],
    eos_token_id: int | Sequence[int] | None = None,
    capture: str = "eager",
    compile_mode: str | None = None,
    sync_every: int = 1,
) -> MedusaOutput:
    """One prompt through a :class:`StaticDecoder` sized for it (build the decoder yourself to reuse a
    capture across prompts). Arguments as :class:`StaticDecoder` and :meth:`StaticDecoder.generate`."""
    capacity = input_ids.shape[1] + max_new_tokens + as_tree(tree).num_nodes
    decoder = StaticDecoder(
        model, heads, tree, capacity, capture=capture, compile_mode=compile_mode, sync_every=sync_every
    )
    return decoder.generate(input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
