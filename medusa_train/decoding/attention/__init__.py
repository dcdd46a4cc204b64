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
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import math
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ...errors import UserError
from ..tree import TreeBuffers
from .cuda_kernel import cuda_available, cuda_tree_attention
from .sdpa import PACKED_MAX_QUERIES, packed_gqa_sdpa, sdpa_tree_attention, unpack_bits
from .triton_kernel import interpreter_enabled, triton_available, triton_tree_attention

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
STEP_KWARG = "medusa_tree_step"
"""The forward keyword argument a caller may pass its :class:`TreeStep` in (besides :func:`tree_step`):
transformers hands a forward's extra keyword arguments on to the attention function. Read first; the
step of :func:`tree_step` is the fallback for a model that does not pass them on."""
KERNEL_NAME = "medusa_tree"
"""The name the tree-attention function is registered under in transformers' ``AttentionInterface``."""
PACKED_SDPA_NAME = "medusa_sdpa"
"""The name :func:`hf_packed_sdpa_attention` is registered under (:func:`packed_sdpa`)."""


class AttentionBackendError(UserError, ValueError):
    """The requested tree attention cannot run here (no triton, no CUDA device, no nvcc)."""


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


ALIBI_MODEL_TYPES = ("bloom", "mpt")
"""Model types whose attention always adds ALiBi biases (Falcon does where its config sets ``alibi``)."""
OWN_MASK_MODEL_TYPES = ("xlm", "flaubert")
"""Model types that build their attention masks themselves, from their tokens' lengths or a 2-D padding
mask (XLM's ``get_masks``, which Flaubert shares): the tree's 4-D mask fails there (an assertion, in
every decoder), and with ``config.causal`` False, their default, every token attends the ones after it."""


def tree_refusal(model: torch.nn.Module) -> str | None:
    """Why no tree attention, the decoders' dense masks included, can verify a tree on ``model`` (None:
    nothing says so): a config that sets per layer what the decoders read once for the whole model
    (:data:`MODEL_WIDE_ATTRIBUTES`, :func:`per_layer_attributes`; a window or a chunk only where the
    model's code reads it, :func:`code_reads_window`, :func:`code_reads_chunk`); ALiBi models (Bloom,
    MPT, Falcon with ``alibi``) build their biases themselves, from the cache's columns (a tree node's
    column is not its position) or from a 2-D padding mask (Bloom and Falcon fail on the 4-D mask a tree
    needs); models with layers of a type the decoders do not serve (:func:`unserved_layer_types`);
    models that run layers several times in one forward (:func:`recurrent_loops`: Dory); any other model
    that keeps a recurrent state (:func:`stateful_model`: RWKV, xLSTM, which set no ``layer_types``);
    models that take no position ids (:func:`positionless_model`), which place a tree's nodes by their
    cache columns; models that take no KV cache (:func:`uncached_model`); models that build their
    attention masks themselves (:data:`OWN_MASK_MODEL_TYPES`: XLM, Flaubert); models whose tokens
    attend the ones after them (:func:`attends_both_ways`: the BERT family's causal LMs loaded without
    ``is_decoder=True``), last, as the one reason a user can lift by loading the model otherwise, then
    those transformers 5.17 computes otherwise than it means to (:data:`WRONG_IN_517`)."""
    config = model.config.get_text_config()
    kind = getattr(config, "model_type", None)
    per_layer = [
        name
        for name in per_layer_attributes(config)
        if name in MODEL_WIDE_ATTRIBUTES and (name not in _CODE_READS or _CODE_READS[name](model))
    ]
    if per_layer:
        return (
            f"{type(model).__name__} ({kind}) sets {', '.join(per_layer)} per layer (config.per_layer_config), "
            "which the Medusa tree decoders read once for the whole model (their masks give every layer of a "
            "type one window and one chunk), so they cannot verify trees on it: set it once for the whole "
            "model, outside per_layer_config"
        )
    if kind in ALIBI_MODEL_TYPES or getattr(config, "alibi", False):
        return (
            f"{type(model).__name__} ({kind}) adds ALiBi position biases it builds itself, which a tree's "
            "position ids and 4-D mask cannot set: the Medusa decoders cannot verify trees on it"
        )
    if kind in OWN_MASK_MODEL_TYPES:
        both = "" if getattr(config, "causal", False) else ", and attends both ways (config.causal=False)"
        return (
            f"{type(model).__name__} ({kind}) builds its attention masks itself from its tokens' lengths "
            f"or a 2-D padding mask{both}: a tree's 4-D mask cannot reach them, so the Medusa tree "
            "decoders cannot verify trees on it"
        )
    unserved = unserved_layer_types(model.config)
    if unserved:
        return (
            f"{type(model).__name__} ({kind}) has layers of type {', '.join(map(repr, unserved))} "
            "(config.layer_types), which the Medusa tree decoders cannot verify: they serve models "
            "whose layers are full, sliding-window or chunked attention (decode this one with model.generate)"
        )
    loops = recurrent_loops(config)
    if loops > 1:
        return (
            f"{type(model).__name__} ({kind}) runs its recurrent layers {loops} times in each forward "
            "(config.n_recurrent_loops), each pass with KV its own forward adds to the cache or reads beside "
            "it, which the Medusa tree decoders' caches and masks do not hold: they cannot verify trees on it "
            "(decode it with model.generate; with n_recurrent_loops=1 they serve it)"
        )
    stateful = stateful_model(model)
    if stateful is not None:
        return (
            f"{type(stateful).__name__} ({kind}) keeps a recurrent state (transformers marks it _is_stateful) "
            "that a tree's forward advances over every node and no step can roll back to the accepted path: "
            "the Medusa tree decoders cannot verify trees on it (decode it with model.generate)"
        )
    positionless = positionless_model(model)
    if positionless is not None:
        return (
            f"{type(positionless).__name__} ({kind}) takes no position_ids (neither its forward nor its "
            "decoder's names them): it places a tree's nodes by their cache columns, not their depths, so "
            "the Medusa tree decoders cannot verify trees on it (decode it with model.generate)"
        )
    uncached = uncached_model(model)
    if uncached is not None:
        return (
            f"{type(uncached).__name__} ({kind}) takes no KV cache (neither its forward nor its decoder's names "
            "cache or past_key_values): the Medusa tree decoders verify each tree on the cache of the tokens "
            "before it, so they cannot verify trees on it (decode it with model.generate)"
        )
    if attends_both_ways(model):
        return (
            f"{type(model_and_decoder(model)[0]).__name__} ({kind}) attends both ways (config.is_decoder="
            "False: each token attends the tokens after it too), which no KV cache and tree mask can "
            "reproduce, so the Medusa tree decoders cannot verify trees on it: load it with is_decoder=True "
            "(from_pretrained(..., is_decoder=True), or in its config.json) to make it a causal decoder"
        )
    defect = WRONG_IN_517.get(kind)
    implementation = getattr(config, "_attn_implementation", None)
    if (
        defect is not None
        and implementation not in defect[1]
        and transformers.__version__.startswith("5.17.")
    ):
        what, right_with = defect
        instead = "".join(f' or load it with attn_implementation="{name}"' for name in right_with)
        return (
            f"{type(model_and_decoder(model)[0]).__name__} ({kind}) of transformers "
            f"{transformers.__version__} {what.format(implementation=implementation)}, fixed in transformers "
            "5.18, so the Medusa tree decoders cannot verify trees on it: upgrade transformers "
            f"(pip install 'transformers>=5.18'){instead}"
        )
    return None


