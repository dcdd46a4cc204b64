"""Medusa tree decoding behind transformers' ``model.generate(custom_generate=<export>, trust_remote_code=True)``.

transformers (5.x, ``generation/utils.py``: ``GenerationMixin.generate`` and ``load_custom_generate``)
runs the ``generate(model, **generate_arguments)`` function of ``<repo or dir>/custom_generate/generate.py``
when ``generate`` gets ``custom_generate=<repo or dir>``: it first checks the packages listed in
``custom_generate/requirements.txt`` and the file's imports, copies the file into its modules cache
and calls the function with every argument ``generate`` got (``input_ids``, ``attention_mask``,
``max_new_tokens``, ``generation_config``, ...), without ``custom_generate`` itself.

``stage=export`` writes that folder into the export (:func:`write_custom_generate`): a small
``generate.py`` that calls :func:`generate` here, and ``requirements.txt``. :func:`generate` finds the
export (the ``custom_generate`` value ``generate`` was called with, a Hub id fetched with the call's
``revision``, ``token``, ``local_files_only``, ``cache_dir``, ``force_download``, ``proxies`` and
``repo_type`` as its ``generate.py`` was; else the folder the export was written to; ``medusa_heads=``
overrides both), loads its heads and tree once per model (again when their files change: an export
written again into the same folder), checks they belong to the model, and decodes:

- settings as plain ``generate`` resolves them (the call's arguments over ``model.generation_config``
  over transformers' defaults): ``max_new_tokens`` (or ``max_length``, counted against the padded
  batch's width for every row; one that leaves the prompt no room is a ``ValueError``, as in ``generate``), ``do_sample``, ``temperature``,
  ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` and ``min_new_tokens`` / ``min_length`` (on
  every node's logits, as generate's processors apply them: :mod:`medusa_train.decoding.processors`), ``eos_token_id``, ``pad_token_id``, ``return_dict_in_generate``,
  ``streamer`` (one prompt: it gets the prompt, then each step's accepted tokens as they are decided,
  then ``end()``); a setting that changes ``generate``'s output and that Medusa decoding does not
  apply (``no_repeat_ngram_size``, ``bad_words_ids``, ``stop_strings``, ... :data:`_UNAPPLIED_SETTINGS`),
  from the call or from ``model.generation_config``, is a ``ValueError`` naming the value that turns it off;
- ``do_sample=False``: greedy acceptance, output identical to plain greedy ``generate``;
  ``do_sample=True``: exact sampling (the distribution of ``generate(do_sample=True)`` with the same
  temperature, top_k, top_p and min_p, warped in generate's order); ``medusa_acceptance="typical"``: Medusa's typical
  acceptance at ``temperature`` (``medusa_posterior_threshold``, ``medusa_posterior_alpha``);
- a batch (B > 1, left padding) through :func:`~medusa_train.decoding.medusa_generate_batch`, each
  row without its padding (without an ``attention_mask``, the one ``generate`` infers: every
  ``pad_token_id`` of the prompt masked, unless it is an EOS token); B = 1 through :func:`~medusa_train.decoding.medusa_generate`, as is each
  row of a batch in turn on a model spread over devices (``device_map``: the batched decoder needs
  one device);
- ``cache_implementation="static"`` (what asks plain ``generate`` for its static cache and, on a GPU,
  its compiled forward): the static-shape decoder, :class:`~medusa_train.decoding.StaticDecoder`, whose
  whole step is captured as one CUDA graph on a CUDA device (``disable_compile=True``: not captured;
  on other devices it is compiled only with a ``compile_config`` that compiles on all devices, as
  transformers does); greedy, typical or exact sampling (its draws inside the step, from torch's
  default generator). The decoder, its KV cache and its capture are
  kept on the model for the next call of the same kind (same rows, tree, acceptance, attention), at
  most :data:`MAX_STATIC_DECODERS` kinds, the least recently used dropped first (:func:`release`
  frees them all, and the heads);
- ``medusa_attention``: the tree attention of the verification forwards ("auto", "sdpa", "triton" or
  "cuda", :func:`~medusa_train.decoding.attention.resolve_attention`); by default the one the export's
  tree was calibrated with where ``auto`` would take another at the calibration's context
  (:func:`_calibrated_attention`), else "auto";
- returns what ``generate`` returns: ``(B, T + n)`` long ids, prompt as given then the new tokens,
  rows that stopped early padded with ``pad_token_id``; with ``return_dict_in_generate`` a
  ``GenerateDecoderOnlyOutput`` with ``sequences`` and, with ``use_cache`` (the default), the cache
  ``generate``'s carries (field ``cache``; ``past_key_values`` before transformers 5.24): the keys and
  values of ``sequences[:, :-1]`` and nothing else (the tree's other columns cut off), a batch in the
  left-padded layout (the padding's entries zeros: every later forward masks them), a ``DynamicCache``
  in the layers of ``generate``'s (``DynamicCache(config=...)``: a sliding-window or chunked layer keeps
  the last ``window - 1`` tokens, a layer that reads an earlier layer's KV, Gemma 3n's and Gemma 4's
  ``num_kv_shared_layers``, none; a window the config carries and the model's code never reads, a
  Llama's, keeps every token, as the model attends them, where ``generate``'s keeps the window's
  last: :func:`_in_generates_layers`), or for ``cache_implementation="static"`` a ``StaticCache`` of
  ``generate``'s size (prompt + ``max_new_tokens`` - 1 columns, or ``max_cache_len``). The decoders'
  own KV goes into it (:func:`_generate_cache`); what none computed, a row of a batch that stopped
  before the longest (its last token and the padding ``generate`` runs through the model after it),
  by one forward;
- a cache to go on from (``past_key_values``, ``cache`` from transformers 5.24): a ``DynamicCache`` of
  one unpadded prompt whose layers keep every token, or the last tokens of the window the model applies
  there, or no KV (one this function returned, or plain ``generate``'s); only the prompt's tokens it
  does not hold are prefilled (its window layers decoded on as layers that keep every token, the
  tokens they no longer hold zeros, which the window masks: :func:`_unwindowed`), and it is returned
  gone on, in its own layers, as ``generate`` returns the cache it gets (a window layer recording its
  past recording it again). An empty one (``DynamicCache(config=...)`` before any forward) is taken
  whatever window its layers were made with and given back in the model's windows. Any other (a
  batch's, a ``StaticCache``, a window layer holding tokens of a window the model does not apply,
  such as plain ``generate``'s of that Llama, which lost tokens the model attends, or with
  ``cache_implementation="static"``, which ``generate`` refuses too) is a ``ValueError`` saying what
  to pass (:func:`_check_passed_cache`);
- past the model's ``max_position_embeddings``: on, as plain ``generate`` goes on (it warns; so does
  this, once), the same tokens; stopped there, with a warning saying why, only where decoding must stop
  to be ``generate``'s (:func:`~medusa_train.decoding.generate.position_bound`: positions a learned
  or fixed table of that many rows, past which plain ``generate`` fails; or a dynamic NTK RoPE).

Needs torch, transformers and this package only (no Hydra): it runs wherever ``generate`` runs.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, StaticCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from medusa_train import __version__
from medusa_train.backbone import (
    is_files_fingerprint,
    local_fingerprints,
    recorded_base,
    trained_backbone_dir,
)
from medusa_train.backbone_source import is_adapter_dir
from medusa_train.card_inputs import calibration_input, read_checked
from medusa_train.decoding.attention import (
    ATTENTION_CHOICES,
    AttentionBackendError,
    attention_chunk,
    check_verifiable,
    one_call_per_model,
    resolve_attention,
    sliding_window_kinds,
)
from medusa_train.decoding.batched import check_one_device, medusa_generate_batch, model_devices
from medusa_train.decoding.generate import (
    PackedHeads,
    context_limit,
    dynamic_entries,
    eos_ids,
    medusa_generate,
    position_bound,
)
from medusa_train.decoding.static import (
    StaticDecoder,
    capacity_for,
    columns_needed,
    host_synced_rope,
    row_budgets,
)
from medusa_train.decoding.tree import TreeBuffers, TreeError, load_choices
from medusa_train.errors import HeadsFormatError
from medusa_train.formats import load_heads
from medusa_train.heads_layout import MEDUSA, VLLM
from medusa_train.hf_compat import NEW_NAME, OLD_NAME, NoKVLayer, cache_kwargs, output_cache_field
from medusa_train.workdir import CALIBRATION, CHOICES, atomic_write_text

log = logging.getLogger(__name__)

FOLDER = "custom_generate"
"""The export's sub-folder transformers loads ``generate.py`` and ``requirements.txt`` from."""
MIN_TORCH = "2.11"
MIN_TRANSFORMERS = "5.17"
"""Lowest torch / transformers the package supports (pyproject.toml), written into requirements.txt."""
ACCEPTANCE = ("greedy", "typical", "sample")
"""``medusa_acceptance`` values; None picks greedy or sample from ``do_sample``."""

