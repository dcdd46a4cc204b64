"""The tree attention's integration with transformers: the attention functions registered with its
``AttentionInterface`` (:func:`hf_tree_attention` as :data:`KERNEL_NAME`, :func:`hf_packed_sdpa_attention`
as :data:`PACKED_SDPA_NAME`; :func:`register`), the switches of a model's attention implementation around
its forwards (:func:`tree_step` with a :class:`TreeStep`, :func:`packed_sdpa`) and the lock of each model
that keeps those switches to one decoder call at a time (:func:`model_lock`, :func:`one_call_per_model`)."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .errors import AttentionBackendError
from .function import TreeMask, tree_attention
from .layers import layer_chunk, layer_window
from .sdpa import PACKED_MAX_QUERIES, packed_gqa_sdpa

STEP_KWARG = "medusa_tree_step"
"""The forward keyword argument a caller may pass its :class:`TreeStep` in (besides :func:`tree_step`):
transformers hands a forward's extra keyword arguments on to the attention function. Read first; the
step of :func:`tree_step` is the fallback for a model that does not pass them on."""
KERNEL_NAME = "medusa_tree"
"""The name the tree-attention function is registered under in transformers' ``AttentionInterface``."""
PACKED_SDPA_NAME = "medusa_sdpa"
"""The name :func:`hf_packed_sdpa_attention` is registered under (:func:`packed_sdpa`)."""
_STEP: ContextVar[TreeStep | None] = ContextVar("medusa_tree_step", default=None)
SCORE_MODIFIERS = ("softcap", "s_aux", "sinks", "position_bias", "indices", "block_indices")
"""Attention arguments some models pass that change the scores, the softmax or the keys attended
(Gemma-2's softcap, gpt-oss's sinks, T5-style biases, the key indices of sparse attention): the tree
kernels and the packed SDPA do not apply them, but for ``s_aux`` (attention sinks, one logit per query
head, as transformers' flash and flex attention read it) and ``softcap`` (a number), which the Triton
kernel applies."""


@dataclass
class TreeStep:
    """What one verification forward's attention layers need to know about the tree.

    Attributes:
        past_lens: ``(B,)`` int32 column of each row's first tree node (its cached length).
        starts: ``(B,)`` int32 first visible column of each row.
        mask: the tree of this step (its node count is the forward's query length).
        backend: "sdpa", "triton" or "cuda".
        positions: the model's :func:`layer_positions` (empty: its attention layers say which layer
            they are by ``layer_idx``, or need not).
        config: the model's text config, whose ``layer_types`` say which layers ``window`` applies to
            (:func:`layer_window`, also for an attention module without a ``config`` of its own).
        window: the sliding window the model applies (:func:`model_window`; None: none), read once
            per call (not per step: it looks at the model's classes).
        chunk: the chunk of the model's "chunked_attention" layers (:func:`attention_chunk`; None:
            none, or a call whose positions stay inside the first chunk), read once per call.
        model_attention: the model's own attention implementation, which :func:`tree_step` switches
            from (its SDPA computes no softcap and no sinks: the kernel then computes none either).
    """

    past_lens: torch.Tensor
    starts: torch.Tensor
    mask: TreeMask
    backend: str
    positions: dict[int, int] = field(default_factory=dict)
    config: object | None = None
    window: int | None = None
    chunk: int | None = None
    model_attention: str | None = None


SDPA_IMPLEMENTATIONS = ("sdpa", PACKED_SDPA_NAME)
"""Attention implementations that run transformers' ``sdpa_attention_forward`` on a softcap or sinks,
which computes neither: transformers 5.17 drops a ``softcap`` and ``s_aux`` silently (and loads Gemma 2
with SDPA by default), 5.24 raises on a softcap and drops ``s_aux``. A model running one of these in
``generate`` attends without them, and so does the kernel (:func:`hf_tree_attention`)."""


