"""Medusa tree decoding with fixed shapes: one step is a function of preallocated tensors, so it can be
captured once (a CUDA graph, or ``torch.compile``) and replayed for every step of every prompt.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774); the fixed-shape layout follows gpt-fast and vLLM (preallocated KV cache, masks of
fixed width, no host synchronisation inside a step).

What is static. A :class:`StaticDecoder` is built once per (model, heads, tree, capacity, B rows):

- the KV cache is allocated once, ``(B, H, C, D)`` per layer (C = ``capacity``); each prompt is
  prefilled into its row at ``[0, T_b)`` (eagerly: prompt lengths vary); a step writes row b's M tree
  nodes at its columns ``[L_b, L_b + M)`` (one indexed write, positions held on the device) and
  attention reads all C columns through a ``(B, 1, M, C)`` float mask, masked beyond each row's L_b
  (one per layer type for a model whose layers window or chunk differently, :func:`layer_mask_rules`,
  all built from the same device tensors);
- the whole tree is verified every step (nodes deeper than the remaining budget are verified too but
  never emitted; their position ids are clamped to the model's last position), by every row until the
  last row stops (a finished row's steps are discarded);
- each row's cache length, root token, last hidden state, emitted tokens and per-step accepted
  lengths live in device tensors; candidates (top-k of the heads, :class:`PackedHeads`), acceptance
  (greedy: each node's token against its parent's argmax, the longest accepted root-to-leaf row of
  ``retrieve_indices``, :func:`greedy_path`; sampling: the same walk against one draw per node,
  :func:`draw_tokens`; or Medusa's typical acceptance, :func:`typical_path`), KV
  compaction (the accepted path's entries gathered to ``[L_b, L_b + n_b)``) and the bookkeeping are
  tensor operations.

Tree attention. With ``attention="sdpa"`` the model's own attention reads all C columns through the
mask above. With a kernel (``"triton"``, ``"cuda"``; :mod:`.attention`) the step's forward builds no
mask: each layer's kernel reads row b's past ``[0, L_b)`` and its M tree columns ``[L_b, L_b + M)`` of
the same ``(B, H, C, D)`` cache through the tree's ancestor bits (windowed for a sliding layer: the bits
of every window the layer types name are built with the decoder), with the rows' L_b in a persistent
int32 device tensor updated in place by the step, so a replay reads the current lengths and the
kernel's grid depends only on shapes. The prefill runs the model's own attention either way.

What syncs. The host reads the rows' numbers of emitted tokens (and their new tokens, to look for EOS;
sampling: and where a row's draws met NaN probabilities, to raise as ``generate`` does) once every
``sync_every`` steps; nothing else leaves the device. The prefill runs eagerly.

Greedy output equals plain greedy ``generate`` (on the tiny test models exactly; on other models up
to the float rounding of a different attention width, as for :func:`medusa_generate`); typical output
equals :func:`medusa_generate` with ``acceptance="typical"`` at the same temperature and thresholds;
sampled output has the distribution of ``generate(do_sample=True)`` at the same temperature, top_k and top_p
(draws from torch's default generator of the device: seed it with ``torch.manual_seed``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
from collections.abc import Callable, Collection, Sequence

import torch
from transformers.cache_utils import Cache

from ..heads import MedusaHeads
from ..hf_compat import cache_kwargs
from .acceptance import warp_probs
from .attention import (
    STEP_KWARG,
    TreeMask,
    TreeStep,
    attention_chunk,
    layer_positions,
    model_lock,
    model_window,
    on_device,
    one_call_per_model,
    packed_sdpa,
    resolve_attention,
    sliding_window_kinds,
    tree_step,
)
from .batched import (
    MedusaBatchOutput,
    PreallocatedLayer,
    _num_layers,
    check_one_device,
    kv_reusing_layers,
    preallocated_layers,
    row_entries,
    shared_storage,
)
from .generate import (
    MedusaOutput,
    PackedHeads,
    _check_settings,
    _forward,
    _now,
    check_cache_positions,
    check_tree_fits,
    context_limit,
    eos_ids,
    last_hidden_state_tied,
)
from .processors import RowProcessors
from .tree import TreeBuffers, as_tree

CAPTURES = ("eager", "compile", "cuda_graph")
GRAPHED_COMPILE_MODES = ("reduce-overhead", "max-autotune")
"""``torch.compile`` modes that replay the compiled step as CUDA graphs on CUDA (``attention="auto"``
then chooses as for ``capture="cuda_graph"``)."""
STATIC_ACCEPTANCE = ("greedy", "typical", "sample")
SDPA_BACKENDS = ("math", "efficient", "cudnn")
"""What ``sdpa_backend`` may force. Not flash attention: on CUDA it takes no mask, and every forward of
this decoder has one (the prompt's, the tree's)."""


def host_synced_rope(model: torch.nn.Module) -> bool:
    """Whether a rotary embedding of ``model`` decides on the host, at every forward, which frequencies
    to use: transformers' dynamic NTK RoPE (``if seq_len > max_seq_len_cached``) and, in some
    transformers 5 releases, LongRoPE (``if seq_len > original_max_position_embeddings``, then a new
    buffer; later releases pick with ``torch.where`` in place). A CUDA graph cannot capture that read
    (nor replay a decision it made once); ``torch.compile`` and the eager step run it.

    Probed, not read from the config: one forward of each rotary embedding (a module with a
    ``rope_type``; each layer type's) on two positions, watched for reads of a tensor's value to the
    host. A rotary embedding the probe cannot call counts as host-synced unless its type is the
    default one."""
    for module in model.modules():
        kind = getattr(module, "rope_type", None)
        if kind is None:
            continue
        for layer_type in list(kind) if isinstance(kind, dict) else [None]:
            named = kind[layer_type] if layer_type is not None else kind
            try:
                if _reads_host(module, layer_type):
                    return True
            except Exception:  # noqa: BLE001 - a signature the probe does not know: judge by the name
                if named != "default":
                    return True
    return False


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operations that read a tensor's value back to the host (``bool(t)``, ``t.item()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _reads_host(rotary: torch.nn.Module, layer_type: str | None) -> bool:
    """Whether one forward of ``rotary`` (transformers' ``forward(x, position_ids[, layer_type])``) reads
    a value to the host. It may update the module's frequencies for the two positions: the model's
    next forward updates them for its own."""
    param = next(rotary.parameters(), None)
    buffer = next(rotary.buffers(), None)
    device = (param if param is not None else buffer).device
    x = torch.zeros(1, 1, 1, device=device)
    positions = torch.arange(2, device=device)[None]
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    spy = _HostReads()
    with torch.no_grad(), spy:
        rotary(x, positions, **kwargs)
    return spy.reads > 0


class _StaticLayer(PreallocatedLayer):
    """One layer of a :class:`StaticKVCache`: ``(B, H, C, D)`` keys/values written where the owner says."""

    def rows(self, batch: int) -> int:
        return self.owner.num_rows  # the first update is a one-row prefill

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new entries; return every column of the rows written.

        A prefill (``owner.prefill_row`` set) writes one row's ``(1, H, T, D)`` at columns
        ``owner.write_pos`` ``(T,)``; a step writes every row's ``(B, H, M, D)`` at ``owner.write_cols``
        ``(B, M)``.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        if o.prefill_row is not None:
            keys, values = self.keys[o.prefill_row, None], self.values[o.prefill_row, None]  # (1, H, C, D)
            keys.index_copy_(2, o.write_pos, key_states)
            values.index_copy_(2, o.write_pos, value_states)
            return keys, values
        # (B, M, H, D) through advanced indexing on rows and columns at once.
        self.keys[o.rows, :, o.write_cols] = key_states.transpose(1, 2)
        self.values[o.rows, :, o.write_cols] = value_states.transpose(1, 2)
        return self.keys, self.values  # (B, H, C, D): the mask hides what is not the past or the tree

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.capacity, 0

    def get_seq_length(self) -> int:
        return self.owner.capacity

    def get_max_length(self) -> int:
        return self.owner.capacity


class StaticKVCache(Cache):
    """A KV cache of fixed shape: ``(B, H, capacity, D)`` per layer.

    Before each forward the decoder sets either ``prefill_row`` (an int) and ``write_pos`` ``(T,)``
    (one row's prompt), or ``prefill_row = None`` and ``write_cols`` ``(B, M)`` (a step: each row's
    tree columns); attention always reads all ``capacity`` columns, so every step has the same shapes.

    Args:
        num_layers: attention layers of the model.
        capacity: columns per row (prompt + budget + tree nodes of the longest row).
        batch_size: rows.
        device: where the row index lives.
        shared: every layer's keys and values in one tensor when their shapes agree
            (:class:`~.batched.PreallocatedLayer`).
        reusing: layers that read an earlier layer's KV and keep none (:func:`~.batched.kv_reusing_layers`).
    """

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        batch_size: int,
        device: torch.device,
        shared: bool = True,
        reusing: Collection[int] = (),
    ) -> None:
        super().__init__(layers=preallocated_layers(self, _StaticLayer, num_layers, reusing))
        self.shared = shared
        self.capacity, self.num_rows = capacity, batch_size
        self.rows = torch.arange(batch_size, device=device)[:, None]  # (B, 1)
        self.prefill_row: int | None = None
        self.write_pos: torch.Tensor | None = None
        self.write_cols: torch.Tensor | None = None
        # Not under torch.compile (shared=False): inductor failed on static inputs that are views of
        # one tensor ("Storage size calculation overflowed", torch 2.13 on a CPU).
        self.storage: torch.Tensor | None = None  # (L, 2, B, H, C, D): see PreallocatedLayer

    def move_entries(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """In every row b and layer, entry ``src[b, i]`` is copied to ``dst[b, i]`` (``(B, n)`` each);
        all sources are read before any destination is written."""
        kv = shared_storage(self)
        if kv is not None:
            kv[:, :, self.rows, :, dst] = kv[:, :, self.rows, :, src]  # (B, n, L, 2, H, D)
            return
        for layer in self.kv_layers:
            layer.keys[self.rows, :, dst] = layer.keys[self.rows, :, src]  # (B, n, H, D)
            layer.values[self.rows, :, dst] = layer.values[self.rows, :, src]


def layer_mask_rules(model: torch.nn.Module, capacity: int) -> dict[str, tuple[int | None, int | None]]:
    """Each attention layer type of a model and the rule ``(window, chunk)`` its masks add to the causal
    or tree rule on a cache of ``capacity`` columns: a query sees a key only if their positions differ
    by less than ``window``, and only from the first position of the query's chunk of ``chunk``
    positions on (None: no such limit).

    Read as the dynamic decoders read them: ``"sliding_attention"`` layers take the window the model
    applies (:func:`~.attention.sliding_window_kinds`: the text config's ``sliding_window``, where the
    model's code reads it), ``"chunked_attention"`` layers the text config's ``attention_chunk_size``
    (:func:`attention_chunk`, where the model's code reads it; none where the capacity stays inside the
    first chunk: no position there passes a chunk's end; no window either where it spans the
    capacity, so such a model's layers share one mask), ``"full_attention"`` layers neither; a model
    without ``layer_types`` has one type, sliding if it has a window, else full. Types of other kinds
    are left out: the decoders refuse a model that has them (:func:`~.attention.unserved_layer_types`).
    """
    config = model.config
    window, _ = sliding_window_kinds(model)
    if window is not None and window >= capacity:  # no two positions of the cache are that far apart
        window = None
    chunk = attention_chunk(model)
    if chunk is not None and capacity <= chunk:
        chunk = None
    known = {
        "full_attention": (None, None),
        "sliding_attention": (window, None),
        "chunked_attention": (None, chunk),
    }
    types = getattr(config.get_text_config(), "layer_types", None) or [
        "sliding_attention" if window else "full_attention"
    ]
    rules = {kind: known[kind] for kind in dict.fromkeys(types) if kind in known}
    return rules or {"full_attention": known["full_attention"]}


class StaticDecoder:
    """Medusa decoding of up to B rows whose step has fixed shapes; built once, reused across prompts.

    Args:
        model: a Hugging Face causal LM in eval mode (Llama, Qwen2, Mistral, GPT-2, ... with the "sdpa"
            or "eager" attention implementation); full attention, a sliding window or chunks on every
            layer, or layers of several of these by ``config.layer_types`` (Gemma 2/3, Cohere 2,
            gpt-oss, Llama 4), each type its own mask (:func:`layer_mask_rules`).
        heads: the Medusa heads (or :class:`PackedHeads`).
        tree: :class:`TreeBuffers` or a list of index paths; verified whole every step.
        capacity: KV columns per row; a row needs ``prompt + max_new_tokens + tree nodes <= capacity``.
        batch_size: B, rows decoded together (a call with fewer prompts fills the rest with a dummy).
        capture: "eager" (the step as plain tensor ops), "compile" (``torch.compile(step,
            mode=compile_mode)``) or "cuda_graph" (``torch.cuda.CUDAGraph``, captured here; CUDA only).
        compile_mode: ``torch.compile`` mode for capture="compile" (None: the default mode; on CUDA
            "reduce-overhead" adds CUDA graphs).
        sync_every: steps between the host's reads of the emitted tokens (1: stop exactly; more: fewer
            syncs, up to ``sync_every - 1`` wasted steps at the end).
        sdpa_backend: None (PyTorch's choice) or one of :data:`SDPA_BACKENDS`: the scaled-dot-product
            backend of the step's forwards (``torch.nn.attention.sdpa_kernel``); the prefill takes
            the decoders' usual one (:func:`~medusa_train.decoding.generate.attention_backends`).
        attention: tree attention of the step's forward: "sdpa" (the model's attention with the
            ``(B, 1, M, C)`` mask), "triton" or "cuda" (a kernel of :mod:`medusa_train.decoding.attention`
            reading each row's past and tree, no mask), or "auto" (:func:`resolve_attention` with the
            capacity as the context; sdpa on a CPU). The prefill always runs the model's own attention.
        acceptance: "greedy" (each node against its parent's argmax: plain greedy decoding),
            "typical" (Medusa's typical acceptance, :func:`typical_path`, inside the step: the same
            tokens as ``medusa_generate(acceptance="typical")``) or "sample" (each node against a draw
            from its parent's distribution, :func:`draw_tokens`: exact sampling, the distribution of
            ``generate(do_sample=True)``).
        temperature: the temperature of "typical" and "sample" (0: greedy).
        top_p: nucleus filtering of "sample".
        top_k: top-k filtering of "sample", before top_p as ``generate`` applies them (0: none).
        min_p: min-p filtering of "sample", after top_p as ``generate`` applies it (0: none).
        posterior_threshold: epsilon of "typical".
        posterior_alpha: delta of "typical" (threshold = min(epsilon, delta * exp(-H))).
        repetition_penalty: ``generate``'s repetition penalty (1: none), on every node's logits
            before the rule (:mod:`medusa_train.decoding.processors`; each row's token set is state of
            the step, as its cache is).
        min_new_tokens, min_length: ``generate``'s minimum lengths (new tokens; tokens in all, the
            prompt counted): EOS is masked in the step where it would end a row earlier (0: none).
        stop_at_context: rows stop before the model's ``max_position_embeddings``; False: they go on
            past it, as ``generate`` does, for a model whose positions go on
            (:func:`~medusa_train.decoding.generate.position_bound` None).

    Raises:
        ValueError: an unknown capture, backend or acceptance rule, a negative temperature or
            threshold, cuda_graph off CUDA, a flash-attention model, a model spread over several
            devices, or a capacity too small for the tree.
        AttentionBackendError: ``attention`` names a kernel that cannot run here, or the model is one
            no tree verification computes (ALiBi; layers of a type other than full, sliding-window or
            chunked attention: :func:`~.attention.unserved_layer_types`; a recurrent state:
            :func:`~.attention.stateful_model`; no position ids: :func:`~.attention.positionless_model`;
            masks of its own: XLM; attention both ways: :func:`~.attention.attends_both_ways`, the BERT
            family without ``is_decoder=True``; Llama 4's query scaling past ``floor_scale - 1``).
        TreeError: the tree does not fit the heads.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        heads: MedusaHeads | PackedHeads,
        tree: TreeBuffers | Sequence[Sequence[int]],
        capacity: int,
        *,
        batch_size: int = 1,
        capture: str = "eager",
        compile_mode: str | None = None,
        sync_every: int = 1,
        sdpa_backend: str | None = None,
        attention: str = "sdpa",
        acceptance: str = "greedy",
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        posterior_threshold: float = 0.09,
        posterior_alpha: float = 0.3,
        repetition_penalty: float = 1.0,
        min_p: float = 0.0,
        min_new_tokens: int = 0,
        min_length: int = 0,
        stop_at_context: bool = True,
    ) -> None:
        if capture not in CAPTURES:
            raise ValueError(f"capture must be one of {CAPTURES}, got {capture!r}")
        if sdpa_backend is not None and sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"sdpa_backend must be None or one of {SDPA_BACKENDS}, got {sdpa_backend!r}")
        if sync_every < 1 or batch_size < 1:
            raise ValueError(f"sync_every and batch_size must be >= 1, got {sync_every} and {batch_size}")
        if acceptance not in STATIC_ACCEPTANCE:
            raise ValueError(
                f"the static decoder's acceptance must be one of {STATIC_ACCEPTANCE}, got {acceptance!r}"
            )
        if not (posterior_threshold >= 0 and posterior_alpha >= 0):
            raise ValueError(
                "posterior_threshold and posterior_alpha must be >= 0, got "
                f"{posterior_threshold} and {posterior_alpha}"
            )
        _check_settings(
            model, acceptance, 0,
            temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
            min_p=min_p, min_new_tokens=min_new_tokens, min_length=min_length,
        )  # fmt: skip
        check_one_device(model, "StaticDecoder")
        if capture == "cuda_graph" and host_synced_rope(model):
            raise ValueError(
                "capture='cuda_graph' cannot capture this model's RoPE (it decides on the host, every "
                "forward, which frequencies to use: dynamic NTK, or LongRoPE in some transformers "
                "releases): use capture='eager'"
            )
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if capture == "cuda_graph" and self.device.type != "cuda":
            raise ValueError(f"capture='cuda_graph' needs a CUDA model, this one is on {self.device}")
        self.tree = as_tree(tree).to(self.device)
        check_tree_fits(self.tree, heads, model)  # depth <= K, ranks < N
        m = self.tree.num_nodes
        if capacity < m + 2:
            raise ValueError(f"capacity {capacity} cannot hold a prompt, a token and the {m}-node tree")
        self.model, self.capacity, self.batch_size, self.sync_every = model, capacity, batch_size, sync_every
        self.packed = heads if isinstance(heads, PackedHeads) else PackedHeads(heads)
        self.limit = context_limit(model) if stop_at_context else None
        self.sdpa_backend = sdpa_backend
        self.capture = capture
        graphed = capture == "cuda_graph" or (capture == "compile" and compile_mode in GRAPHED_COMPILE_MODES)
        self.attention = resolve_attention(
            attention, self.device, context=capacity, captured=graphed, model=model
        )
        check_cache_positions(model, capacity + m)  # every forward counts from the capacity
        # Each layer type's (window, chunk), read once the model is known to be one the decoders serve:
        # the masks of the prefill and the step, one per rule; the step computes positions for them only
        # where a rule reads positions.
        self._rules = layer_mask_rules(model, capacity)
        self._positional = any(rule != (None, None) for rule in self._rules.values())

        dev, d_depth, b = self.device, self.tree.max_depth, batch_size
        # Constants of the step (allocated once: nothing is built from host values inside a step).
        self._cols = torch.arange(capacity, device=dev)  # (C,)
        self._nodes = torch.arange(m, device=dev)  # (M,)
        self._path_steps = torch.arange(d_depth + 1, device=dev)  # (D + 1,)
        self._retrieve = self.tree.retrieve_indices.clamp(min=0)  # (Lf, D + 1)
        self._retrieve_valid = self.tree.retrieve_indices[:, 1:] >= 0  # (Lf, D)
        self._parents = self.tree.parents.clamp(min=0)  # (M,)
        self._row_ids = torch.arange(b, device=dev)  # (B,)
        # The acceptance rule of the step, chosen once (typical at temperature 0, or without candidates,
        # is greedy; so is sampling at temperature 0): what each node predicts for its successor (the
        # argmax, or a draw), and the path accepted against it.
        # _predict returns the tokens and, for draws, whether each had a distribution to draw from.
        self._predict: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] = _argmax
        self._draws = acceptance == "sample" and temperature > 0
        self.temperature = temperature
        if self._draws:
            # On a CPU the eager step may read the device (free there) to rank fewer scores for top-p.
            self._predict = functools.partial(
                draw_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                host_sync=capture == "eager" and self.device.type == "cpu",
            )
        self._accept: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
        self._accept = self._accept_greedy
        if acceptance == "typical" and temperature > 0 and d_depth > 0:
            self._internal, self._parent_slot = typical_nodes(self.tree)  # (P,), (M,)
            self._typical_settings = dict(
                temperature=temperature,
                posterior_threshold=posterior_threshold,
                posterior_alpha=posterior_alpha,
            )
            self._accept = self._accept_typical
        # The kernels' view of the step: the same tensors every step (a replay reads them in place).
        self._kernel_step: TreeStep | None = None
        if self.attention != "sdpa":
            past = torch.zeros(b, dtype=torch.int32, device=dev)  # (B,) column of each row's first node
            starts = torch.zeros(b, dtype=torch.int32, device=dev)  # (B,) prompts start at column 0
            self._kernel_step = TreeStep(
                past,
                starts,
                TreeMask.of(self.tree),
                self.attention,
                layer_positions(model),
                model.config.get_text_config(),
                model_window(model),
                # the chunk of the masks' rule: none where the capacity stays inside the first chunk
                self._rules.get("chunked_attention", (None, None))[1],
            )
        # The ancestor bits of every window a layer may ask the kernel for (a chunk's are the kernel's:
        # they depend on the past), built now, not inside a capture or a trace; one per distinct window.
        # A layer's window is its type's rule here (layer_window; a layer passing another is refused);
        # one spanning the capacity spans the tree too, whose own bits it then reads.
        self._kernel_bits: list[torch.Tensor] = []
        if self._kernel_step is not None:
            built = (self._kernel_step.mask.bits_for(window) for window, _ in self._rules.values())
            self._kernel_bits = list({id(bits): bits for bits in built}.values())
        # Handed to the attention layers as a forward argument too, which torch.compile can trace (a
        # forward without **kwargs gets none: its layers read the step of tree_step).
        passes = self._kernel_step is not None and _takes_extra_kwargs(type(model))
        self._step_kwargs = {STEP_KWARG: self._kernel_step} if passes else {}
        # State, updated in place by every step.
        with torch.inference_mode():
            self.cache = StaticKVCache(
                _num_layers(model),
                capacity,
                b,
                dev,
                shared=capture != "compile",
                reusing=kv_reusing_layers(model),
            )
            self._cache_kwargs = cache_kwargs(model, self.cache)
            self.length = torch.zeros(b, dtype=torch.long, device=dev)  # (B,) L: tokens in each row's cache
            self.root = torch.zeros(b, dtype=torch.long, device=dev)  # (B,) next root token
            # (B, d) each row's last hidden state, what the heads read: sized by the one-token forward
            # below (d is what the forward returns, not what the LM head reads: ELECTRA's and RemBERT's
            # prediction heads map it to another width first)
            self.hidden = torch.zeros(b, 0, dtype=self.dtype, device=dev)
            self.out_tokens = torch.zeros(b, capacity, dtype=torch.long, device=dev)  # (B, C) emitted
            self.num_out = torch.zeros(b, dtype=torch.long, device=dev)  # (B,)
            # (B,) each row's first new-token index drawn from NaN probabilities (capacity: none); the
            # host raises once it keeps such a token, as generate's multinomial raises on drawing it.
            self.bad_from = torch.full((b,), capacity, dtype=torch.long, device=dev)
            self.budget = torch.zeros(b, dtype=torch.long, device=dev)  # (B,) tokens each row may emit
            self.step_lengths = torch.zeros(b, capacity, dtype=torch.long, device=dev)  # (B, C) n per step
            self.num_steps = torch.zeros(1, dtype=torch.long, device=dev)  # (1,)
            # The repetition penalty and minimum length: each row's tokens so far, its EOS bound.
            self.processors = RowProcessors(
                b, model.get_output_embeddings().weight.shape[0], self.tree, dev,
                repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens, min_length=min_length,
            )  # fmt: skip
            # 1. Allocate the cache with a one-token forward (its tensors must exist before a capture).
            with model_lock(model), _own_rng(dev):  # another thread's call on the model: after it
                self._prefill_row(0, self._row_ids[None, :1])
        self._static = [
            self.length,
            self.root,
            self.hidden,
            self.out_tokens,
            self.num_out,
            self.bad_from,
            self.budget,
            self.step_lengths,
            self.num_steps,
        ] + [t for layer in self.cache.kv_layers for t in (layer.keys, layer.values)]
        self._static += self.processors.state()
        if self._kernel_step is not None:  # the kernels' inputs: the past lengths change every step
            step = self._kernel_step
            self._static += [step.past_lens, step.starts, *self._kernel_bits, step.mask.depth]
        self._run: Callable[[], None] = self._step
        self._graph = None
        self._captured_weights: tuple[int, ...] = ()
        if capture == "compile":
            for t in self._static:
                torch._dynamo.mark_static_address(t)
            self._run = torch.compile(self._step, mode=compile_mode)
        elif capture == "cuda_graph":
            # captured on (and replayed from) the model's device
            with model_lock(model), _own_rng(dev), on_device(dev):
                self._capture_graph()

    def _backend(self):
        if self.sdpa_backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {
            "math": SDPBackend.MATH,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
        }
        return sdpa_kernel(names[self.sdpa_backend])

    def _tied(self) -> contextlib.AbstractContextManager:
        """The step's forward returning as ``hidden_states[-1]`` what the heads read, its decoder's
        ``last_hidden_state`` (:func:`last_hidden_state_tied`). Held around every run of the step, its
        capture and its compilation."""
        return last_hidden_state_tied(self.model)

    def _tree_attention(self) -> contextlib.AbstractContextManager:
        """Where the step's forward runs: the model's SDPA on the step's mask (:func:`packed_sdpa`:
        a grouped-query layer's K/V not expanded), or the kernel of ``attention`` (:func:`tree_step`).
        Either switches the model's attention implementation for the block and restores it after.
        Held around every run of the step, its capture and its compilation."""
        if self._kernel_step is None:
            return packed_sdpa(self.model)
        return tree_step(self.model, self._kernel_step)

    @torch.inference_mode()
    def _capture_graph(self) -> None:
        """Warm the step up on a side stream, then capture one step into a CUDA graph (state is reset by
        every call's prefill, so the warm-up steps leave nothing behind)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), self._backend(), self._tree_attention(), self._tied():
            for _ in range(3):
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), self._backend(), self._tree_attention(), self._tied():
            self._step()
        torch.cuda.synchronize(self.device)
        self._graph = graph
        self._run = graph.replay
        self._captured_weights = weight_addresses(self.model)

    def _recapture_if_moved(self) -> None:
        """Capture the step again if the model's weights have moved since the capture (a graph replays
        the addresses it was captured with: after ``model.cpu(); model.cuda()`` or a state dict loaded
        with ``assign=True`` they hold freed memory, and a replay would read garbage).

        Raises:
            ValueError: the model is on another device now (the decoder's own state is not).
        """
        device = next(self.model.parameters()).device
        if device != self.device:
            raise ValueError(
                f"the model moved from {self.device} to {device}: build a new StaticDecoder there"
            )
        if self._graph is None or weight_addresses(self.model) == self._captured_weights:
            return
        with _own_rng(self.device), on_device(self.device):
            self._capture_graph()

    def _prefill_mask(self, t: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """``(1, 1, T, C)`` causal mask of a T-token prompt at columns ``[0, T)`` (windowed, or cut to
        chunks, if the model is; one per layer type where its layers differ)."""
        q = self._cols[:t, None]  # (T, 1) positions
        allowed = self._cols[None, :] <= q  # (T, C)
        return self._masks(allowed[None, None], q[None, None], self._cols[None, None, None, :])

    def _tree_mask(self) -> torch.Tensor | dict[str, torch.Tensor]:
        """``(B, 1, M, C)``: row b's tree written at ``[L_b, L_b + M)`` over its L_b cached tokens (one
        per layer type where its layers differ)."""
        m, length = self.tree.num_nodes, self.length[:, None]  # (B, 1)
        rel = self._cols[None, :] - length  # (B, C) column relative to the row's first tree column
        in_tree = (rel >= 0) & (rel < m)  # (B, C)
        rel_c = rel.clamp(0, m - 1)  # (B, C)
        tree_part = self.tree.attn_mask[:, rel_c].transpose(0, 1) & in_tree[:, None, :]  # (B, M, C)
        allowed = (self._cols[None, :] < length)[:, None, :] | tree_part  # (B, M, C)
        if not self._positional:
            return self._masks(allowed[:, None], None, None)
        # Positions: the column in the past, L + depth inside the tree.
        key_pos = torch.where(in_tree, length + self.tree.depth[rel_c], self._cols[None, :])  # (B, C)
        query_pos = length + self.tree.depth[None, :]  # (B, M)
        return self._masks(allowed[:, None], query_pos[:, None, :, None], key_pos[:, None, None, :])

    def _masks(
        self, allowed: torch.Tensor, query_pos: torch.Tensor | None, key_pos: torch.Tensor | None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The float masks of ``allowed`` ``(N, 1, Q, C)`` (the causal or tree rule) under each layer
        type's rule (:attr:`_rules`), from the queries' positions ``(N, 1, Q, 1)`` and the keys'
        ``(N, 1, 1, C)`` (None where no rule reads them): one tensor where every layer type has the
        same rule, else a dict keyed by layer type, the model's per-layer-type masks (its types of one
        rule share a tensor). Every operand is a tensor of the step: nothing is read from the host."""
        built: dict[tuple[int | None, int | None], torch.Tensor] = {}
        for window, chunk in dict.fromkeys(self._rules.values()):
            rule = allowed
            if window is not None:
                rule = rule & ((query_pos - key_pos) < window)
            if chunk is not None:  # keys from the first position of the query's chunk on
                rule = rule & (key_pos >= query_pos - query_pos % chunk)
            built[window, chunk] = _float_mask(rule, self.dtype)
        if len(built) == 1:
            return next(iter(built.values()))
        return {kind: built[rule] for kind, rule in self._rules.items()}

    def _step(self) -> None:
        """One Medusa step of every row on the device state: candidates, verification, acceptance,
        compaction."""
        tree, length, b = self.tree, self.length, self.batch_size
        depth = tree.max_depth
        # 1. Candidates: top-k of the first D heads on each row's last hidden state, laid out on the tree.
        if depth == 0:
            tree_tokens = self.root[:, None]  # (B, 1)
        else:
            head_logits = self.packed.logits_rows(self.hidden, depth)  # (B, D, V)
            top = head_logits.topk(tree.topk, dim=-1).indices  # (B, D, topk)
            flat = torch.cat([self.root[:, None], top.view(b, -1)], dim=1)  # (B, 1 + D * topk)
            tree_tokens = flat[:, tree.tree_indices]  # (B, M)
        # 2. Verify every row's tree at its columns [L, L + M) through a mask of fixed width C.
        positions = length[:, None] + tree.depth  # (B, M)
        if self.limit is not None:
            positions = positions.clamp(max=self.limit - 1)  # nodes past the limit are never emitted
        self.cache.write_cols = (length[:, None] + self._nodes).clamp(max=self.capacity - 1)  # (B, M)
        if self._kernel_step is None:
            mask = self._tree_mask()  # (B, 1, M, C)
        else:
            # The kernel reads [0, L_b) and [L_b, L_b + M); a finished row's L_b may run past C - M
            # (its steps are discarded), so the column is clamped to stay inside the cache.
            self._kernel_step.past_lens.copy_(length.clamp(max=self.capacity - tree.num_nodes))
            mask = None  # the model builds none for the kernel's implementation either
        out = self.model(
            input_ids=tree_tokens,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=True,
            **self._cache_kwargs,
            **self._step_kwargs,
        )  # the model's own call, as _forward makes it (the cache's name decided once, outside the step)
        logits, hidden = out.logits, out.hidden_states[-1]  # (B, M, V), (B, M, d)
        if self.processors.active:
            logits = self.processors.node_logits(logits, slice(None), tree_tokens, tree.depth, self.num_out)
        # 3. Acceptance (greedy, sampling or typical): the longest accepted prefix of a root-to-leaf row
        #    of the tree is the path; the next root is the argmax (sampling: the draw) at its last node.
        pred, drawn = self._predict(logits)  # (B, M) argmax, or a draw; (B, M) bool or None
        if drawn is not None:  # a row's draws on NaN: its tokens after this step's root are void
            failed = ~drawn.all(dim=1)  # (B,)
            void = torch.minimum(self.bad_from, self.num_out + 1)  # (B,)
            self.bad_from.copy_(torch.where(failed, void, self.bad_from))
        path, n = self._accept(tree_tokens, logits, pred)  # (B, D + 1), (B,)
        last = path.gather(1, (n - 1)[:, None])[:, 0]  # (B,)
        path_tokens = tree_tokens.gather(1, path)  # (B, D + 1)
        # 4. KV compaction: entry L + path[j] moves to L + j (entries past n are stale and masked); a
        #    1-node tree's path is its root, already in place.
        if depth > 0:
            src = (length[:, None] + path).clamp(max=self.capacity - 1)  # (B, D + 1)
            dst = (length[:, None] + self._path_steps).clamp(max=self.capacity - 1)  # (B, D + 1)
            self.cache.move_entries(src, dst)
        # 5. Emit the path's tokens, record n, seed the next step.
        out_pos = (self.num_out[:, None] + self._path_steps).clamp(max=self.capacity - 1)  # (B, D + 1)
        self.out_tokens.scatter_(1, out_pos, path_tokens)
        if self.processors.active:  # the accepted tokens; entries from n on are padding: the root again
            valid = self._path_steps[None, :] < n[:, None]  # (B, D + 1)
            self.processors.accepted(slice(None), torch.where(valid, path_tokens, path_tokens[:, :1]))
        self.step_lengths.index_copy_(1, self.num_steps.clamp(max=self.capacity - 1), n[:, None])
        self.num_out.add_(n)
        self.num_steps.add_(1)
        length.add_(n)
        self.root.copy_(pred.gather(1, last[:, None])[:, 0])
        self.hidden.copy_(hidden[self._row_ids, last])

    def _accept_greedy(
        self, tree_tokens: torch.Tensor, logits: torch.Tensor, pred: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`greedy_path` of the step: ``(B, M)`` tokens, ``(B, M, V)`` logits, ``(B, M)`` argmax (or
        draws: sampling walks the same way)."""
        return greedy_path(tree_tokens, pred, self._retrieve, self._retrieve_valid, self._parents)

    def _accept_typical(
        self, tree_tokens: torch.Tensor, logits: torch.Tensor, pred: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`typical_path` of the step, each row's accepted candidates capped at its remaining
        budget less the root (as ``medusa_generate`` cuts its tree near the end)."""
        room = (self.budget - self.num_out - 1).clamp(min=0)  # (B,)
        return typical_path(
            tree_tokens,
            logits,
            self._internal,
            self._parent_slot,
            self._retrieve,
            self._retrieve_valid,
            room,
            **self._typical_settings,
        )

    def _prefill_row(self, row: int, input_ids: torch.Tensor) -> None:
        """Row ``row``'s prompt ``(1, T)`` into its columns ``[0, T)`` (eager); its state reset."""
        t = input_ids.shape[1]
        self.cache.prefill_row, self.cache.write_pos = row, self._cols[:t]
        try:
            logits, hidden = _forward(
                self.model,
                self.cache,
                input_ids,
                self._prefill_mask(t),
                self._cols[None, :t],
                logits_to_keep=1,
            )  # (1, 1, V), (1, T, d)
        finally:
            self.cache.prefill_row = None
        last = logits[0, -1]  # (V,)
        if self.processors.active:
            self.processors.start_row(row, input_ids[0])
            last = self.processors.prompt_logits(last[None], [row])[0]
        root, drawn = self._predict(last)  # the argmax, or a draw
        self.root[row] = root
        self.bad_from[row] = self.capacity if drawn is None else torch.where(drawn, self.capacity, 0)
        if self.hidden.shape[1] != hidden.shape[-1]:  # the allocating forward (before any capture)
            self.hidden = self.hidden.new_zeros(self.batch_size, hidden.shape[-1])  # (B, d)
        self.hidden[row] = hidden[0, -1]
        self.length[row] = t
        self.num_out[row] = 0

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        on_tokens: Callable[[list[int]], object] | None = None,
    ) -> MedusaOutput:
        """Medusa generation of one prompt; the same result as :func:`medusa_generate` with the same rule.

        Args:
            input_ids: ``(1, T)`` prompt on the model's device.
            max_new_tokens: most tokens to generate (also stops before ``max_position_embeddings``).
            eos_token_id: one id or several; an EOS is emitted and ends generation.
            on_tokens: called with the newly emitted tokens at each read of the device (every
                ``sync_every`` steps), in order; their concatenation is the output's ``tokens``.

        Returns:
            :class:`MedusaOutput`; ``num_forwards`` counts the steps run (with ``sync_every > 1``, the
            discarded ones too); ``forward_s`` is 0 (the forward is inside the step).

        Raises:
            ValueError: batch size is not 1, an empty prompt, or prompt + budget + tree over capacity.
        """
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be (1, T), got {tuple(input_ids.shape)}")
        per_row = None if on_tokens is None else (lambda row, new: on_tokens(new))
        out = self.generate_batch(
            [input_ids], max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, on_tokens=per_row
        )
        row = out.rows[0]
        row.prefill_s, row.total_s = out.prefill_s, out.total_s
        return row

    @one_call_per_model  # its buffers, and the model's attention switch
    @torch.inference_mode()
    def generate_batch(
        self,
        prompts: Sequence[torch.Tensor],
        *,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        on_tokens: Callable[[int, list[int]], object] | None = None,
        keep_kv: bool = False,
    ) -> MedusaBatchOutput:
        """Medusa generation of up to B prompts of any lengths, one row each.

        Args:
            prompts: ``(1, T)`` or ``(T,)`` token ids on the model's device, T >= 1, at most B of them.
            max_new_tokens: most tokens per row (a row also stops before ``max_position_embeddings``).
            eos_token_id: one id or several; an EOS is emitted and ends its row.
            on_tokens: called as ``on_tokens(row, new_tokens)`` with each row's newly emitted tokens
                at each read of the device, in order.
            keep_kv: copy out each row's KV entries as ``generate``'s cache holds them after it (the
                rows' ``kv``): a row's cache columns before its last token are its prompt's and its
                tokens' (the steps after it only write further on).

        Returns:
            :class:`MedusaBatchOutput`: a row's tokens equal its plain greedy ``generate`` (typical: its
            ``medusa_generate(acceptance="typical")``); every row
            takes part in every step until the last row stops (``num_forwards``: steps run).

        Raises:
            ValueError: more prompts than rows, an empty prompt, or a row over capacity.
        """
        t_start = time.perf_counter()
        ids = [p if p.ndim == 2 else p[None] for p in prompts]  # each (1, T)
        if not 1 <= len(ids) <= self.batch_size:
            raise ValueError(f"give 1 to {self.batch_size} prompts (the decoder's rows), got {len(ids)}")
        if any(p.shape[0] != 1 or p.shape[1] == 0 for p in ids):
            raise ValueError("each prompt must be (1, T) or (T,) token ids with T >= 1")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        lens = [p.shape[1] for p in ids]
        budgets = row_budgets(lens, max_new_tokens, self.limit)
        need = columns_needed(lens, budgets, self.tree.num_nodes)
        if need > self.capacity:
            raise ValueError(
                f"prompt + max_new_tokens + tree ({self.tree.num_nodes} nodes) need capacity {need}; this "
                f"StaticDecoder has {self.capacity}: build one with capacity >= {need}"
            )
        eos = set(eos_ids(eos_token_id))
        self.processors.set_eos(sorted(eos))  # the call's EOS ids, for the minimum length inside the step
        tokens: list[list[int]] = [[] for _ in ids]
        reasons = [
            "empty" if n <= 0 else "max_new_tokens" if n == max_new_tokens else "context" for n in budgets
        ]
        active = [n > 0 for n in budgets]
        steps = 0
        self._recapture_if_moved()
        with on_device(self.device):  # the step's kernels and replays launch there
            t0 = _now(self.device)
            for row in range(self.batch_size):  # rows without a prompt decode a copy of the first one
                src = row if row < len(ids) else 0
                # A row with no room emits nothing, but its slot still steps: its prompt's first token
                # stands in for it (a prompt past the model's positions cannot be prefilled: GPT-2's
                # learned positions end there).
                self._prefill_row(row, ids[src] if budgets[src] > 0 else ids[src][:, :1])
                self.budget[row] = budgets[src]
            self.num_steps.zero_()
            prefill_s = _now(self.device) - t0
            while any(active):
                with self._backend(), self._tree_attention(), self._tied():
                    for _ in range(self.sync_every):
                        self._run()
                steps += self.sync_every
                # The host's one read per sync_every steps: each active row's new tokens.
                if self._draws:  # with the marks of draws on NaN, in the same read
                    counts, bad_from = torch.stack((self.num_out, self.bad_from))[:, : len(ids)].tolist()
                else:
                    counts, bad_from = self.num_out[: len(ids)].tolist(), None
                lo = min(len(tokens[r]) for r in range(len(ids)) if active[r])
                hi = max(min(counts[r], budgets[r]) for r in range(len(ids)) if active[r])
                chunk = self.out_tokens[: len(ids), lo:hi].tolist()
                for r in range(len(ids)):
                    if not active[r]:
                        continue
                    new = chunk[r][len(tokens[r]) - lo : min(counts[r], budgets[r]) - lo]
                    cut = next((i + 1 for i, tok in enumerate(new) if tok in eos), None) if eos else None
                    new = new if cut is None else new[:cut]
                    if bad_from is not None and len(tokens[r]) + len(new) > bad_from[r]:
                        raise RuntimeError(
                            f"row {r}'s sampling distribution holds NaN probabilities (its logits over the "
                            f"temperature {self.temperature} pass float32's range, or are not finite); "
                            "generate's torch.multinomial refuses it, as the other decoders do: use a "
                            "larger temperature (0: greedy)"
                        )
                    tokens[r].extend(new)
                    if on_tokens is not None and new:
                        on_tokens(r, new)
                    if cut is not None:
                        reasons[r], active[r] = "eos", False
                    elif len(tokens[r]) >= budgets[r]:
                        active[r] = False
            per_step = self.step_lengths[: len(ids), : min(steps, self.capacity)].tolist()
        rows = [
            MedusaOutput(
                tokens=torch.tensor(tokens[r], dtype=torch.long),
                accepted_lengths=_cut_lengths(per_step[r], len(tokens[r])),
                num_forwards=len(_cut_lengths(per_step[r], len(tokens[r]))),
                stop_reason=reasons[r],
                kv=row_entries(self.cache, r, self._cols[: lens[r] + len(tokens[r]) - 1])
                if keep_kv and tokens[r]
                else None,
            )
            for r in range(len(ids))
        ]
        return MedusaBatchOutput(
            rows=rows, num_forwards=steps, prefill_s=prefill_s, total_s=time.perf_counter() - t_start
        )