_UNAPPLIED_SETTINGS = {  # generate settings that change outputs, that Medusa decoding does not apply: refused
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "typical_p": 1.0,
    "top_h": None,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "exponential_decay_length_penalty": None,
    "stop_strings": None,
    "max_time": None,
    "guidance_scale": None,
    "penalty_alpha": None,  # contrastive search
    "dola_layers": None,
    "token_healing": False,
    "watermarking_config": None,
}
_NOT_RETURNED = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
"""``generate`` outputs besides the sequences that a ``return_dict_in_generate`` call may ask for."""
_HUB_ARGUMENTS = (
    "revision",
    "token",
    "cache_dir",
    "local_files_only",
    "force_download",
    "proxies",
    "repo_type",
)
"""``generate`` arguments transformers loads a Hub ``custom_generate`` with (``load_custom_generate``
hands them to ``get_cached_module_file``): the heads and the tree are downloaded with them too (the
same revision as ``generate.py``); a local folder has no use for them."""
_REFUSED_ARGUMENTS = (  # generate() arguments that need the standard decoding loop
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)

GENERATE_PY = '''"""Medusa tree decoding for `model.generate(**inputs, custom_generate=<this folder>, trust_remote_code=True)`.

Written by `python -m medusa_train stage=export`. It needs torch, transformers and medusa_train
(requirements.txt); the heads and the tree are read from the export this folder belongs to (the
`custom_generate` value `generate` was called with, else EXPORT_DIR; `medusa_heads=<dir>` overrides).
Arguments: those of `generate` (max_new_tokens, do_sample, temperature, top_k, top_p, min_p,
repetition_penalty, min_new_tokens, eos_token_id, a left-padded batch with its attention_mask,
cache_implementation="static" for the decoder captured as a CUDA graph, return_dict_in_generate for the
cache too, past_key_values to go on from one), plus medusa_acceptance="typical",
medusa_attention="auto"|"sdpa"|"triton"|"cuda" (default: the one the tree was calibrated with where auto
would take another), medusa_choices=<paths>.
See medusa_train.custom_generate.
"""

from medusa_train.custom_generate import generate as medusa_generate

EXPORT_DIR = {export_dir!r}


def generate(model, *args, **kwargs):
    """`model.generate` with Medusa heads: same arguments, same return value."""
    return medusa_generate(model, *args, export_dir=EXPORT_DIR, **kwargs)
'''


def write_custom_generate(export_dir: Path, final_dir: Path) -> Path:
    """Write ``export_dir/custom_generate/`` (``generate.py`` + ``requirements.txt``); returns the folder.

    Args:
        export_dir: where the files go (the export's staging folder).
        final_dir: the export's final place, recorded in ``generate.py`` as the fallback location.
    """
    folder = export_dir / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "generate.py", GENERATE_PY.format(export_dir=str(final_dir)))
    atomic_write_text(folder / "requirements.txt", requirements_txt())
    return folder


def requirements_txt() -> str:
    """The packages ``generate.py`` needs, as transformers' ``check_python_requirements`` reads them."""
    return (
        "# custom_generate/generate.py runs medusa_train's tree decoder\n"
        f"medusa_train>={__version__}\n"
        f"torch>={MIN_TORCH}\n"
        f"transformers>={MIN_TRANSFORMERS}\n"
    )


@dataclass
class _Loaded:
    """An export's heads packed for one model, and its tree on the model's device; ``key``: what they
    were loaded from and for (export folder, its files' :func:`_stamp`, tree, check, the model's device
    and dtype); ``calibrated``: the tree attention the tree was calibrated with and the context it was
    timed at (:func:`_calibration_of`), None when not known."""

    packed: PackedHeads
    tree: TreeBuffers
    key: tuple
    calibrated: tuple[str, int] | None = None


_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {_Loaded.key: _Loaded}
_WARNED: set[str] = set()  # warnings already given in this process