_BOTH_WAYS = "attends both ways{} (each token attends the tokens after it too)"
WRONG_IN_517: dict[str, tuple[str, tuple[str, ...]]] = {
    "megatron-bert": (_BOTH_WAYS.format(" even with is_decoder=True"), ()),
    "rembert": (_BOTH_WAYS.format(" even with is_decoder=True"), ()),
    "big_bird": (_BOTH_WAYS.format(" even with is_decoder=True"), ()),
    "doge": (_BOTH_WAYS.format(" with attn_implementation={implementation!r}"), ("eager",)),
    "git": (
        "adds its cache's length to the positions of a one-token forward (so its own generate decodes at "
        "twice the positions)",
        (),
    ),
}
"""Model types whose causal LM transformers 5.17 computes otherwise than it means to, and every release
from 5.18 to 5.24 computes as meant (checked 2026-12-07): what it does (a clause), and the attention
implementations it does not do it with. Found by building every causal LM type of 5.17 tiny and
running it (``is_decoder=True``, its default attention): the logits at positions 0..T-2 moved with the
last token for the first four (and for CpmAnt, RoFormer, XLM and XLNet, refused for what else they are;
Doge's SDPA forward skips the causal mask it adds its dynamic mask to, its eager one builds it); GIT's
plain greedy ``generate`` differed from 5.18's, and from the three decoders, which place each token at
its position."""