def greedy_path(
    tree_tokens: torch.Tensor,
    pred: torch.Tensor,
    retrieve: torch.Tensor,
    retrieve_valid: torch.Tensor,
    parents: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of B rows as tensor operations (no host sync): in each row the longest path
    whose every token is its parent's prediction.

    Args:
        tree_tokens: ``(B, M)`` token of every node.
        pred: ``(B, M)`` the token each node predicts for its successor (the argmax of its logits).
        retrieve: ``(Lf, D + 1)`` root-to-leaf node indices, padding clamped to 0.
        retrieve_valid: ``(Lf, D)`` which of entries 1..D of ``retrieve`` are real nodes.
        parents: ``(M,)`` parent node of each node (the root's clamped to 0).

    Returns:
        ``(B, D + 1)`` each row's path of node indices (root first; entries from n on are padding) and
        ``(B,)`` n, the accepted nodes, the root included. Siblings hold distinct tokens (different ranks
        of one head), so every leaf row of maximal accepted length carries the same path.
    """
    ok = tree_tokens == pred[:, parents]  # (B, M)
    ok_rows = ok[:, retrieve[:, 1:]] & retrieve_valid  # (B, Lf, D)
    accepted = ok_rows.long().cumprod(dim=2).sum(dim=2)  # (B, Lf)
    best = accepted.argmax(dim=1)  # (B,)
    n = accepted.gather(1, best[:, None])[:, 0] + 1  # (B,)
    return retrieve.index_select(0, best), n  # (B, D + 1), (B,)


@functools.cache
def _takes_extra_kwargs(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``**kwargs`` (transformers' models hand them on to attention)."""
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls.forward).parameters.values()
    )


