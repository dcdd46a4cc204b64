"""Tree attention without a dense mask: one function, three implementations, and its registration as a
Hugging Face attention function.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774), section 2.1.2 "Tree attention".

Contract of :func:`tree_attention`: queries ``(B, Hq, M, D)`` for the M tree nodes of each row, keys and
values ``(B, Hkv, W, D)`` (``Hq = g * Hkv``; K/V are never expanded). Row b attends its past, columns
``[start_b, past_b)`` (``start_b`` > 0 when batched decoding left-pads the row), without any mask, and
its tree at columns ``[past_b, past_b + M)`` through a :class:`TreeMask`: per node, int64 words of
ancestor bits (bit ``j % 64`` of word ``j // 64``: the node sees node j; itself included). Columns past
``past_b + M`` (stale entries of a preallocated cache) are never read. fp16, bf16 and fp32; scores,
softmax and the output accumulator are fp32.

Implementations (``backend``): ``sdpa`` (the reference: the dense boolean mask written out and handed
to PyTorch's SDPA; runs anywhere), ``triton`` (:mod:`.triton_kernel`; CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``) and ``cuda`` (:mod:`.cuda_kernel`, CUDA C++ compiled on first use).

The decoders select it with ``attention="sdpa" | "triton" | "cuda" | "auto"`` (:func:`resolve_attention`):
``sdpa`` keeps their dense float mask path; for a kernel they run each verification forward inside
:func:`tree_step`, which switches the model's attention implementation to :data:`KERNEL_NAME` (registered
with transformers' ``AttentionInterface``) and hands the step's tree description to it; the model builds
no mask then (transformers skips mask creation for an implementation without a mask function), and its
previous implementation is restored when the forward returns. Outside a step the registered function is
transformers' own SDPA attention, but the model builds no mask for it either (causal attention without
padding only): the name is meant for :func:`tree_step`, not for ``set_attn_implementation``.

Under ``torch.compile`` (the static decoder's ``capture="compile"``) nothing of this breaks the graph: a
step is also handed to the attention function as the forward's keyword argument :data:`STEP_KWARG`
(Dynamo cannot read a ``ContextVar``: every layer would break the graph there), and a kernel is called
as the custom op ``torch.ops.medusa_train.tree_attention`` (:func:`kernel_op`), which the compiler
keeps as one opaque call instead of tracing the launcher's Python (or, on a CPU, triton's interpreter).

The ``sdpa`` path itself runs its masked forwards (a tree's M nodes, up to
:data:`~.sdpa.PACKED_MAX_QUERIES` queries) inside :func:`packed_sdpa`, which switches a model on
transformers' ``sdpa`` to :data:`PACKED_SDPA_NAME`: the same SDPA on the same mask, with a grouped-query
layer's query heads stacked per KV head instead of K/V expanded to every query head
(:func:`~.sdpa.packed_gqa_sdpa`); every other call goes to transformers' SDPA attention unchanged.

Both switches change ``model.config``, which every thread using the model reads: a decoder call on a
model holds that model's lock (:func:`one_call_per_model`) for its whole length, so calls on one model
from several threads run one after another (each identical to the call alone) and calls on different
models run side by side.

Modules: :mod:`.function` (:func:`tree_attention`, :class:`TreeMask`, :func:`kernel_op`), :mod:`.hf`
(the registration with transformers, :func:`tree_step`, :func:`packed_sdpa`, :func:`one_call_per_model`),
:mod:`.support` (which models the decoders can verify and which layers the kernels compute:
:func:`tree_refusal`, :func:`kernel_refusal`), :mod:`.layers` (each layer's window and chunk:
:func:`layer_window`, :func:`layer_chunk`), :mod:`.errors` (:class:`AttentionBackendError`) and the
three implementations (:mod:`.sdpa`, :mod:`.triton_kernel`, :mod:`.cuda_kernel`); this module holds
:func:`resolve_attention` and re-exports the others' names.
"""

from __future__ import annotations

import torch