def hf_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as :data:`KERNEL_NAME`: transformers' attention-function signature.

    Given a step (the keyword argument :data:`STEP_KWARG`, else the one of :func:`tree_step`):
    :func:`tree_attention` with the step's tree (``attention_mask`` is None there: the model builds
    none), windowed by the layer's window as the decoders' dense masks apply it (:func:`layer_window`,
    also for a layer that passes no ``sliding_window``: Qwen2-MoE, PhiMoE). Elsewhere: transformers'
    SDPA attention on whatever mask it is given.

    One window per layer, the masks': a layer that passes a ``sliding_window`` other than that is
    refused. Every transformers model checked passes on its "sliding_attention" layers (every layer
    without ``layer_types``) exactly ``config.sliding_window``, the window its own masks apply
    (transformers 5.24, about 50 causal LMs with a window set, each layer's call recorded); those
    refused pass a window on layers of types the decoders' masks do not window (Inkling's
    "hybrid_sliding", MiniMax's full layers given a window). The static decoder builds the kernels'
    ancestor bits for the masks' windows alone, before any capture.

    Returns:
        ``(B, M, Hq, Dv)`` attention output (``Dv`` the values' head dim) and no weights.

    Raises:
        AttentionBackendError: in a step, a call the kernels would compute wrongly: one passing
            :data:`SCORE_MODIFIERS` (but for the Triton kernel sinks of one logit per query head,
            ``s_aux``, and a ``softcap``, which it applies) or a mask of its own, dropout, value heads
            narrower or wider than the query heads (for the CUDA kernel), or a sliding window its
            layer's masks do not apply.
    """
    step = kwargs.pop(STEP_KWARG, None)
    if step is None:
        step = _STEP.get()
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    name = type(module).__name__
    # Attention sinks (transformers' s_aux: gpt-oss's one logit per query head) and softcapped scores
    # (Gemma 2's softcap, a number): the Triton kernel's; none where the model's own attention is SDPA,
    # which computes neither, so that the tree is verified as generate decodes.
    if step.model_attention in SDPA_IMPLEMENTATIONS:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("softcap", "s_aux")}
    triton = step.backend == "triton"
    sinks = kwargs.get("s_aux") if triton else None
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        sinks = None  # not one logit per query head: refused below
    softcap = kwargs.get("softcap") if triton and isinstance(kwargs.get("softcap"), (int, float)) else None
    applied = {"s_aux": sinks, "softcap": softcap}
    extra = [k for k in SCORE_MODIFIERS if kwargs.get(k) is not None and applied.get(k) is None]
    if attention_mask is not None:  # the model makes none for the kernel's implementation: its own
        extra.append("a mask of its own")
    if extra:
        raise AttentionBackendError(
            f"{name} passes {', '.join(extra)} to its attention, which the tree kernels do not apply: use "
            "attention=sdpa"
        )
    if dropout:
        raise AttentionBackendError(
            f"{name} asks for attention dropout {dropout} (the model is in training mode), which the tree "
            "kernels do not apply: call model.eval()"
        )
    if step.backend == "cuda" and value.shape[-1] != query.shape[-1]:
        raise AttentionBackendError(
            f"{name}'s value heads ({value.shape[-1]}) are not as wide as its query heads "
            f"({query.shape[-1]}), which the CUDA kernel needs: use attention=triton or sdpa"
        )
    layer_types = getattr(step.config, "layer_types", None)
    window = layer_window(module, step.positions, step.window, layer_types)
    if sliding_window is not None and sliding_window != window:
        masks = f"window by {window}" if window else "apply no window"
        raise AttentionBackendError(
            f"{name} passes sliding_window={sliding_window} to its attention, but its layer's masks {masks} "
            '(config.sliding_window on "sliding_attention" layers), the one window the tree kernels '
            "apply: use attention=sdpa"
        )
    chunk = layer_chunk(module, step.positions, step.chunk, layer_types)
    out = tree_attention(
        query, key, value, step.past_lens, step.starts, step.mask,
        scale=scaling, window=window, chunk=chunk, sinks=sinks, softcap=softcap, backend=step.backend,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None  # (B, M, Hq, D)


def hf_packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as :data:`PACKED_SDPA_NAME`: :func:`~.sdpa.packed_gqa_sdpa` for a
    grouped-query layer given a mask shared by its heads and at most
    :data:`~.sdpa.PACKED_MAX_QUERIES` queries; transformers' SDPA attention for anything else.

    Returns:
        ``(B, M, Hq, D)`` attention output and no weights.
    """
    if (
        getattr(module, "num_key_value_groups", 1) > 1
        and attention_mask is not None
        and attention_mask.ndim == 4
        and attention_mask.shape[1] == 1
        and query.shape[2] <= PACKED_MAX_QUERIES
        and all(kwargs.get(k) is None for k in SCORE_MODIFIERS)
    ):
        return packed_gqa_sdpa(query, key, value, attention_mask, scaling, dropout), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def register() -> None:
    """Register :func:`hf_tree_attention` and :func:`hf_packed_sdpa_attention` with transformers'
    ``AttentionInterface`` (idempotent)."""
    AttentionInterface.register(KERNEL_NAME, hf_tree_attention)
    AttentionInterface.register(PACKED_SDPA_NAME, hf_packed_sdpa_attention)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current CUDA device for the block (a no-op for any other device).

    Triton kernels, the CUDA extension and CUDA-graph capture and replay launch on the current device,
    not on their tensors': a model on ``cuda:1`` (``model.device=cuda:1``) in a process whose current
    device is 0 would have its kernels launched on device 0."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


_CONFIG_LOCKS: dict[int, threading.RLock] = {}  # id(model.config) -> its lock, while the config lives
_CONFIG_LOCKS_GUARD = threading.Lock()


def model_lock(model: torch.nn.Module) -> threading.RLock:
    """The re-entrant lock of ``model.config`` (the object :func:`tree_step` and :func:`packed_sdpa`
    change; a model and a wrapper sharing its config share the lock), made on first use and dropped
    with the config."""
    config = model.config
    with _CONFIG_LOCKS_GUARD:
        lock = _CONFIG_LOCKS.get(id(config))
        if lock is None:
            lock = _CONFIG_LOCKS[id(config)] = threading.RLock()
            weakref.finalize(config, _CONFIG_LOCKS.pop, id(config), None)
        return lock


def one_call_per_model(decode: Callable) -> Callable:
    """Run ``decode(model, ...)`` (or a method of an object with a ``model`` attribute) holding the
    model's lock (:func:`model_lock`): the decoders switch ``model.config._attn_implementation`` around
    their forwards, and another thread's call on the same model in between would run its own forwards
    with that implementation (its prefill with no mask, its tree with another call's step). A plain
    ``model.generate`` in another thread takes no lock and is not covered."""

    @functools.wraps(decode)
    def locked(first, *args, **kwargs):
        model = first if isinstance(first, torch.nn.Module) else first.model
        with model_lock(model):
            return decode(first, *args, **kwargs)

    return locked


@contextmanager
def packed_sdpa(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's forwards inside this block with :func:`hf_packed_sdpa_attention` if the model
    uses transformers' ``sdpa`` (any other implementation is left alone); switched back afterwards
    (also when the forward raises)."""
    config = model.config
    if config._attn_implementation != "sdpa":
        yield
        return
    register()
    config._attn_implementation = PACKED_SDPA_NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


@contextmanager
def tree_step(model: torch.nn.Module, step: TreeStep) -> Iterator[None]:
    """Run the model's forwards inside this block with tree attention for ``step``.

    Switches ``model.config``'s attention implementation to :data:`KERNEL_NAME` and back afterwards
    (also when the forward raises), with the model's device current (:func:`on_device`); the step
    keeps the implementation switched from (``step.model_attention``).
    """
    register()
    config = model.config
    previous = config._attn_implementation
    step.model_attention = previous
    token = _STEP.set(step)
    config._attn_implementation = KERNEL_NAME
    try:
        with on_device(model.device):
            yield
    finally:
        config._attn_implementation = previous
        _STEP.reset(token)