def weight_addresses(model: torch.nn.Module) -> tuple[int, ...]:
    """Where each of the model's parameters and buffers lives now (what a captured CUDA graph reads)."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


def _own_rng(device: torch.device) -> contextlib.AbstractContextManager:
    """A block whose random draws (a sampling decoder's first forward and capture warm-up) leave the
    caller's generator as it was: a seed set before a call repeats that call's draws, also the call
    that builds the decoder. A replay of the captured step draws from the generator as it is then."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.random.fork_rng(devices=[index], device_type="cuda")
    return torch.random.fork_rng(devices=[])


def _argmax(logits: torch.Tensor) -> tuple[torch.Tensor, None]:
    return logits.argmax(dim=-1), None


def draw_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    host_sync: bool = False,
) -> torch.Tensor:
    """One token per position drawn from its distribution warped as ``generate(do_sample=True)`` warps
    it (:func:`~medusa_train.decoding.acceptance.warp_probs`), as tensor operations with no host sync
    unless ``host_sync``.

    The exponential race: with ``E_i`` i.i.d. Exp(1), ``argmax_i p_i / E_i`` is token i with probability
    ``p_i`` (each ``E_i / p_i`` is the first arrival of a Poisson clock of rate ``p_i``); a token of
    probability 0 never wins. ``torch.multinomial`` would check its input on the host, which a CUDA
    graph cannot hold; ``exponential_`` draws from the device's default generator, whose offset a
    captured graph advances on every replay. With a draw at every node, following the draws down the
    tree emits tokens distributed as ancestral sampling (:func:`~.acceptance.accept_sample`).

    Args:
        logits: ``(..., V)``.
        temperature: > 0.
        top_p: in (0, 1].
        top_k: >= 0 (0: none).
        min_p: in [0, 1] (0: none).
        host_sync: let top-p without a top-k read the device to rank fewer scores than the vocabulary
            (the same probabilities; ``warp_probs``'s ``host_sync``).

    Returns:
        ``(...)`` long token ids and ``(...)`` bool, False where the warped probabilities hold NaN (the
        logits over the temperature overflowed float32, or were not finite): no distribution to draw
        from, where ``torch.multinomial`` (what ``generate`` draws with) raises; the token is void.
    """
    probs = warp_probs(logits, temperature, top_p, top_k, min_p, host_sync=host_sync)  # (..., V) float32
    race = torch.empty_like(probs).exponential_().clamp_(min=torch.finfo(probs.dtype).tiny)
    best, tokens = (probs / race).max(dim=-1)  # NaN propagates to the max: one pass for both
    return tokens, ~best.isnan()