from .cuda_kernel import cuda_available
from .errors import AttentionBackendError
from .function import TreeMask, kernel_op, tree_attention
from .function import pack_bits as pack_bits  # `name as name`: importable from here, not in __all__
from .hf import (
    KERNEL_NAME,
    PACKED_SDPA_NAME,
    SDPA_IMPLEMENTATIONS,
    STEP_KWARG,
    TreeStep,
    hf_packed_sdpa_attention,
    hf_tree_attention,
    model_lock,
    on_device,
    one_call_per_model,
    packed_sdpa,
    register,
    tree_step,
)
from .hf import SCORE_MODIFIERS as SCORE_MODIFIERS
from .layers import (
    attention_chunk,
    code_reads_chunk,
    code_reads_window,
    decoder_layers,
    layer_chunk,
    layer_positions,
    layer_window,
    mixes_layer_kinds,
    mixes_windows,
    model_window,
    sliding_window_kinds,
)
from .support import (
    ALIBI_MODEL_TYPES,
    MODEL_WIDE_ATTRIBUTES,
    OWN_MASK_MODEL_TYPES,
    SERVED_LAYER_TYPES,
    attends_both_ways,
    check_verifiable,
    chunk_refusal,
    code_reads_is_decoder,
    kernel_refusal,
    layer_configs,
    layers_dispatch,
    model_and_decoder,
    per_layer_attributes,
    positionless_model,
    recurrent_loops,
    stateful_model,
    tree_refusal,
    uncached_model,
    unserved_layer_types,
)
from .support import WRONG_IN_517 as WRONG_IN_517
from .triton_kernel import interpreter_enabled, triton_available

ATTENTION_CHOICES = ("sdpa", "triton", "cuda", "auto")
"""What the decoders' ``attention`` argument (and ``eval.attention``) accepts."""
AUTO_ORDER = ("triton",)
"""``auto`` on a CUDA device, from :data:`AUTO_MIN_CONTEXT` keys: the first of these that runs there,
else ``sdpa``. The CUDA kernel is not among them: on one H100 it was slower than SDPA at every shape
measured (docs/benchmarks.md)."""
AUTO_MIN_CONTEXT = 8192
"""``auto`` takes a kernel for an eager decoder's calls of at least this many keys (prompt + new tokens),
else SDPA. Measured on one H100 (bf16, 32/8 heads, head dim 128, batch 1, one call with its launch):
at 2,048 keys SDPA with the float mask took 0.071 / 0.088 / 0.085 ms for 16 / 64 / 256 nodes and
the Triton kernel 0.087 / 0.088 / 0.127 ms; at 8,192 keys 0.224 / 0.235 / 0.234 against 0.101 /
0.112 / 0.187 ms. Between the two was not measured."""
AUTO_MIN_CONTEXT_CAPTURED = 2048
"""The same for a step captured as a CUDA graph (the static decoder), where launches cost nothing and
only the GPU's time counts: at 2,048 keys the Triton kernel took 0.024 / 0.025 / 0.058 ms of GPU time
against SDPA's 0.052 / 0.056 / 0.066 ms (16 / 64 / 256 nodes, batch 1), and the captured step of a
Llama-3-8B-shaped model 9.54 / 12.91 ms (1 / 64 nodes) against 11.07 / 15.52 ms; at 512 keys and batch 1
the two were level (0.019-0.030 ms). The most tree queries measured, 256 nodes at batch 8 and 2,048
keys: the kernel 0.272 ms against 0.320 for the decoders' SDPA path on a grouped-query layer (packed
SDPA) and 0.263 on a layer without grouped heads, where the static decoder's SDPA also reads the whole
capacity: no tree size keeps SDPA from 2,048 keys."""