def attends_both_ways(model: torch.nn.Module) -> bool:
    """Whether ``model``'s tokens attend the tokens after them: its text config's ``is_decoder`` is
    False and its code reads that attribute (:func:`code_reads_is_decoder`), as the BERT family's
    causal LMs do to choose a causal or a bidirectional mask (BertLMHeadModel, BertGenerationDecoder,
    the ForCausalLM of RoBERTa, XLM-RoBERTa(-XL), CamemBERT, Data2VecText, RoBERTa-PreLayerNorm, ELECTRA,
    ERNIE, RemBERT, MegatronBERT, BigBird, X-MOD, RoCBert and RoFormer). A config without the attribute
    (Llama's, Whisper's: transformers 5.24 declares it on 50 config classes, not on PretrainedConfig) counts
    as False, and a model whose code never reads it is causal whatever its config says (GPT-NeoX's has
    it, False); the encoder-decoder families' ForCausalLM (Bart, TrOCR, ...) set it True themselves.

    Checked on transformers 5.24's causal LMs, each tiny model (fp32, 2 layers) built with
    ``is_decoder`` False and with True, its logits at positions 0..T-2 compared with the same input's
    whose last token differs (attention mask all ones): of the 196 model types, 178 built (357 models:
    335 causal, 22 not), and the rule says "both ways" of exactly 16, the families above with False;
    the other non-causal ones are XLM with ``causal=False`` (:data:`OWN_MASK_MODEL_TYPES`), CpmAnt and
    XLNet (whatever ``is_decoder``; refused first, taking no position ids). Of the 18 types that did not
    build, only Reformer's modules load ``config.is_decoder`` (its LM head requires True). The modules'
    ``is_causal`` attributes would have missed MegatronBERT, BigBird, RemBERT and RoFormer and said
    "both ways" of 24 causal models (Whisper's and Bart's cross-attention among them); a mention of
    ``config.is_decoder`` in the source would have said it of GPT-NeoX (a docstring's example).
    """
    if getattr(model.config.get_text_config(), "is_decoder", False):
        return False
    return code_reads_is_decoder(model)


def code_reads_is_decoder(model: torch.nn.Module) -> bool:
    """Whether ``model``'s code reads its config's ``is_decoder``: whether the source of a Python module
    defining the class of ``model`` or of one of its submodules loads ``config.is_decoder`` or
    ``<...>.config.is_decoder`` (an expression of its code: not a docstring's example, not an
    assignment), torch's modules and transformers' own outside ``transformers.models`` left out (as
    :func:`code_reads_window`). A module whose source cannot be read counts as not reading it: a config
    without ``is_decoder`` counts as False, so the other way would refuse any such model. The answer is
    kept per model and each module's per module, and :func:`attends_both_ways` asks only where the
    config says False: only a module that names ``config.is_decoder`` is parsed, once (the first check
    of a tiny BERT or GPT-NeoX took 20-40 ms, of another model of the same classes 0.1 ms; 2-core AMD
    EPYC, 2026-12-07)."""
    reads = _MODEL_READS_IS_DECODER.get(model)
    if reads is None:
        names = {type(module).__module__ for module in model.modules()}
        reads = _MODEL_READS_IS_DECODER[model] = any(
            _module_reads_is_decoder(name) for name in names if not _shared_module(name)
        )
    return reads


_MODEL_READS_IS_DECODER: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
_MODULE_READS_IS_DECODER: weakref.WeakKeyDictionary[types.ModuleType, bool] = weakref.WeakKeyDictionary()


def _module_reads_is_decoder(name: str) -> bool:
    """Whether the source of the Python module ``name`` loads ``config.is_decoder`` or
    ``<...>.config.is_decoder`` (False where it cannot be read), kept per module object (a module
    loaded again, remote code's, is read again)."""
    module = sys.modules.get(name)
    if module is None:
        return False
    reads = _MODULE_READS_IS_DECODER.get(module)
    if reads is None:
        try:
            source = inspect.getsource(module)
        except (TypeError, OSError):
            source = ""
        reads = _MODULE_READS_IS_DECODER[module] = "config.is_decoder" in source and any(
            isinstance(node, ast.Attribute)
            and node.attr == "is_decoder"
            and isinstance(node.ctx, ast.Load)
            and (
                (isinstance(node.value, ast.Name) and node.value.id == "config")
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "config")
            )
            for node in ast.walk(ast.parse(source))
        )
    return reads


def recurrent_loops(config) -> int:
    """How many times ``config`` (a text config) has its model run its recurrent layers in one forward:
    its ``n_recurrent_loops`` (Dory), else 1. Past 1, the forward keeps KV beyond the layers a cache
    has (per loop: it appends copies of the recurrent layers' cache layers, which the preallocated
    caches of the batched and static decoders do not own) or reads the cache's keys beside its update
    (the earlier loops of ``recurrent_kv_cache_mode="last_loop"``: every column a preallocated cache
    holds, none that a tree step's mask counts); with one loop it is a plain decoder."""
    return getattr(config, "n_recurrent_loops", None) or 1


def uncached_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model`` (under a PEFT wrapper: the model it wraps) where neither its forward nor its language
    model's (``get_decoder()``) names a KV cache argument (``cache``, transformers' name from 5.24, or
    ``past_key_values``): it recomputes every position at each call (GPT-1, Reformer's LM head, Gemma 4's
    assistant drafters in transformers 5.24). None: one of the two names one."""
    base, decoder = model_and_decoder(model)
    names = ("cache", "past_key_values")
    named = any(name in inspect.signature(m.forward).parameters for m in (base, decoder) for name in names)
    return None if named else base


def positionless_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model`` (under a PEFT wrapper: the model it wraps) where neither its forward nor its language
    model's (``get_decoder()``) names ``position_ids``: such a model counts its tokens' positions from
    its cache (learned or sinusoidal embeddings, rotary angles, offset by the cache's length: Bart, Marian,
    Pegasus, TrOCR and the other encoder-decoder families' ForCausalLM, ProphetNet, Musicgen, RoFormer;
    CpmAnt, XLNet) and drops the position ids a tree's nodes are given in its ``**kwargs``. A forward that names none
    but hands its ``**kwargs`` to a decoder that does (WhisperForCausalLM) is served: the positions reach
    it. None: one of the two names ``position_ids``."""
    base, decoder = model_and_decoder(model)
    named = any("position_ids" in inspect.signature(m.forward).parameters for m in (base, decoder))
    return None if named else base