def typical_nodes(tree: TreeBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """The nodes whose distributions :func:`typical_path` needs (those with children) and where each
    node's parent sits among them.

    Returns:
        ``(P,)`` the internal nodes in increasing order and ``(M,)`` the index into them of each node's
        parent (the root's: the root's own index, 0). The tree must have at least one candidate.
    """
    assert tree.max_depth > 0, "typical acceptance needs a tree with candidates"
    parents = tree.parents.clamp(min=0)  # (M,)
    internal = parents[1:].unique()  # (P,) sorted, the root first
    return internal, torch.searchsorted(internal, parents)


def typical_path(
    tree_tokens: torch.Tensor,
    logits: torch.Tensor,
    internal: torch.Tensor,
    parent_slot: torch.Tensor,
    retrieve: torch.Tensor,
    retrieve_valid: torch.Tensor,
    max_accept: torch.Tensor,
    *,
    temperature: float,
    posterior_threshold: float,
    posterior_alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa's typical acceptance of B rows as tensor operations (no host sync), the rule of
    :func:`~medusa_train.decoding.acceptance.accept_typical`.

    A node is accepted iff its token's probability at its parent (softmax of the logits over the
    temperature) exceeds ``min(posterior_threshold, posterior_alpha * exp(-H(parent)))``; the path is
    the longest accepted prefix of a root-to-leaf row, capped at ``max_accept`` candidates, ties between
    rows broken by the prefix's summed ``log(p + 1e-10)`` (the first such row on equal sums). The
    softmax runs over the internal nodes only (a leaf's distribution judges no candidate).

    Args:
        tree_tokens: ``(B, M)`` token of every node.
        logits: ``(B, M, V)`` backbone logits at every node.
        internal: ``(P,)`` nodes with children; ``parent_slot``: ``(M,)`` each node's parent's index
            into ``internal`` (both from :func:`typical_nodes`).
        retrieve: ``(Lf, D + 1)`` root-to-leaf node indices, padding clamped to 0.
        retrieve_valid: ``(Lf, D)`` which of entries 1..D of ``retrieve`` are real nodes.
        max_accept: ``(B,)`` most candidates a row may accept (its remaining budget less the root).
        temperature: > 0.
        posterior_threshold: epsilon; posterior_alpha: delta.

    Returns:
        ``(B, D + 1)`` each row's path of node indices (root first; entries from n on are padding) and
        ``(B,)`` n, the accepted nodes, the root included. The next root is the argmax of the logits at
        the path's last node.
    """
    b, _, v = logits.shape
    probs = torch.softmax(logits.index_select(1, internal).float() / temperature, dim=-1)  # (B, P, V)
    entropy = -(probs * torch.log(probs + 1e-10)).sum(dim=-1)  # (B, P)
    threshold = torch.minimum(
        torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy)
    )  # (B, P)
    # p(node's token | parent) for every node, read from the flattened (B, P * V) probabilities.
    flat = parent_slot[None, :] * v + tree_tokens  # (B, M)
    p_node = probs.view(b, -1).gather(1, flat)  # (B, M)
    ok = p_node > threshold[:, parent_slot]  # (B, M)
    ok_rows = ok[:, retrieve[:, 1:]] & retrieve_valid  # (B, Lf, D)
    accepted = ok_rows.long().cumprod(dim=2).sum(dim=2)  # (B, Lf)
    accepted = torch.minimum(accepted, max_accept[:, None])  # (B, Lf)
    longest = accepted.amax(dim=1)  # (B,)
    steps = torch.arange(retrieve.shape[1] - 1, device=logits.device)  # (D,)
    cand_p = p_node[:, retrieve[:, 1:]]  # (B, Lf, D)
    in_prefix = steps < accepted[:, :, None]  # (B, Lf, D)
    loglik = torch.where(in_prefix, torch.log(cand_p + 1e-10), torch.zeros_like(cand_p)).sum(dim=2)
    loglik = torch.where(accepted == longest[:, None], loglik, torch.full_like(loglik, -math.inf))  # (B, Lf)
    best = loglik.argmax(dim=1)  # (B,)
    return retrieve.index_select(0, best), longest + 1  # (B, D + 1), (B,)


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


def row_budgets(prompt_lens: Sequence[int], max_new_tokens: int, limit: int | None) -> list[int]:
    """Tokens each row may emit: ``max_new_tokens``, less where prompt + tokens would pass the model's
    ``limit`` positions (None: no limit); 0 or less: none."""
    return [max_new_tokens if limit is None else min(max_new_tokens, limit - t) for t in prompt_lens]


def columns_needed(prompt_lens: Sequence[int], budgets: Sequence[int], num_nodes: int) -> int:
    """KV columns the most demanding row needs: its prompt, its budget (:func:`row_budgets`) and a tree
    of ``num_nodes`` nodes; a row with no budget holds one token of its prompt (what the decoder
    prefills for it) and a tree."""
    return max((t + n if n > 0 else 1) + num_nodes for t, n in zip(prompt_lens, budgets, strict=True))


def capacity_for(need: int, limit: int | None = None) -> int:
    """The KV columns of a :class:`StaticDecoder` that is to hold ``need`` (prompt + budget + tree): the
    next power of two from 256, so that calls of nearby lengths share one decoder (and its capture);
    at most ``limit`` (the model's positions plus the tree's nodes; None: no limit) when that holds
    ``need``."""
    capacity = max(256, 1 << (max(need, 1) - 1).bit_length())
    return capacity if limit is None or limit < need else min(capacity, limit)


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
    attention: str = "sdpa",
    acceptance: str = "greedy",
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
    min_new_tokens: int = 0,
    min_length: int = 0,
) -> MedusaOutput:
    """One prompt through a :class:`StaticDecoder` sized for it (build the decoder yourself to reuse a
    capture across prompts). Arguments as :class:`StaticDecoder` and :meth:`StaticDecoder.generate`."""
    limit = context_limit(model)
    budget = max_new_tokens if limit is None else min(max_new_tokens, limit - input_ids.shape[1])
    capacity = input_ids.shape[1] + max(budget, 1) + as_tree(tree).num_nodes
    decoder = StaticDecoder(
        model,
        heads,
        tree,
        capacity,
        capture=capture,
        compile_mode=compile_mode,
        sync_every=sync_every,
        attention=attention,
        acceptance=acceptance,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        posterior_threshold=posterior_threshold,
        posterior_alpha=posterior_alpha,
        repetition_penalty=repetition_penalty,
        min_p=min_p,
        min_new_tokens=min_new_tokens,
        min_length=min_length,
    )
    return decoder.generate(input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