@one_call_per_model  # the heads, tree and static decoders kept on the model, and its decoders' switches
def generate(
    model,
    inputs: torch.Tensor | None = None,
    generation_config=None,
    *,
    export_dir: str | None = None,
    medusa_heads: str | os.PathLike | None = None,
    medusa_choices: list[list[int]] | None = None,
    medusa_acceptance: str | None = None,
    medusa_posterior_threshold: float = 0.09,
    medusa_posterior_alpha: float = 0.3,
    medusa_attention: str | None = None,
    medusa_check_base: bool = True,
    **kwargs,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """``model.generate`` with the Medusa heads of an export (what ``custom_generate/generate.py`` calls).

    Args:
        model: the base model (a Hugging Face causal LM with "sdpa" or "eager" attention); for a
            Medusa-2 export, the export's ``backbone/``.
        inputs: ``(B, T)`` prompt ids (or ``input_ids=`` in ``kwargs``); a batch is left-padded,
            with its ``attention_mask``.
        generation_config: as for ``generate``.
        export_dir: where ``stage=export`` wrote the export (``generate.py``'s ``EXPORT_DIR``); used
            when ``generate`` was not called with a local ``custom_generate`` folder or Hub id.
        medusa_heads: an export folder or a heads folder (either layout); wins over both.
        medusa_choices: the tree as index paths; default the export's ``medusa_choices.json``.
        medusa_acceptance: "greedy", "typical" or "sample"; None: greedy, or sample with ``do_sample``.
        medusa_posterior_threshold, medusa_posterior_alpha: typical acceptance's epsilon and delta.
        medusa_attention: tree attention of the verification forwards: "auto" (the tree-attention
            kernel on a CUDA device from the lengths where it measured faster than SDPA, else SDPA;
            always SDPA on a CPU), "sdpa" (the model's attention with a dense mask), "triton" or
            "cuda" (that kernel, no mask built); None: the export's tree's
            (:func:`_calibrated_attention`).
        medusa_check_base: False decodes over a base model whose checkpoint files differ from the
            one the heads were trained on (outputs stay exact, fewer drafts are accepted).
        **kwargs: ``generate``'s other arguments (``input_ids``, ``attention_mask``, generation
            settings such as ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``,
            ``repetition_penalty``, ``eos_token_id``,
            a ``streamer`` for one prompt;
            ``cache_implementation="static"`` with ``disable_compile`` and ``compile_config``: the
            static-shape decoder; ``past_key_values`` (``cache``): a ``DynamicCache`` of one
            prompt to go on from; see the module docstring).

    Returns:
        ``(B, T + n)`` long ids on the prompt's device, or a ``GenerateDecoderOnlyOutput`` with
        ``sequences`` and the cache ``generate``'s carries (``return_dict_in_generate=True``; the
        cache with ``use_cache``, see the module docstring).

    Raises:
        ValueError: the heads do not belong to ``model``, no export is found, or an argument Medusa
            decoding cannot honour (beam search, several sequences per prompt, logits processors,
            a setting it does not apply such as ``bad_words_ids``, right padding, a ``max_length``
            that leaves the prompt no room, a cache it cannot go on from, an unknown
            ``medusa_acceptance`` or ``medusa_attention``); an attention
            kernel that cannot run here; a model no tree decoder verifies (ALiBi, layers of a type
            other than full, sliding-window or chunked attention, a recurrent state, no position ids,
            attention both ways: :func:`~medusa_train.decoding.attention.tree_refusal`), before
            anything else.
    """
    check_verifiable(model)  # a model no tree decoder verifies: refused before the export is read
    hub = {name: kwargs.pop(name) for name in _HUB_ARGUMENTS if name in kwargs}
    source = _find_export(model, medusa_heads, export_dir, hub)
    refused = [name for name in _REFUSED_ARGUMENTS if kwargs.pop(name, None) is not None]
    if refused:
        raise ValueError(f"Medusa decoding does not take {', '.join(refused)}: call generate without them")
    kwargs.pop("synced_gpus", None)
    kwargs.pop("tokenizer", None)  # generate reads it for stop_strings only, which are refused
    streamer = kwargs.pop("streamer", None)
    input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
    attention_mask = kwargs.pop("attention_mask", None)
    if input_ids is None:
        raise ValueError(
            "Medusa decoding needs prompt ids: pass input_ids (e.g. **tokenizer(text, return_tensors='pt'))"
        )
    default_length = (  # as generate decides it: then max_length counts new tokens only
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    model_kwargs.pop("use_cache", None)
    # the cache to go on from: generate's argument under either name (transformers 5.24 renamed it)
    passed = [model_kwargs.pop(name, None) for name in (NEW_NAME, OLD_NAME)]
    passed = next((c for c in passed if c is not None), None)
    for name in ("output_attentions", "output_hidden_states"):  # for the forwards: outputs not returned
        model_kwargs.pop(name, None)  # (named in a warning with return_dict_in_generate, as output_scores)
    # as in generate (_validate_model_kwargs), a model argument given as None is no argument
    model_kwargs = {name: value for name, value in model_kwargs.items() if value is not None}
    if model_kwargs:
        raise ValueError(
            "Medusa decoding takes input_ids, attention_mask and past_key_values only, not "
            f"{sorted(model_kwargs)}"
        )
    rule = _acceptance(config, medusa_acceptance)
    if medusa_attention is not None and medusa_attention not in ATTENTION_CHOICES:
        raise ValueError(f"medusa_attention must be one of {ATTENTION_CHOICES}, got {medusa_attention!r}")
    static = config.cache_implementation == "static"
    eos = eos_ids(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    width = input_ids.shape[1]
    limit, bound = context_limit(model), position_bound(model)
    max_new = _max_new_tokens(config, width, default_length, limit)
    loaded = _load(model, source, medusa_choices, check_base=medusa_check_base)

    if attention_mask is None:  # as generate: its padding masked when the prompt holds pad_token_id
        attention_mask = _inferred_mask(input_ids, config.pad_token_id, eos)
    device = model.get_output_embeddings().weight.device
    rows = [row.to(device) for row in _unpadded_rows(input_ids, attention_mask)]  # B x (1, T_i)
    _check_passed_cache(model, passed, static, rows, width)
    # generate's output carries its cache with return_dict_in_generate (and use_cache, the default)
    want_cache = bool(config.return_dict_in_generate and config.use_cache)
    attention = _calibrated_attention(loaded, device) if medusa_attention is None else medusa_attention
    settings = dict(
        max_new_tokens=max(0, max_new),
        stop_at_context=bound is not None,  # else past max_position_embeddings, as generate goes on
        tree=loaded.tree,
        acceptance=rule,
        temperature=1.0 if config.temperature is None else float(config.temperature),  # None: no warper
        top_p=1.0 if config.top_p is None else float(config.top_p),
        top_k=int(config.top_k or 0),
        min_p=float(config.min_p or 0.0),
        repetition_penalty=float(config.repetition_penalty or 1.0),
        min_new_tokens=int(config.min_new_tokens or 0),
        min_length=int(config.min_length or 0),
        posterior_threshold=medusa_posterior_threshold,
        posterior_alpha=medusa_posterior_alpha,
        eos_token_id=eos,
    )
    stream = None
    if streamer is not None:  # as generate streams: the prompt, then the new tokens as they come, then end()
        if len(rows) != 1:
            raise ValueError(
                f"a streamer takes one prompt (as generate's streamers do), got a batch of {len(rows)}"
            )
        streamer.put(input_ids.cpu())

        def stream(new_tokens: list[int]) -> None:
            streamer.put(torch.tensor(new_tokens, dtype=torch.long))

    if static:
        check_one_device(
            model, 'cache_implementation="static"', "generate without it decodes such a model row by row"
        )
        decoder = _static_decoder(model, loaded, rows, config, settings, attention)
        outs = decoder.generate_batch(
            rows,
            max_new_tokens=settings["max_new_tokens"],
            eos_token_id=eos,
            on_tokens=None if stream is None else (lambda row, new_tokens: stream(new_tokens)),
            keep_kv=want_cache,
        ).rows
    elif len(rows) == 1 or len(model_devices(model)) > 1:  # the batched decoder needs one device
        outs, kept = [], None
        windows = [] if passed is None else _unwindowed(passed, _layer_windows(model))  # keep every token
        try:
            for row in rows:
                kept = passed if passed is not None else DynamicCache() if want_cache else None
                outs.append(
                    medusa_generate(
                        model,
                        loaded.packed,
                        row,
                        attention=attention,
                        on_tokens=stream,
                        cache=kept,
                        **settings,
                    )
                )
                entries = [] if kept is None else dynamic_entries(kept)
                outs[-1].kv = entries if any(e is not None for e in entries) else None
        finally:
            if passed is not None:
                _rewindowed(passed, windows)  # in the layers it came in, as generate leaves it
    else:
        outs = medusa_generate_batch(
            model, loaded.packed, rows, pad_token_id=pad, attention=attention, keep_kv=want_cache, **settings
        ).rows
    new = [row.tokens for row in outs]
    # The prompt as given, then each row's new tokens, right-padded like plain generate's finished rows.
    longest = max(len(t) for t in new)
    sequences = torch.full((len(rows), width + longest), pad, dtype=torch.long, device=input_ids.device)
    sequences[:, :width] = input_ids  # (B, T)
    for i, tokens in enumerate(new):
        sequences[i, width : width + len(tokens)] = tokens.to(input_ids.device)  # (n_i,)
    if streamer is not None:
        streamer.end()
    _warn_positions(limit, bound, sequences.shape[1], [row.stop_reason for row in outs])
    if config.return_dict_in_generate:
        _warn_once(
            [f"{name}=True" for name in _NOT_RETURNED if getattr(config, name, False)],
            "Medusa decoding returns the sequences and the cache only, not {}: those fields are None",
        )
        cache = None
        if want_cache:
            whole = len(rows) == 1 and rows[0].shape[1] == width  # one prompt, unpadded
            complete = whole and not static and kept.get_seq_length() == sequences.shape[1] - 1
            if complete and passed is not None:
                cache = passed  # gone on, in its own layers: generate returns the cache it gets
            else:  # the decoder's own cache where complete; layers that keep every token
                full = (
                    kept
                    if complete
                    else _generate_cache(model, sequences, attention_mask, [row.kv for row in outs], width)
                )
                if static:  # generate's static cache, of its size: prompt + max_new_tokens - 1 columns
                    size = max(
                        width + max_new - 1, sequences.shape[1] - 1, getattr(config, "max_cache_len", 0) or 0
                    )
                    cache = _static_copy(model, full, size)
                else:
                    cache = _in_generates_layers(model, full)
        return GenerateDecoderOnlyOutput(sequences=sequences, **{output_cache_field(): cache})
    return sequences


# -- where the export is --------------------------------------------------------------------------
def _find_export(
    model, medusa_heads: str | os.PathLike | None, export_dir: str | None, hub: dict | None = None
) -> Path:
    """The folder to read heads and tree from: ``medusa_heads``, else the ``custom_generate`` value
    ``model.generate`` was called with (a local folder, or a Hub repository downloaded to the Hub
    cache with ``hub``, the call's :data:`_HUB_ARGUMENTS`), else ``export_dir`` (where stage=export
    wrote it)."""
    if medusa_heads is not None:
        return _existing(Path(medusa_heads), "medusa_heads")
    called_with = _custom_generate_argument(model)
    if called_with is not None:
        if Path(called_with).is_dir():
            return Path(called_with)
        # the cache's key: proxies (a dict) as its pairs
        pairs = [
            (name, tuple(sorted(v.items())) if isinstance(v, dict) else v) for name, v in (hub or {}).items()
        ]
        if (hub or {}).get("force_download"):  # a forced download is never answered from the cache
            return _hub_snapshot.__wrapped__(called_with, tuple(sorted(pairs)))
        return _hub_snapshot(called_with, tuple(sorted(pairs)))
    if export_dir is not None and Path(export_dir).is_dir():
        return Path(export_dir)
    raise ValueError(
        f"cannot find the Medusa export (not at {export_dir}): pass medusa_heads=<export folder> to generate"
    )


def _custom_generate_argument(model) -> str | None:
    """The string ``custom_generate`` that ``model.generate`` was called with: transformers does not
    pass it on, so it is read from the frame of that call (``self`` is ``model``); None when the
    decoder was reached another way."""
    frame = inspect.currentframe()
    try:
        for _ in range(8):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            if frame.f_code.co_name == "generate" and frame.f_locals.get("self") is model:
                value = frame.f_locals.get("custom_generate")
                return value if isinstance(value, str) else None
        return None
    finally:
        del frame


@functools.lru_cache(maxsize=8)
def _hub_snapshot(repo_id: str, hub: tuple[tuple[str, object], ...] = ()) -> Path:
    """The heads, layouts, tree and calibration of a Hub repository, downloaded once into the Hub cache
    with the ``(name, value)`` pairs of ``hub`` (``revision``, ``token``, ...: :data:`_HUB_ARGUMENTS`;
    ``proxies`` as its ``(key, value)`` pairs)."""
    from huggingface_hub import snapshot_download

    kwargs = {name: dict(v) if name == "proxies" and v is not None else v for name, v in hub}
    return Path(
        snapshot_download(
            repo_id, allow_patterns=[f"{MEDUSA}/*", f"{VLLM}/*", CHOICES, CALIBRATION], **kwargs
        )
    )


def _existing(path: Path, what: str) -> Path:
    if not path.exists():
        raise ValueError(f"{what}={path} does not exist: give an export folder or a heads folder")
    return path


# -- heads and tree, once per model ---------------------------------------------------------------
def _load(model, source: Path, choices: list[list[int]] | None, *, check_base: bool) -> _Loaded:
    """The export's heads (checked against ``model``, on its device and dtype) and tree, cached per model
    and per device and dtype of the model (moved or cast, it gets heads, and static decoders, to match)
    and per state of the export's files (exported again into the same folder, it is read again)."""
    per_model = _LOADED.setdefault(model, {})
    weight = model.get_output_embeddings().weight
    heads_dir = _heads_dir(source)
    folder, stamp = str(source.resolve()), _stamp(source, heads_dir)
    key = (folder, stamp, json.dumps(choices), check_base, str(weight.device), weight.dtype)
    if key in per_model:
        return per_model[key]
    for stale in [k for k in per_model if k[-2:] != key[-2:] or (k[0] == folder and k[1] != stamp)]:
        del per_model[stale]  # heads for where the model was before, or of the folder's earlier export
    try:
        # Building the modules draws initial weights (then overwritten): from a fork, not the caller's
        # generator, so a seed set before the first call repeats that call's draws.
        with torch.random.fork_rng(devices=[]):
            heads = load_heads(heads_dir)
    except HeadsFormatError as err:
        raise ValueError(f"cannot load Medusa heads: {err}") from None
    heads = heads.to(device=weight.device, dtype=weight.dtype)
    try:
        heads.attach(model)  # hidden size, vocabulary, token map; binds shared heads to the lm_head
    except HeadsFormatError as err:
        raise ValueError(
            f"these Medusa heads do not belong to this model ({err}): load their base model"
        ) from None
    if check_base:
        _check_checkpoint(model, heads_dir)
    choices_path = next((p for p in (source / CHOICES, heads_dir.parent / CHOICES) if p.is_file()), None)
    if choices is None and choices_path is None:
        raise ValueError(f"{source} has no {CHOICES}: pass medusa_choices=<list of paths>")
    from_file = choices is None
    try:
        choices = load_choices(choices_path) if choices is None else choices
        tree = TreeBuffers.from_choices(choices)
        tree.check_heads(heads.num_heads, heads.draft_vocab_size)
    except TreeError as err:
        raise ValueError(f"bad Medusa tree: {err}") from None
    calibrated = _calibration_of(choices_path, choices) if from_file else None
    loaded = _Loaded(PackedHeads(heads), tree.to(weight.device), key, calibrated)
    per_model[key] = loaded
    return loaded


def _stamp(source: Path, heads_dir: Path) -> tuple:
    """``(path, size, mtime_ns, inode)`` of the heads folder's files and of the tree and calibration
    files: what changes when an export is written again into the same folder (stage=export writes new
    files and renames them into place), without reading the weights."""
    files = sorted(p for p in heads_dir.iterdir() if p.is_file()) if heads_dir.is_dir() else []
    trees = [source / CHOICES, heads_dir.parent / CHOICES]
    files += [p for p in (*trees, *(t.parent / CALIBRATION for t in trees)) if p.is_file()]
    stamp = []
    for path in dict.fromkeys(files):
        stat = path.stat()
        stamp.append((str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino))
    return tuple(stamp)


def _calibration_of(choices_path: Path, choices: list[list[int]]) -> tuple[str, int] | None:
    """``(attention, context_len)`` of the calibration.json beside the tree file: the tree attention
    (resolved: "sdpa", "triton" or "cuda") its latency curve was timed with and the cached tokens it
    was timed at, when the tree it chose is ``choices`` (an export of a pinned tree ships the
    calibration of the heads' own): the same paths (its ``tree.choices``), or in a calibration.json
    without them the same node count; None without one, or one that does not say.

    Checked as stage=eval and the export's card check it
    (:func:`~medusa_train.card_inputs.calibration_input`): a damaged one is None too, with one warning
    naming the file, what is wrong and the repair (eval refuses it; decoding needs only the default
    attention from it)."""
    path = choices_path.parent / CALIBRATION
    expected = calibration_input(path.parent)
    calibration, problem = read_checked(path, expected)
    if problem is not None:
        _warn_message(
            f"{path} is damaged ({problem}): {expected.repair}; the Medusa tree is decoded with "
            "medusa_attention='auto'"
        )
        return None
    tree = (calibration or {}).get("tree") or {}
    attention = (tree.get("calibrated_for") or {}).get("attention")
    context = tree.get("context_len")
    chosen = tree.get("choices")
    same = (
        sorted(map(tuple, chosen)) == sorted(map(tuple, choices))
        if chosen is not None
        else (tree.get("best") or {}).get("nodes") == len(choices)
    )
    if attention not in ("sdpa", "triton", "cuda") or context is None or not same:
        return None
    return attention, context


def _calibrated_attention(loaded: _Loaded, device: torch.device) -> str:
    """The default ``medusa_attention``: "auto", unless ``auto`` would decode the export's tree, at the
    context its latency curve was timed at, with another tree attention than the one timed (a tree
    calibrated with ``eval.attention=triton`` or ``cuda``, or with SDPA at 8,192 keys or more): then the
    one timed, for which the tree was chosen; a kernel only on a CUDA device where it runs (a CPU:
    SDPA; one it cannot run there is named in a warning)."""
    if loaded.calibrated is None:
        return "auto"
    attention, context = loaded.calibrated
    if resolve_attention("auto", device, context=context) == attention:
        return "auto"
    if attention == "sdpa":
        return "sdpa"
    if device.type != "cuda":
        return "auto"
    try:
        return resolve_attention(attention, device)
    except AttentionBackendError as err:
        _warn_message(
            f"the Medusa tree was calibrated with the {attention} tree attention, but {err}: it is decoded "
            "with medusa_attention='auto'"
        )
        return "auto"


# -- the static-shape decoder, kept on the model ----------------------------------------------------
MAX_STATIC_DECODERS = 4
"""Static decoders kept per model (each holds a KV cache for its rows and capacity): the least recently
used one is dropped to make room for a new kind of call."""
_STATIC_ATTR = "_medusa_static_decoders"
"""The model attribute holding the :class:`StaticDecoder` of each kind of call (:class:`_StaticDecoders`).
On the model, not in ``_LOADED``: a decoder refers to its model, which a weak-keyed table would then
keep alive for ever; as an attribute the two form a cycle that is collected with the model."""


class _StaticDecoders(dict):
    """Static decoders by call kind: caches, dropped (not copied) when the model is copied or pickled
    (a captured CUDA graph cannot be)."""

    def __deepcopy__(self, memo) -> _StaticDecoders:
        return _StaticDecoders()

    def __reduce__(self):
        return (_StaticDecoders, ())


def release(model) -> None:
    """Free what ``generate`` keeps for ``model``: the heads packed on its device and the tree, and the
    static decoders (KV caches, captured graphs) of ``cache_implementation="static"`` calls; the next
    call loads and builds them again."""
    _LOADED.pop(model, None)
    vars(model).pop(_STATIC_ATTR, None)


def _static_capture(config, device: torch.device, model) -> tuple[str, str | None]:
    """``(capture, compile_mode)`` of the static decoder, decided as transformers decides whether to
    compile a static-cache ``generate``: not with ``disable_compile``; on a CUDA device the whole step
    as one CUDA graph (as ``eval.compile`` measures it there, docs/benchmarks.md; eager for a model
    whose RoPE a graph cannot capture: :func:`~medusa_train.decoding.static.host_synced_rope`);
    elsewhere compiled (``torch.compile`` in the ``compile_config``'s mode) only when the
    ``compile_config`` compiles on all devices."""
    if config.disable_compile:
        return "eager", None
    if device.type == "cuda":
        return ("eager" if host_synced_rope(model) else "cuda_graph"), None
    compile_config = config.compile_config
    if compile_config is not None and getattr(compile_config, "_compile_all_devices", False):
        return "compile", compile_config.mode
    return "eager", None


def _static_decoder(
    model, loaded: _Loaded, rows: list[torch.Tensor], config, settings: dict, attention: str
) -> StaticDecoder:
    """The model's :class:`StaticDecoder` for this kind of call (heads, tree, rows, capture, attention,
    acceptance, repetition penalty, minimum length) with room for its rows: the one kept from an earlier call, else a
    new one (replacing a smaller one) of :func:`~medusa_train.decoding.static.capacity_for` columns."""
    device = model.get_output_embeddings().weight.device
    capture, compile_mode = _static_capture(config, device, model)
    rule = settings["acceptance"]
    rule_settings = {  # what changes the step of each rule (greedy: nothing)
        "typical": ("temperature", "posterior_threshold", "posterior_alpha"),
        "sample": ("temperature", "top_p", "top_k", "min_p"),
    }.get(rule, ())
    key = (
        loaded.key,
        len(rows),
        capture,
        compile_mode,
        attention,
        rule,
        *(settings[k] for k in rule_settings),
        settings["repetition_penalty"],
        settings["min_new_tokens"],
        settings["min_length"],
    )
    nodes = loaded.tree.num_nodes
    limit = context_limit(model) if settings["stop_at_context"] else None
    lens = [r.shape[1] for r in rows]
    need = columns_needed(lens, row_budgets(lens, settings["max_new_tokens"], limit), nodes)
    decoders = vars(model).setdefault(_STATIC_ATTR, _StaticDecoders())
    live = _LOADED.get(model, {})
    for stale in [k for k in decoders if k[0] not in live]:  # heads dropped: the model moved, a new export
        del decoders[stale]
    decoder = decoders.pop(key, None)  # put back last: the dict runs from least to most recently used
    if decoder is None or decoder.capacity < need:
        del decoder  # a smaller cache is freed before the larger one is allocated
        while len(decoders) >= MAX_STATIC_DECODERS:
            del decoders[next(iter(decoders))]
        decoder = StaticDecoder(
            model,
            loaded.packed,
            loaded.tree,
            capacity_for(need, None if limit is None else limit + nodes),
            batch_size=len(rows),
            capture=capture,
            compile_mode=compile_mode,
            attention=attention,
            acceptance=rule,
            temperature=settings["temperature"],
            top_p=settings["top_p"],
            top_k=settings["top_k"],
            min_p=settings["min_p"],
            posterior_threshold=settings["posterior_threshold"],
            posterior_alpha=settings["posterior_alpha"],
            repetition_penalty=settings["repetition_penalty"],
            min_new_tokens=settings["min_new_tokens"],
            min_length=settings["min_length"],
            stop_at_context=settings["stop_at_context"],
        )
    decoders[key] = decoder
    return decoder


def _heads_dir(source: Path) -> Path:
    """The heads folder of an export (``medusa/``, else ``vllm/``), or ``source`` itself."""
    return next((source / name for name in (MEDUSA, VLLM) if (source / name).is_dir()), source)


def _check_checkpoint(model, heads_dir: Path) -> None:
    """Refuse a base model whose checkpoint files are not the ones the heads go with: the trained
    Medusa-2 backbone that ships with them (an export's ``backbone/``), else the base stage=train
    recorded. Checked only when both sides are local files (a Hub id, a model built in memory or a
    LoRA adapter passes) and fingerprinted alike (a record of an earlier medusa_train, or of the tensors
    of a base without files, passes: :func:`~medusa_train.backbone.is_files_fingerprint`). The files
    match with or without the remote code their config.json names
    (:func:`~medusa_train.backbone.local_fingerprints`: the record does not say whether stage=train
    trusted it)."""
    trained = trained_backbone_dir(heads_dir)
    if trained is not None:
        expected_name = str(trained)
        expected = set() if is_adapter_dir(trained) else local_fingerprints(str(trained))
    else:
        identity = recorded_base(heads_dir) or {}
        expected_name, recorded = identity.get("name_or_path"), identity.get("fingerprint")
        expected = {recorded} if is_files_fingerprint(recorded) else set()
    actual = local_fingerprints(getattr(model, "name_or_path", "") or "")
    if expected and actual and not expected & actual:
        raise ValueError(
            f"these Medusa heads go with {expected_name} (checkpoint fingerprint {' or '.join(sorted(expected))}), "
            f"not with {model.name_or_path} ({' or '.join(sorted(actual))}): load that model, or pass "
            "medusa_check_base=False"
        )


# -- arguments ------------------------------------------------------------------------------------
def _acceptance(config, requested: str | None) -> str:
    """The acceptance rule of the call.

    Raises:
        ValueError: beam search, several sequences per prompt, an unknown rule, or a setting that
            changes generate's output and that Medusa decoding does not apply (:data:`_UNAPPLIED_SETTINGS`).
    """
    if int(config.num_beams or 1) > 1 or int(config.num_return_sequences or 1) > 1:
        raise ValueError(
            "Medusa decoding makes one sequence per prompt: use num_beams=1, num_return_sequences=1"
        )
    if requested is not None and requested not in ACCEPTANCE:
        raise ValueError(f"medusa_acceptance must be one of {ACCEPTANCE}, got {requested!r}")
    unapplied = [
        (name, default)
        for name, default in _UNAPPLIED_SETTINGS.items()
        if getattr(config, name, default) not in (default, None)
    ]
    if unapplied:  # from the call or from the model's generation_config: their default overrides either
        raise ValueError(
            "Medusa decoding does not apply "
            + ", ".join(f"{name}={getattr(config, name)!r}" for name, _ in unapplied)
            + ": pass "
            + ", ".join(f"{name}={default!r}" for name, default in unapplied)
            + " to decode without (plain generate applies them)"
        )
    return requested or ("sample" if config.do_sample else "greedy")


def _max_new_tokens(config, width: int, default_length: bool, limit: int | None) -> int:
    """The new tokens of every row of a ``(B, width)`` prompt, as ``generate`` counts them
    (``_prepare_generated_length``): ``max_new_tokens``, else ``max_length`` less the padded ``width``
    (the default ``max_length``: that many new tokens, the whole within the model's ``limit`` positions),
    the same for a short row of a left-padded batch as for the longest.

    Raises:
        ValueError: as ``generate`` (``_validate_generated_length``), a prompt as long as ``max_length``
            or longer.
    """
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    total = config.max_length + width if default_length else config.max_length
    if default_length and limit is not None:
        total = min(total, limit)
    if width >= total:
        raise ValueError(
            f"Input length of input_ids is {width}, but `max_length` is set to {total}, so there is no room "
            "for new tokens (plain generate refuses it too): increase max_length or, better, set max_new_tokens"
        )
    return total - width


def _warn_once(items: list[str], template: str) -> None:
    """Log ``template`` filled with ``items`` (if any), once per process for each distinct message."""
    if items:
        _warn_message(template.format(", ".join(items)))


def _warn_message(message: str) -> None:
    """Log ``message`` as a warning, once per process."""
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


def _inferred_mask(input_ids: torch.Tensor, pad_token_id: int | None, eos: list[int]) -> torch.Tensor | None:
    """The ``(B, T)`` attention mask ``generate`` infers for a call without one
    (``_prepare_attention_mask_for_generation``): 0 on every ``pad_token_id`` when the prompt holds it
    and it is no EOS token; None (every token counts) otherwise."""
    if input_ids.ndim != 2 or pad_token_id is None or int(pad_token_id) in eos:
        return None
    padding = input_ids == int(pad_token_id)  # (B, T)
    return (~padding).long() if bool(padding.any()) else None


def _unpadded_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row of a left-padded ``(B, T)`` batch without its padding, as ``(1, T_i)``.

    Raises:
        ValueError: padding that is not on the left, or a row with no token.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return [input_ids[i : i + 1] for i in range(input_ids.shape[0])]
    mask = attention_mask.to(torch.long)  # (B, T)
    lengths = mask.sum(dim=1).tolist()
    rows = []
    for i, n in enumerate(lengths):
        if n == 0 or not bool(mask[i, input_ids.shape[1] - n :].all()):
            raise ValueError(
                "Medusa decoding takes left-padded batches with at least one token per row (without an "
                "attention_mask, every pad_token_id counts as padding, as in generate): "
                "set tokenizer.padding_side = 'left' and pass the tokenizer's attention_mask"
            )
        rows.append(input_ids[i : i + 1, input_ids.shape[1] - n :])  # (1, n)
    return rows


# -- the cache ------------------------------------------------------------------------------------
def _check_passed_cache(model, passed, static: bool, rows: list[torch.Tensor], width: int) -> None:
    """Refuse a cache to go on from (``past_key_values`` / ``cache``) that Medusa decoding cannot take:
    it takes a ``DynamicCache`` of one unpadded prompt whose layers keep every token, or the last window
    of the window the model applies there (:func:`_layer_windows`), or no KV (a layer reading an earlier
    layer's): the one it returns without ``cache_implementation="static"``, or plain generate's; the
    static decoder starts from a cache of its own.

    Raises:
        ValueError: one line saying what to pass instead.
    """
    if passed is None:
        return
    if static:
        raise ValueError(
            'cache_implementation="static" decodes on a cache of its own (plain generate refuses a cache '
            "with it too): call without past_key_values, or without cache_implementation to go on from it"
        )
    layers = getattr(passed, "layers", [])
    windows = _layer_windows(model)
    if (
        not isinstance(passed, DynamicCache)
        or getattr(passed, "offloading", False)
        or not all(
            type(layer) is DynamicLayer
            or isinstance(layer, NoKVLayer)
            or (
                type(layer) is DynamicSlidingWindowLayer
                and (not _holds_tokens(layer) or (i < len(windows) and layer.sliding_window == windows[i]))
            )
            for i, layer in enumerate(layers)
        )
    ):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(
            f"Medusa decoding goes on from a DynamicCache whose layers keep every token or the model's "
            f"window, not a {type(passed).__name__} of {', '.join(kinds) or 'no layers'}: pass the cache a "
            "Medusa or plain generate call returned (return_dict_in_generate=True, without "
            "cache_implementation), or call without past_key_values"
        )
    rows_cached = {layer.keys.shape[0] for layer in layers if layer.is_initialized and layer.keys is not None}
    if len(rows) != 1 or rows[0].shape[1] != width or rows_cached - {1}:
        raise ValueError(
            "Medusa decoding goes on from a cache of one prompt without padding: pass past_key_values "
            "with one prompt, or call without it"
        )


def _layer_windows(model) -> list[int | None]:
    """Per decoder layer (of the text config's ``layer_types``), the positions its attention reaches
    back, as the model's masks apply them: the window of a sliding-window layer
    (:func:`~medusa_train.decoding.attention.sliding_window_kinds`), the chunk of a chunked one
    (:func:`~medusa_train.decoding.attention.attention_chunk`: a query sees its chunk, within the last
    chunk-size positions); None for a layer that attends every position, which a window the config
    carries and the model's code never reads does not change (a Llama whose config.json has a
    ``sliding_window``)."""
    text = model.config.get_text_config(decoder=True)
    window, kind = sliding_window_kinds(model)
    chunk = attention_chunk(model)
    windows: list[int | None] = []
    for layer_type in getattr(text, "layer_types", None) or [None] * text.num_hidden_layers:
        if layer_type == "chunked_attention" and chunk is not None:
            windows.append(chunk)
        elif window is not None and (kind == "sliding" or layer_type == "sliding_attention"):
            windows.append(window)
        else:
            windows.append(None)
    return windows


def _in_generates_layers(model, full: DynamicCache) -> DynamicCache:
    """``full`` (layers that keep every token, as the decoders' caches do) in the layers of the cache
    plain ``generate`` makes (``DynamicCache(config=...)``): a sliding-window or chunked layer keeps the
    last ``window - 1`` tokens (where the model's masks apply that window: :func:`_layer_windows`; a
    window the model's code never reads keeps every token, as the model attends them), a layer that
    keeps no KV (transformers 5.24's ``DummyLayer`` of a KV-sharing layer) none; full layers are
    ``full``'s own."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    windows = _layer_windows(model)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, NoKVLayer):
            continue
        source = full.layers[index] if index < len(full.layers) else DynamicLayer()
        if (
            type(layer) is DynamicSlidingWindowLayer
            and index < len(windows)
            and layer.sliding_window == windows[index]
        ):
            if source.is_initialized and source.keys is not None:
                cache.layers[index] = _window_layer(layer.sliding_window, source.keys, source.values)
        else:
            cache.layers[index] = source
    return cache


def _window_layer(window: int, keys: torch.Tensor, values: torch.Tensor) -> DynamicSlidingWindowLayer:
    """A sliding-window cache layer of ``window`` that has seen ``keys`` ``(B, H, n, D)`` and ``values``
    ``(B, H, n, Dv)``: it keeps their last ``window - 1`` tokens, in tensors of their own (its update
    keeps a view into all n, which would hold them until the next forward)."""
    layer = DynamicSlidingWindowLayer(sliding_window=window)
    layer.update(keys, values)
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    return layer


def _holds_tokens(layer) -> bool:
    """Whether a cache layer has seen any token (an empty one, ``DynamicCache(config=...)``'s before a
    forward, loses none to a window it was made with)."""
    return layer.is_initialized and layer.keys is not None and layer.get_seq_length() > 0


def _unwindowed(cache: DynamicCache, applied: list[int | None]) -> list[tuple[int, bool] | None]:
    """Make each sliding-window layer of a cache to go on from (``generate``'s, checked by
    :func:`_check_passed_cache`) a layer that keeps every token, in place, as the decoders' caches
    are: the tokens it no longer holds, before its window, zeros (the model's window masks them in
    every later forward, the tree's too). Returns, per layer, the window to give it back
    (:func:`_rewindowed`) and whether it recorded its past (``activate_past_recording``); None for a
    full layer, one that keeps no KV, or an empty one whose window the model does not apply there
    (``applied``: :func:`_layer_windows`; it is given back keeping every token, as the model attends
    them). An empty layer is given back the model's window, whichever it was made with."""
    windows: list[tuple[int, bool] | None] = []
    for index, layer in enumerate(cache.layers):
        if type(layer) is not DynamicSlidingWindowLayer:
            windows.append(None)
            continue
        if _holds_tokens(layer):
            window = layer.sliding_window  # checked: the model's
        else:  # nothing lost to the window it was made with: the model's, if it applies one there
            window = applied[index] if index < len(applied) else None
        windows.append(None if window is None else (window, layer.record_past))
        whole = DynamicLayer()
        if layer.is_initialized and layer.keys is not None:
            keys, values = layer.keys, layer.values  # (B, H, n, D): the last n of its tokens
            gone = layer.get_seq_length() - keys.shape[2]
            if gone > 0:
                keys = torch.cat([keys.new_zeros(*keys.shape[:2], gone, keys.shape[3]), keys], dim=2)
                values = torch.cat(
                    [values.new_zeros(*values.shape[:2], gone, values.shape[3]), values], dim=2
                )
            whole.update(keys, values)
        cache.layers[index] = whole
    return windows


def _rewindowed(cache: DynamicCache, windows: list[tuple[int, bool] | None]) -> None:
    """Give back the sliding-window layers :func:`_unwindowed` made keep every token, in place: each
    keeps its last ``window - 1`` tokens again, as ``generate`` leaves the cache it gets (recording its
    past again where it did)."""
    for index, kept in enumerate(windows):
        if kept is None:
            continue
        (window, record_past), whole = kept, cache.layers[index]
        layer = (
            _window_layer(window, whole.keys, whole.values)
            if whole.is_initialized and whole.keys is not None
            else DynamicSlidingWindowLayer(sliding_window=window)
        )
        if record_past:
            layer.activate_past_recording()
        cache.layers[index] = layer


def _generate_cache(
    model,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kv: list[list[tuple[torch.Tensor, torch.Tensor] | None] | None],
    width: int,
) -> DynamicCache:
    """The cache plain ``generate`` returns with ``sequences`` ``(B, S)``: the keys and values of
    ``sequences[:, :-1]``, each row in the layout of the left-padded prompt (``width`` columns).

    Each row's entries are its decoder's ``kv`` (the prompt's and the new tokens' but the last; None:
    none), at the columns after its padding (whose entries are zeros: ``attention_mask`` masks them in
    every later forward). What no decoder computed is computed by one forward of the model over the
    columns from the first any row lacks, with the mask and positions ``generate`` gives them: a row
    that stopped before the longest has the entries of its last token and of the padding ``generate``
    ran through the model after it (its mask 1 there, as ``generate`` extends it).
    """
    b, end = sequences.shape[0], sequences.shape[1] - 1
    mask = torch.ones(b, sequences.shape[1], dtype=torch.long, device=sequences.device)  # (B, S)
    if attention_mask is not None:
        mask[:, :width] = attention_mask
    pads = (width - mask[:, :width].sum(dim=1)).tolist()  # each row's left padding
    template = next((row for row in kv if row is not None), None)
    known = [
        pads[i] + next(layer[0].shape[1] for layer in row if layer is not None)
        if row is not None
        else pads[i]
        for i, row in enumerate(kv)
    ]
    start = 0 if template is None else min(*known, end)  # every row's entries are known up to here
    cache = DynamicCache()
    for index, layer in enumerate(template or []):
        if layer is None or start == 0:
            continue
        keys = layer[0].new_zeros(b, layer[0].shape[0], start, layer[0].shape[2])  # (B, H, start, D)
        values = layer[1].new_zeros(b, layer[1].shape[0], start, layer[1].shape[2])  # (B, H, start, Dv)
        for i, row in enumerate(kv):
            if row is not None and start > pads[i]:
                keys[i, :, pads[i] :] = row[index][0][:, : start - pads[i]]
                values[i, :, pads[i] :] = row[index][1][:, : start - pads[i]]
        cache.update(keys, values, index)
    if start < end:
        device = model.get_input_embeddings().weight.device
        mask = mask[:, :end].to(device)  # (B, S - 1)
        positions = (mask.cumsum(dim=1) - 1).masked_fill_(mask == 0, 1)  # as generate gives them
        with torch.no_grad():
            model(
                input_ids=sequences[:, start:end].to(device),
                attention_mask=mask,
                position_ids=positions[:, start:],
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(model, cache),
            )
    return cache


def _static_copy(model, cache: DynamicCache, size: int) -> StaticCache:
    """``cache`` in a ``StaticCache`` of ``size`` columns, the kind ``generate`` returns for
    ``cache_implementation="static"`` (its sliding-window layers keep the last window)."""
    static = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=size)
    for index, (layer, target) in enumerate(zip(cache.layers, static.layers, strict=False)):
        if isinstance(target, NoKVLayer) or not layer.is_initialized or layer.keys is None:
            continue
        columns = torch.arange(layer.keys.shape[2], device=layer.keys.device)
        static.update(layer.keys, layer.values, index, {"cache_position": columns})  # 5.17 reads positions
    return static


def _warn_positions(limit: int | None, bound: str | None, length: int, stop_reasons: list[str]) -> None:
    """Warn, once, where the sequences went past the model's ``max_position_embeddings`` (as plain
    generate warns: its positions go on), or where a row stopped there (``bound``: why it must)."""
    if limit is None:
        return
    if bound is None and length > limit:
        _warn_message(
            f"the sequences went past the model's max_position_embeddings ({limit}), as plain generate's "
            "go on past it: depending on the model, outputs may degrade there"
        )
    elif bound is not None and "context" in stop_reasons:
        _warn_message(
            f"Medusa decoding stopped at the model's max_position_embeddings ({limit}): {bound}; "
            "shorten the prompt to leave room"
        )
