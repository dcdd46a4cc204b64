"""Which models the tree decoders can verify and which models' attention the tree kernels compute:
:func:`tree_refusal` (:func:`check_verifiable`), why no tree attention can verify a model (settings per
layer, ALiBi, masks of its own, layer types the decoders do not serve, recurrent loops or state, no
position ids, no KV cache, attention both ways, transformers 5.17's defects); :func:`kernel_refusal`
and :func:`chunk_refusal`, why a kernel cannot compute its attention (layers that compute it
themselves, :func:`layers_dispatch`; the CUDA kernel's softcaps, sinks, narrower values and chunks)."""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import types
import weakref
from collections.abc import Callable

import torch
import transformers

from .errors import AttentionBackendError
from .layers import (
    _shared_module,
    attention_chunk,
    code_reads_chunk,
    code_reads_window,
    decoder_layers,
    mixes_layer_kinds,
    mixes_windows,
)

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
            f"{type(stateful).__name__} ({kind}) keeps a recurrent state (transformers' _is_stateful) "
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


STATEFUL_TYPES = frozenset({"rwkv", "xlstm"})
"""transformers' model types that keep a recurrent state and name no layer types (``config.layer_types``,
which names the others' recurrent layers). Up to 5.24 transformers marked them ``_is_stateful``; 5.25
dropped the mark (its assisted generation asks the cache whether it can be cropped instead), so they
are named here."""


def stateful_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model that makes ``model`` stateful: ``model`` (under a PEFT wrapper: the model it wraps) or its
    language model (``get_decoder()``) where transformers (up to 5.24) or a model's remote code marks it
    ``_is_stateful``, or whose model type is one of :data:`STATEFUL_TYPES` (a state besides the KV cache,
    or instead of one, that the forward advances over every token: the models whose assisted generation
    ``generate`` refused, as their state cannot be reset to the accepted tokens). None: neither is."""
    return next(
        (
            m
            for m in model_and_decoder(model)
            if getattr(m, "_is_stateful", False)
            or getattr(getattr(m, "config", None), "model_type", None) in STATEFUL_TYPES
        ),
        None,
    )


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
_CODE_READS: dict[str, Callable[[torch.nn.Module], bool]] = {
    "sliding_window": code_reads_window,
    "attention_chunk_size": code_reads_chunk,
}
"""The :data:`MODEL_WIDE_ATTRIBUTES` a model's code may ignore, and the function that says whether it
reads them: a config's window or chunk applies only where it does."""


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