def resolve_attention(
    attention: str,
    device: torch.device,
    context: int | None = None,
    captured: bool = False,
    model: torch.nn.Module | None = None,
) -> str:
    """The implementation a decoder uses for ``attention`` on ``device``: "sdpa", "triton" or "cuda".

    ``auto`` is the first of :data:`AUTO_ORDER` that runs on the device (and computes ``model``'s
    attention, :func:`kernel_refusal`) when the call's ``context`` (the most keys a row attends to:
    prompt + new tokens; None: unknown, taken as long) reaches :data:`AUTO_MIN_CONTEXT`
    (:data:`AUTO_MIN_CONTEXT_CAPTURED` for a ``captured`` step, replayed as a CUDA graph), else ``sdpa``
    (always on a CPU). A kernel named for a ``model`` it cannot compute is refused here, before any work
    (the CUDA kernel for chunked attention layers where the call's ``context`` passes their chunk,
    :func:`chunk_refusal`), and so is every choice for a model no tree attention can verify
    (:func:`tree_refusal`).

    Raises:
        AttentionBackendError: an unknown choice, or one that cannot run here or cannot compute
            ``model``'s attention, or a model whose trees nothing verifies (the message says why).
    """
    if attention not in ATTENTION_CHOICES:
        raise AttentionBackendError(
            f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {attention!r}"
        )
    if model is not None:
        check_verifiable(model)
    if attention == "sdpa":
        return "sdpa"
    if attention == "auto":
        least = AUTO_MIN_CONTEXT_CAPTURED if captured else AUTO_MIN_CONTEXT
        if device.type != "cuda" or (context is not None and context < least):
            return "sdpa"
        runs = (b for b in AUTO_ORDER if (_why_not(b, device) or _cannot_compute(b, model, context)) is None)
        return next(runs, "sdpa")
    reason = _why_not(attention, device) or _cannot_compute(attention, model, context)
    if reason is not None:
        raise AttentionBackendError(f"attention={attention} cannot run here: {reason}")
    return attention


def _cannot_compute(backend: str, model: torch.nn.Module | None, context: int | None) -> str | None:
    """Why kernel ``backend`` cannot compute ``model``'s attention on a call of ``context`` positions."""
    if model is None:
        return None
    return kernel_refusal(model, backend) or (chunk_refusal(model, context) if backend == "cuda" else None)


def _why_not(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot run on ``device`` (None: it can)."""
    if backend == "triton":
        if not triton_available():
            return "triton is not installed (pip install triton, or pip install 'medusa_train[triton]')"
        if device.type != "cuda" and not interpreter_enabled():
            return "the Triton kernel needs a CUDA device (or TRITON_INTERPRET=1 to run it slowly on a CPU)"
        return None
    if device.type != "cuda":
        return "the CUDA kernel needs a CUDA device: use attention=sdpa or auto"
    return cuda_available()


__all__ = [
    "ALIBI_MODEL_TYPES",
    "ATTENTION_CHOICES",
    "AUTO_MIN_CONTEXT",
    "AUTO_MIN_CONTEXT_CAPTURED",
    "AUTO_ORDER",
    "KERNEL_NAME",
    "MODEL_WIDE_ATTRIBUTES",
    "OWN_MASK_MODEL_TYPES",
    "PACKED_SDPA_NAME",
    "SDPA_IMPLEMENTATIONS",
    "SERVED_LAYER_TYPES",
    "STEP_KWARG",
    "AttentionBackendError",
    "TreeMask",
    "TreeStep",
    "attends_both_ways",
    "attention_chunk",
    "check_verifiable",
    "chunk_refusal",
    "code_reads_chunk",
    "code_reads_is_decoder",
    "code_reads_window",
    "decoder_layers",
    "hf_packed_sdpa_attention",
    "hf_tree_attention",
    "kernel_op",
    "kernel_refusal",
    "layer_chunk",
    "layer_configs",
    "layer_positions",
    "layer_window",
    "layers_dispatch",
    "mixes_layer_kinds",
    "mixes_windows",
    "model_and_decoder",
    "model_lock",
    "model_window",
    "on_device",
    "one_call_per_model",
    "packed_sdpa",
    "per_layer_attributes",
    "positionless_model",
    "recurrent_loops",
    "register",
    "resolve_attention",
    "sliding_window_kinds",
    "stateful_model",
    "tree_attention",
    "tree_refusal",
    "tree_step",
    "uncached_model",
    "unserved_layer_types",
]
