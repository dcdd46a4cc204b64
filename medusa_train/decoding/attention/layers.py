"""Each layer's sliding window and chunk as a model's code and masks apply them: the model's
(:func:`model_window`, :func:`attention_chunk`; read only where its code reads them,
:func:`code_reads_window`, :func:`code_reads_chunk`), which layers they apply to
(:func:`sliding_window_kinds`, :func:`mixes_layer_kinds`) and an attention module's own
(:func:`layer_window`, :func:`layer_chunk`; its layer found by :func:`decoder_layers` and
:func:`layer_positions` where it does not say it)."""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Mapping, Sequence

import torch

from .errors import AttentionBackendError


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