def stateful_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model that makes ``model`` stateful: ``model`` (under a PEFT wrapper: the model it wraps) or its
    language model (``get_decoder()``) where transformers marks it ``_is_stateful`` (a state besides the KV
    cache, or instead of one, that the forward advances over every token: the models whose assisted
    generation ``generate`` refuses, as their state cannot be reset to the accepted tokens). None: neither
    is marked."""
    return next((m for m in model_and_decoder(model) if getattr(m, "_is_stateful", False)), None)


def model_and_decoder(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``model`` (under a PEFT wrapper: the model it wraps) and its language model (``get_decoder()``;
    the model itself where it has none): the two places :func:`stateful_model` and
    :func:`positionless_model` look."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    get_decoder = getattr(base, "get_decoder", None)
    return base, get_decoder() if callable(get_decoder) else base


def check_verifiable(model: torch.nn.Module) -> None:
    """Refuse a model no tree attention can verify (:func:`tree_refusal`): the check every decoder makes
    before its prefill (:func:`resolve_attention`), for a caller that makes it before its own work.

    Raises:
        AttentionBackendError: ``tree_refusal``'s reason, in one line.
    """
    reason = tree_refusal(model)
    if reason is not None:
        raise AttentionBackendError(reason)


MODEL_WIDE_ATTRIBUTES = (
    "sliding_window",
    "attention_chunk_size",
    "layer_types",
    "alibi",
    "no_rope_layers",
    "floor_scale",
    "attn_temperature_tuning",
)
"""Text-config attributes the decoders read once for the whole model: the window and the chunk their masks
and kernels give every layer of a type (:func:`layer_window`, :func:`attention_chunk`), the layer types,
ALiBi and Llama 4's query scaling (``check_cache_positions``). A config that sets one per layer is
refused (:func:`tree_refusal`); no stock causal LM of transformers 5.24 sets one per layer
(transformers' own mask functions read the window and the chunk once for the whole model too)."""


def per_layer_attributes(config) -> list[str]:
    """The attributes ``config`` (its text config) sets per layer, sorted: transformers' ``per_layer_config``
    (from 5.24; Gemma 4's ``head_dim``, Dots3's attention heads), whose global value is ambiguous: reading
    one off the whole config raises ``AmbiguousGlobalPerLayerAttributeError``, a RuntimeError that
    ``getattr``'s default does not catch. Empty for a config without."""
    return sorted(getattr(config.get_text_config(), "per_layer_attributes", None) or ())


def layer_configs(config) -> list:
    """``config``'s text config as each of its layers reads it: transformers' per-layer views where it sets
    attributes per layer (:func:`per_layer_attributes`), else the config itself, once."""
    config = config.get_text_config()
    return list(config.per_layer_config) if per_layer_attributes(config) else [config]


SERVED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""The ``config.layer_types`` entries the decoders serve: full attention, a sliding window of
``sliding_window`` positions and chunks of ``attention_chunk_size`` (:func:`attention_chunk`), each
applied by their masks and kernels."""


def unserved_layer_types(config) -> list[str]:
    """The types in ``config``'s ``layer_types`` (of its text config; each once, in order) that the
    decoders cannot serve: any but :data:`SERVED_LAYER_TYPES`. A windowed layer under another name
    (Zaya's "hybrid_sliding") would get no window from their masks and kernels, and a layer that keeps
    a state besides its KV cache (linear attention, Mamba, recurrent or convolution layers: Qwen3-Next,
    Jamba, RecurrentGemma, Falcon-H1, LFM2's "conv") advances it over every node of a tree, which no
    step can roll back to the accepted path. Empty for a config without ``layer_types``."""
    types = getattr(config.get_text_config(), "layer_types", None) or ()
    return [kind for kind in dict.fromkeys(types) if kind not in SERVED_LAYER_TYPES]


def kernel_refusal(model: torch.nn.Module, backend: str = "triton") -> str | None:
    """Why the tree kernel ``backend`` ("triton" or "cuda") cannot compute ``model``'s attention, as its
    class and config tell (None: nothing tells so; :func:`hf_tree_attention` refuses what only a
    layer's call shows). Softcapped scores, attention sinks and values narrower than the keys
    (multi-head latent attention): the Triton kernel computes them, the CUDA kernel does not."""
    name = type(model).__name__
    dispatches = layers_dispatch(model)
    if dispatches is None:  # no list of decoder layers, or no class source to read: their Python modules
        dispatches = any(_dispatches(module) for module in {type(m).__module__ for m in model.modules()})
    if not dispatches:
        # Such a model (GPT-Neo, Bloom, Falcon, MPT, GIT's text layers) never calls the kernel, and under
        # the kernel's implementation it builds no mask either: its tree would be attended without one.
        return f"{name} computes its attention itself, not through transformers' attention functions"
    if backend == "cuda" and (reason := _cuda_refusal(model)) is not None:
        return reason
    if (
        mixes_layer_kinds(model)
        and decoder_layers(model) is None
        and not any(isinstance(getattr(m, "layer_idx", None), int) for m in model.modules())
    ):
        kinds = "sliding-window" if mixes_windows(model) else "chunked"
        return (
            f"{name} mixes {kinds} and other layers, and the tree kernels cannot tell which is which "
            "(no module has a layer_idx, and no list of its decoder layers was found)"
        )
    return None


def _cuda_refusal(model: torch.nn.Module) -> str | None:
    """What the CUDA kernel does not compute and the Triton kernel does: softcapped scores, attention
    sinks, values of another width than the keys."""
    name = type(model).__name__
    layers = layer_configs(model.config.get_text_config())  # Gemma 4 sets head_dim per layer
    if any(getattr(layer, "attn_logit_softcapping", None) is not None for layer in layers):
        return (
            f"the CUDA kernel does not apply {name}'s attention softcapping (attn_logit_softcapping): use "
            "attention=triton or sdpa"
        )
    if any(param.rsplit(".", 1)[-1] == "sinks" for param, _ in model.named_parameters()):
        return (
            f"{name} has attention sinks, which the CUDA kernel does not apply: use attention=triton or sdpa"
        )
    for layer in layers:
        v_dim = getattr(layer, "v_head_dim", None)
        qk_dim = getattr(layer, "qk_head_dim", None) or getattr(layer, "head_dim", None)
        if v_dim is not None and qk_dim is not None and v_dim != qk_dim:
            return (
                f"{name}'s value heads ({v_dim}) are not as wide as its query and key heads ({qk_dim}), "
                "which the CUDA kernel needs: use attention=triton or sdpa"
            )
    return None


def attention_chunk(model: torch.nn.Module) -> int | None:
    """The chunk size of ``model``'s "chunked_attention" layers (Llama 4's ``attention_chunk_size``): such
    a layer's query at position p sees the key at position j only if ``j // chunk == p // chunk``,
    within the causal or tree rule; the one function every decoder asks (the dense masks, the static
    decoder's rules, the kernels' refusal). Read from the text config (a multimodal model nests it),
    where its ``layer_types`` name such a layer and the model's code reads the chunk
    (:func:`code_reads_chunk`, the rule :func:`model_window` applies to the window). None: no chunked
    layer, or a chunk the model never applies: a Llama whose config carries the key and such layer
    types attends every position, as its forward does."""
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None) or ()
    if "chunked_attention" not in types or not code_reads_chunk(model):
        return None  # also where it is set per layer, which reading it off the config would raise
    return getattr(config, "attention_chunk_size", None) or None


def chunk_refusal(model: torch.nn.Module, context: int | None) -> str | None:
    """Why the CUDA kernel cannot compute ``model``'s attention on a call of ``context`` positions (None:
    unknown, taken as long): chunked layers (:func:`attention_chunk`) whose chunks the call passes. A
    call that stays inside the first chunk sees no chunk boundary, and the kernel computes it. (The
    Triton kernel applies chunks, and ``auto`` never takes the CUDA kernel.)"""
    chunk = attention_chunk(model)
    if chunk is None or (context is not None and context <= chunk):
        return None
    return (
        f"{type(model).__name__}'s chunked attention layers (attention_chunk_size={chunk}), which the CUDA "
        f"kernel does not apply, see only their chunk of positions, and {_positions(context)} pass it: use "
        "attention=triton or sdpa"
    )


def _positions(context: int | None) -> str:
    return "the call's positions may" if context is None else f"the call's {context} positions"


def layers_dispatch(model: torch.nn.Module) -> bool | None:
    """Whether a module inside ``model``'s decoder layers (:func:`decoder_layers`) looks its attention
    function up in transformers' registry: the source of its class, or of a class it derives from, names
    ``ALL_ATTENTION_FUNCTIONS``. None where no list of decoder layers is found or no such source can be
    read. A Python module's mention is not enough: GIT's vision attention dispatches, its text
    attention (the decoder's) computes itself, in one file."""
    layers = decoder_layers(model)
    if layers is None:
        return None
    found = [_class_dispatches(cls) for cls in {type(m) for layer in layers for m in layer.modules()}]
    if True in found:
        return True
    return False if False in found else None


@functools.cache
def _class_dispatches(cls: type) -> bool | None:
    """Whether the source of ``cls`` or of a class it derives from (not torch's) names
    ``ALL_ATTENTION_FUNCTIONS``; None where none of them can be read."""
    read = False
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in ("torch", "builtins"):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        read = True
        if "ALL_ATTENTION_FUNCTIONS" in source:
            return True
    return False if read else None


def _dispatches(module_name: str) -> bool:
    """Whether the Python module ``module_name`` looks its attention functions up in transformers'
    registry (every modeling file whose layers call them does; the ``_supports_attention_backend`` flag
    is missing from some of those, StableLM's and Qwen3-Next's among them)."""
    module = sys.modules.get(module_name)
    return module is not None and hasattr(module, "ALL_ATTENTION_FUNCTIONS")


_STEP: ContextVar[TreeStep | None] = ContextVar("medusa_tree_step", default=None)
SCORE_MODIFIERS = ("softcap", "s_aux", "sinks", "position_bias", "indices", "block_indices")
"""Attention arguments some models pass that change the scores, the softmax or the keys attended
(Gemma-2's softcap, gpt-oss's sinks, T5-style biases, the key indices of sparse attention): the tree
kernels and the packed SDPA do not apply them, but for ``s_aux`` (attention sinks, one logit per query
head, as transformers' flash and flex attention read it) and ``softcap`` (a number), which the Triton
kernel applies."""


def model_window(model: torch.nn.Module) -> int | None:
    """The sliding window ``model`` applies: the one function every decoder asks (the dense masks through
    :func:`sliding_window_kinds`, the static decoder's rules, the kernels through the step's
    :func:`layer_window`). Its text config's ``sliding_window`` (a multimodal model, Gemma 3 from 4B on,
    nests it), where the model's code reads that attribute (:func:`code_reads_window`); None where the
    config sets none (or Qwen2-MoE's 0 without ``use_sliding_window``) or the code never reads it: a
    Llama whose config.json carries a ``sliding_window`` key (some fine-tunes' do) attends every
    position, as its forward does.

    transformers' ``generate`` is not that forward there: its default cache (transformers 5.24's
    ``DynamicCache(config=...)``) gives every layer of a config with a ``sliding_window`` a
    sliding-window cache layer, whatever the model, which keeps only the last ``window - 1`` positions,
    so such a Llama's prefill attends the whole prompt and each later token only the window; on a cache
    without the config (``generate(..., cache=DynamicCache())``) it attends everything, as the decoders
    do.
    """
    if not code_reads_window(model):
        return None  # also where it is set per layer, which reading it off the config would raise
    return getattr(model.config.get_text_config(), "sliding_window", None) or None


def code_reads_window(model: torch.nn.Module) -> bool:
    """Whether ``model``'s code may apply its config's ``sliding_window``: whether the source of a Python
    module defining the class of ``model`` or of one of its submodules mentions ``sliding_window``
    (remote code included; torch's modules and transformers' own outside ``transformers.models`` left
    out; read once per class). A module whose source cannot be read counts as mentioning it. The answer
    is kept per model (its classes are those it was built with; a PEFT wrapper is another model): a walk
    over its modules per call (0.25 ms for a 32-layer Mistral, 0.2 us once kept; 2-core AMD EPYC,
    2026-12-07) would be timed in every verification forward the calibration times
    (``verify_forward`` asks for the window at each call).

    A model applies the window through its masks (``create_sliding_window_causal_mask``, its own mask
    code in older remote code) or its attention call (``sliding_window=``), each of which names it.
    Checked on transformers 5.24's causal LMs (each tiny model's forward, SDPA or eager, with a window of
    4 against 1,000 on 14 tokens; 142 model types built): every model that windows mentions it (Mistral,
    Mixtral, Ministral, Phi-3, PhiMoE, Starcoder2, Doge, Qwen2/3 and Qwen3-MoE with
    ``use_sliding_window``, Gemma 2/3/4, Cohere 2, gpt-oss, Granite SWA, OLMo 3, Exaone 4, ...), and
    those that do not mention it ignore it (Llama, Gemma, Cohere, Granite, OLMo 2, GLM, Phi, GPT-2, ...).
    The exceptions mention it and are served as windowed, but do not window under SDPA or eager
    attention: OLMoE passes the window to its attention function, which only flash attention applies,
    and Moshi keeps it on its attention module. A model whose ``layer_types`` name no
    "sliding_attention" layer takes no window whatever its code says (SmolLM3, Laguna and Mellum in the
    check: their layers were all full attention, and so were their forwards).
    """
    return _code_mentions(model, _WINDOW_WORDS)


def code_reads_chunk(model: torch.nn.Module) -> bool:
    """Whether ``model``'s code may apply its config's ``attention_chunk_size``, found as
    :func:`code_reads_window` finds the window (kept per model, read once per class): whether the source
    of a Python module defining the class of ``model`` or of one of its submodules mentions the chunk
    (``attention_chunk_size``), a chunked layer (``chunked_attention``: Llama 4 maps its layer type to
    transformers' ``create_chunked_causal_mask``, which reads the chunk) or
    ``create_masks_for_generate`` (transformers' masks for every layer type of the config, the chunked
    ones from the chunk).

    Checked on transformers 5.24's causal LMs (each tiny model's forward, SDPA or eager, with a chunk of
    4 against 1,000 on 14 tokens, with and without every layer "chunked_attention": 143 model types
    built, 98 with such layers; the multimodal ones too large for the check left out): Llama 4 alone
    applies the chunk, and its code mentions it. Of the others that mention one of these, Doge does not
    apply it: it defines a ``create_masks_for_generate`` of its own, for ``generate``, and a module's
    definition of a function of that name alone is no mention (:func:`_source_mentions`); Bloom,
    DeepSeek-V4, Falcon-H1, Nemotron-H and Zaya are refused for what else they are. The
    rest ignore it (Llama, Mistral, Mixtral, Phi-3, Gemma, GPT-2, OLMoE, ...) or fail on such a layer
    type (Gemma 2, Gemma 3's text model, Qwen2/3, Cohere 2, gpt-oss, ...: no mask for it). Gemma 3's
    multimodal model builds its masks with ``create_masks_for_generate``, which would chunk such layers.
    """
    return _code_mentions(model, _CHUNK_WORDS)


_WINDOW_WORDS = ("sliding_window",)
_CHUNK_WORDS = ("attention_chunk_size", "chunked_attention", "create_masks_for_generate")
_CODE_READS: dict[str, Callable[[torch.nn.Module], bool]] = {
    "sliding_window": code_reads_window,
    "attention_chunk_size": code_reads_chunk,
}
"""The :data:`MODEL_WIDE_ATTRIBUTES` a model's code may ignore, and the function that says whether it
reads them: a config's window or chunk applies only where it does."""
_MODEL_MENTIONS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[str, ...], bool]] = (
    weakref.WeakKeyDictionary()
)
_CLASS_MENTIONS: weakref.WeakKeyDictionary[type, dict[tuple[str, ...], bool]] = weakref.WeakKeyDictionary()


def _code_mentions(model: torch.nn.Module, words: tuple[str, ...]) -> bool:
    """Whether the source of a Python module defining the class of ``model`` or of one of its submodules
    mentions one of ``words`` (:func:`_class_mentions`), kept per model."""
    kept = _MODEL_MENTIONS.setdefault(model, {})
    found = kept.get(words)
    if found is None:
        classes = {type(module) for module in model.modules()}
        found = kept[words] = any(_class_mentions(cls, words) for cls in classes)
    return found


def _class_mentions(cls: type, words: tuple[str, ...]) -> bool:
    """Whether the source of ``cls``'s Python module mentions one of ``words`` (False for torch's and
    transformers' shared modules; True where the source cannot be read), cached per class."""
    kept = _CLASS_MENTIONS.setdefault(cls, {})
    found = kept.get(words)
    if found is None:
        name = cls.__module__
        found = kept[words] = not _shared_module(name) and any(_source_mentions(name, word) for word in words)
    return found


def _shared_module(name: str) -> bool:
    """Whether the Python module ``name`` is torch's or transformers' own outside ``transformers.models``
    (code every model shares, which reads no model's config attributes for it)."""
    return name.split(".", 1)[0] == "torch" or (
        name.startswith("transformers.") and not name.startswith("transformers.models.")
    )


def _source_mentions(module_name: str, word: str) -> bool:
    """Whether the source of the Python module ``module_name`` contains ``word`` other than as the name
    of a function it defines (Doge's own ``create_masks_for_generate``, which ``generate`` calls and its
    forward does not; True where the source cannot be read)."""
    try:
        text = inspect.getsource(sys.modules[module_name])
    except (KeyError, TypeError, OSError):
        return True
    return text.count(word) > text.count(f"def {word}(")


def sliding_window_kinds(model: torch.nn.Module) -> tuple[int | None, str]:
    """(window, kind) of ``model``'s attention as its masks apply it: the window is :func:`model_window`;
    kind is "full" (no window), "sliding" (every layer windowed: its text config has no ``layer_types``,
    or they are all "sliding_attention") or "mixed" (the "sliding_attention" layers of ``layer_types``)."""
    window = model_window(model)
    if window is None:
        return None, "full"
    types = getattr(model.config.get_text_config(), "layer_types", None)
    if types is None:
        return window, "sliding"
    if all(t == "sliding_attention" for t in types):
        return window, "sliding"
    if any(t == "sliding_attention" for t in types):
        return window, "mixed"
    return None, "full"


def mixes_windows(model: torch.nn.Module) -> bool:
    """Whether ``model`` windows some of its layers and not others (:func:`sliding_window_kinds`): such a
    model's attention layers differ in window by their layer's type, which the kernels must then know
    (:func:`layer_window`)."""
    return sliding_window_kinds(model)[1] == "mixed"


def mixes_layer_kinds(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention layers differ in what the kernels apply by their layer's type: some
    windowed and others not (:func:`mixes_windows`), or some chunked and others not (Llama 4's chunked
    and global layers, :func:`attention_chunk`). The kernels must then know each layer's type
    (:func:`layer_window`, :func:`layer_chunk`)."""
    if mixes_windows(model):
        return True
    types = getattr(model.config.get_text_config(), "layer_types", None) or ()
    return attention_chunk(model) is not None and any(t != "chunked_attention" for t in types)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The list of ``model``'s decoder layers, entry i the layer of ``layer_types[i]`` (of the text
    config; ``num_hidden_layers`` entries without ``layer_types``), as the model's own forward pairs
    each layer with its mask: in its decoder (``get_decoder()``, a multimodal model's language model),
    the ``layers`` list of that length, else the one list of that length there. None: not found, or
    several lists of that length and none named ``layers``."""
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None)
    count = len(types) if types else getattr(config, "num_hidden_layers", None)
    get_decoder = getattr(model, "get_decoder", None)
    root = get_decoder() if callable(get_decoder) else model
    lists = [
        (name, module)
        for name, module in root.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == count
    ]
    named = [module for name, module in lists if name.rsplit(".", 1)[-1] == "layers"]
    if len(named) == 1:
        return named[0]
    return lists[0][1] if len(lists) == 1 else None


def layer_positions(model: torch.nn.Module) -> dict[int, int]:
    """For a model whose layers mix window or chunk kinds (:func:`mixes_layer_kinds`): the ``id`` of every
    module inside its decoder layer i (:func:`decoder_layers`) -> i, which tells :func:`layer_window`
    and :func:`layer_chunk` the layer of an attention module that does not say it (no ``layer_idx``).
    Empty for any other model, whose layers all window and chunk alike, or where no list of decoder
    layers is found. Ids, not modules:
    ``torch.compile`` reads ``id(module)`` as a constant of the trace.

    Kept per model (read-only: the same mapping at every call), as :func:`code_reads_window` is: the
    walk over the model's modules would otherwise be timed in every verification forward the
    calibration times through a kernel (``verify_forward`` asks at each call)."""
    positions = _LAYER_POSITIONS.get(model)
    if positions is None:
        layers = decoder_layers(model) if mixes_layer_kinds(model) else None
        positions = (
            {} if layers is None else {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}
        )
        _LAYER_POSITIONS[model] = positions
    return positions


_LAYER_POSITIONS: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, int]] = weakref.WeakKeyDictionary()


def layer_window(
    module: torch.nn.Module,
    positions: Mapping[int, int] | None = None,
    window: int | None = None,
    layer_types: Sequence[str] | None = None,
) -> int | None:
    """The sliding window of ``module``'s layer as its model's masks apply it: ``window`` (the model's,
    :func:`model_window`; None: none) on every layer, or on the layers that ``layer_types`` (its text
    config's) calls "sliding_attention". The one window the decoders' masks and the kernels' ancestor
    bits know for a layer (:func:`hf_tree_attention` refuses a layer that passes another).

    Where the layers mix window kinds, the layer's type is ``layer_types[i]`` for the layer's index i:
    its ``layer_idx``, else its decoder layer's place in ``positions`` (:func:`layer_positions`).

    Raises:
        AttentionBackendError: the layers mix window kinds and neither tells which layer
            ``module`` is.
    """
    if window is None:
        return None
    if layer_types is None or all(t == "sliding_attention" for t in layer_types):
        return window
    if not any(t == "sliding_attention" for t in layer_types):
        return None
    layer = _layer_index(module, positions, layer_types, "sliding-window")
    return window if layer_types[layer] == "sliding_attention" else None


def layer_chunk(
    module: torch.nn.Module,
    positions: Mapping[int, int] | None = None,
    chunk: int | None = None,
    layer_types: Sequence[str] | None = None,
) -> int | None:
    """The chunk of ``module``'s layer as its model's masks apply it: ``chunk`` (the model's,
    :func:`attention_chunk`; None: none) on the layers that ``layer_types`` (its text config's) calls
    "chunked_attention" (the layer's type found as :func:`layer_window` finds it).

    Raises:
        AttentionBackendError: the layers mix chunked and other layers and neither the layer's
            ``layer_idx`` nor ``positions`` tells which layer ``module`` is.
    """
    if chunk is None or not layer_types:
        return None
    if all(t == "chunked_attention" for t in layer_types):
        return chunk
    layer = _layer_index(module, positions, layer_types, "chunked")
    return chunk if layer_types[layer] == "chunked_attention" else None


def _layer_index(
    module: torch.nn.Module, positions: Mapping[int, int] | None, layer_types: Sequence[str], kind: str
) -> int:
    """``module``'s layer: its ``layer_idx``, else its decoder layer's place in ``positions``."""
    layer = getattr(module, "layer_idx", None)
    if layer is None and positions:
        layer = positions.get(id(module))
    if not isinstance(layer, int) or not 0 <= layer < len(layer_types):
        raise AttentionBackendError(
            f"{type(module).__name__} does not say which layer it is (no layer_idx, not inside a decoder "
            f"layer of its model's list), and its model mixes {kind} and other layers: use attention=sdpa"
        )
    return layer


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
