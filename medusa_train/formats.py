"""Medusa heads in the layouts serving engines load, and :func:`load_heads` for either layout.

Two layouts (the names below are the ones the engines' loaders read; a wrong name loads nothing,
because vLLM skips unknown weight names without a word, so the tests pin them):

``medusa`` -- FasterDecoding Medusa, Hugging Face TGI and TensorRT-LLM's Medusa converter::

    config.json                  {medusa_num_heads, medusa_num_layers, base_model_name_or_path,
                                  hidden_size, vocab_size, ...}
    medusa_lm_head.safetensors   {h}.{l}.linear.weight (d, d)   {h}.{l}.linear.bias (d,)   l < L
                                 {h}.{L}.weight (V, d)           (head h's vocab projection)

    medusa_lm_head.pt            only with ``write_pickle``: the same tensors as a torch pickle, for
                                 FasterDecoding's ``MedusaModel.from_pretrained``, which opens no other
                                 weights file (loading it runs pickle; our loaders never read it)

``vllm`` -- vLLM's ``MedusaModel`` (speculative_config={"method": "medusa", "model": <dir>})::

    config.json                  {model_type: "medusa", architectures: ["MedusaModel"], hidden_size,
                                  vocab_size, num_heads, num_hidden_layers, truncated_vocab_size,
                                  medusa_fc_bias: true, base_model_name_or_path, ...}
    model.safetensors            blocks.{h}.layers.{l}.weight (d, d)   blocks.{h}.layers.{l}.bias (d,)
                                 lm_heads.{h}.weight (V, d)

vLLM's ``MedusaConfig.from_pretrained`` renames every config key containing "num" and "heads" to
``num_heads`` (and "num" + "layers" to ``num_hidden_layers``), so the vLLM config carries no other
key with "num" in it. Its other keys become attributes of the config that vLLM's ``Medusa`` model
never reads: ``base_model_name_or_path`` and what an export adds there (the heads' fingerprint, the
backbone's identity, the medusa_train version that trained them), so a vLLM-only export still says which
backbone its heads belong to. vLLM
multiplies the heads' logits by a ``logit_scale`` key (default 1.0); medusa_train's heads have no
such scale, so :func:`load_vllm` refuses a folder with another value. Both layouts hold exactly the
same tensors; only names differ.

What each consumer's loader reads, with the source files and commits, is tabled in
``docs/pipeline.md`` ("What each engine's loader reads"); ``tests/unit/test_formats.py`` pins it. In
short: TGI and vLLM read safetensors only; TGI needs ``base_model_name_or_path`` and no
``architectures`` or ``model_type`` key in the medusa config (an ``architectures`` key turns its
Medusa path off, a ``model_type`` its tokenizer fallback to the base model); FasterDecoding opens only
``medusa_lm_head.pt``.

An exported backbone (Medusa-2) is not a serving layout of the heads: its config and tokenizer are
made readable by transformers 4.x consumers in :mod:`medusa_train.transformers4`.

Head projection variants (:mod:`medusa_train.heads`), as vLLM's ``Medusa.load_weights``
(vllm/model_executor/models/medusa.py) reads them:

- ``shared``: vLLM ``original_lm_head: true`` and ONE ``lm_heads.0.weight`` (V, d), a copy of the
  backbone's lm_head (vLLM reads it from the draft checkpoint, not from the base model). medusa layout:
  no ``{h}.{L}.weight`` at all and ``"version": "2"`` -- FasterDecoding's medusa2 heads (PR #97), which
  TGI's ``MedusaHeadV2`` serves with the base model's lm_head (one block per head only).
- ``truncated``: vLLM ``truncated_vocab_size: N`` (< ``vocab_size``), ``lm_heads.{h}.weight`` (N, d) and a
  ``token_map`` (N,) int64 tensor (draft index -> token id). The medusa layout has no token map in any
  of its loaders: :func:`save_medusa` refuses such heads; :func:`save_vllm` refuses N = V (vLLM ignores
  the token map unless N < V).

Torch + safetensors only (no Hydra): the decoder and the GPU image use this module.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from medusa_train.draft_vocab import TOKEN_MAP
from medusa_train.errors import HeadsFormatError
from medusa_train.heads import MedusaHeads
from medusa_train.heads_layout import (
    LEGACY_WEIGHTS_NAME,
    VLLM,
    detect_layout,
    layout_dir,
    read_heads_config,
    weights_files,
)
from medusa_train.safetensors_check import safetensors_shapes
from medusa_train.workdir import HEADS_CONFIG, HEADS_WEIGHTS, atomic_write, atomic_write_json

log = logging.getLogger(__name__)

VLLM_WEIGHTS_NAME = "model.safetensors"
MEDUSA_CONFIG_KEYS = (
    "medusa_num_heads",
    "medusa_num_layers",
    "base_model_name_or_path",
    "hidden_size",
    "vocab_size",
)
"""The medusa layout's config.json keys (TGI reads the first three, FasterDecoding the first three via its
``MedusaConfig``, TensorRT-LLM's converter the first two)."""
WHOLE_VOCABULARY_MAP = (
    "heads with a draft vocabulary of all {vocab} tokens have no serving layout: vLLM reads a token_map only "
    "when truncated_vocab_size < vocab_size (it would ignore theirs), the FasterDecoding/TGI/TensorRT-LLM "
    "layout none; train them with training.head_projection=own (the same heads without a map) or a smaller "
    "training.draft_vocab_size"
)
"""Why truncated heads with N = V tokens are refused (vLLM would read their rows in full-vocabulary order)."""
MEDUSA_TRAIN_VERSION = "medusa_train_version"
"""config.json key: the ``medusa_train.__version__`` that trained the heads (stage=train writes it, an export
carries it into both layouts). For bug reports and format differences only: no loader reads it, and heads
without it load the same."""
MEDUSA_FORBIDDEN_KEYS = ("architectures", "model_type")
"""Keys the medusa layout's config.json must not have: with ``architectures`` TGI's ``SpeculativeHead``
takes the folder for another speculator and serves without Medusa; with ``model_type`` TGI's router no
longer falls back to the base model's tokenizer."""


# -- medusa (FasterDecoding / TGI / TensorRT-LLM) --------------------------------------------------
def save_medusa(
    heads: MedusaHeads,
    directory: str | os.PathLike,
    extra_config: dict | None = None,
    write_pickle: bool = False,
) -> Path:
    """Write the FasterDecoding layout (``config.json`` + ``medusa_lm_head.safetensors``).

    Args:
        heads: the heads to write (any dtype; tensors are written as they are).
        directory: created if missing.
        extra_config: more config.json keys (training settings, backbone identity); the five layout
            keys always come from ``heads``, and ``model_type``/``architectures`` are left out (TGI
            reads an ``architectures`` key as "not Medusa" and a ``model_type`` as "not a heads-only
            folder", see the module docstring).
        write_pickle: also write ``medusa_lm_head.pt`` (the same tensors, ``torch.save`` of a dict),
            the only file FasterDecoding's ``MedusaModel.from_pretrained`` opens. Loading a pickle can
            run code, so this logs a warning; nothing in medusa_train reads it back.

    Raises:
        HeadsFormatError: truncated heads (FasterDecoding, TGI and TensorRT-LLM read no token map).
    """
    if heads.head_projection == "truncated":
        raise HeadsFormatError(
            "heads with a truncated draft vocabulary have no FasterDecoding/TGI/TensorRT-LLM layout (none of "
            "them reads a token_map): export them with export.formats=[vllm]"
        )
    dropped = set(MEDUSA_CONFIG_KEYS) | set(MEDUSA_FORBIDDEN_KEYS)
    extra = {k: v for k, v in (extra_config or {}).items() if k not in dropped}
    directory = heads.save_pretrained(directory, extra_config=extra)
    if write_pickle:
        state = {
            name: t.detach().to("cpu").contiguous().clone() for name, t in heads.heads.state_dict().items()
        }
        atomic_write(directory / LEGACY_WEIGHTS_NAME, lambda p: _save_pickle(state, p))
        log.warning(
            "wrote %s for FasterDecoding's loader: it is a pickle, and loading a pickle can run code; "
            "share it only with people who trust this run (TGI, vLLM and TensorRT-LLM read the "
            "safetensors file)",
            directory / LEGACY_WEIGHTS_NAME,
        )
    return directory


def load_medusa(directory: str | os.PathLike) -> MedusaHeads:
    """Read the FasterDecoding layout, keeping the stored dtype.

    Reads ``medusa_lm_head.safetensors`` whenever it is there (so never the ``medusa_lm_head.pt`` that
    ``write_pickle`` puts beside it); only a folder without it, such as FasterDecoding's published
    checkpoints, is read from ``medusa_lm_head.pt``, with torch's restricted ``weights_only`` unpickler.
    Hidden and vocab sizes come from the weights (not every FasterDecoding config has them).
    Shared heads come back unbound (:meth:`MedusaHeads.attach` them to their backbone).

    Raises:
        HeadsFormatError: missing files or keys, unexpected keys, shapes that contradict the config.
    """
    directory = Path(directory)
    config = read_heads_config(directory)
    if (directory / HEADS_WEIGHTS).is_file():
        state = _load_safetensors(directory / HEADS_WEIGHTS)
    elif (directory / LEGACY_WEIGHTS_NAME).is_file():
        state = _load_pickle(directory / LEGACY_WEIGHTS_NAME)
    else:
        raise HeadsFormatError(f"{directory} has no {HEADS_WEIGHTS}")
    return MedusaHeads.from_state(config, state, directory)


# -- vLLM -----------------------------------------------------------------------------------------
def vllm_config(heads: MedusaHeads) -> dict:
    """The config.json vLLM's ``MedusaConfig`` reads (biased block linears; ``original_lm_head`` for
    shared heads, ``truncated_vocab_size`` < ``vocab_size`` for a draft vocabulary), and the heads'
    ``base_model_name_or_path`` (which vLLM does not read) when they have one."""
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "truncated_vocab_size": heads.draft_vocab_size,
        "medusa_fc_bias": True,
    }
    if heads.head_projection == "shared":
        config["original_lm_head"] = True
    if heads.base_model_name_or_path:
        config["base_model_name_or_path"] = heads.base_model_name_or_path
    return config


VLLM_READ_KEYS = ("logit_scale", "original_lm_head", "max_paths", "topk", "max_seq_len")
"""Keys of vLLM's Medusa config that vLLM reads besides the ones :func:`vllm_config` writes: an
``extra_config`` of :func:`save_vllm` never sets them."""


def vllm_state_dict(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """Our tensors under vLLM ``MedusaModel`` parameter names (CPU, contiguous).

    Shared heads write their bound lm_head once as ``lm_heads.0.weight`` (vLLM loads it into the one
    ``lm_head`` every head uses); truncated heads add ``token_map``.
    """
    state: dict[str, torch.Tensor] = {}
    for h in range(heads.num_heads):
        for layer in range(heads.num_layers):
            linear = heads.blocks(h)[layer].linear
            state[f"blocks.{h}.layers.{layer}.weight"] = linear.weight  # (d, d)
            state[f"blocks.{h}.layers.{layer}.bias"] = linear.bias  # (d,)
        if heads.head_projection != "shared" or h == 0:
            state[f"lm_heads.{h}.weight"] = heads.head_weight(h)  # (V_draft, d)
    if heads.token_map is not None:
        state[TOKEN_MAP] = heads.token_map  # (N,) int64
    return {name: t.detach().to("cpu").contiguous() for name, t in state.items()}


def save_vllm(heads: MedusaHeads, directory: str | os.PathLike, extra_config: dict | None = None) -> Path:
    """Write the vLLM ``MedusaModel`` layout (``config.json`` + ``model.safetensors``).

    Args:
        heads: the heads to write (tensors as they are).
        directory: created if missing.
        extra_config: more config.json keys, which vLLM keeps as config attributes and never reads (the
            heads' fingerprint, the backbone's identity, :data:`MEDUSA_TRAIN_VERSION`); the layout's keys always come from ``heads``,
            and keys vLLM reads (:data:`VLLM_READ_KEYS`) or renames (any with "num" in it) are left out.

    Raises:
        HeadsFormatError: truncated heads whose draft vocabulary is the whole vocabulary (vLLM reads a
            token map only when ``truncated_vocab_size < vocab_size``).
    """
    if heads.head_projection == "truncated" and heads.draft_vocab_size == heads.vocab_size:
        raise HeadsFormatError(WHOLE_VOCABULARY_MAP.format(vocab=heads.vocab_size))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = vllm_state_dict(heads)
    config = vllm_config(heads)
    for key, value in (extra_config or {}).items():
        if key not in config and key not in VLLM_READ_KEYS and "num" not in key:
            config[key] = value
    atomic_write(directory / VLLM_WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    atomic_write_json(directory / HEADS_CONFIG, config)
    return directory


def load_vllm(directory: str | os.PathLike) -> MedusaHeads:
    """Read a vLLM ``MedusaModel`` directory back into :class:`MedusaHeads`.

    Reads every ``*.safetensors`` file of the directory (as vLLM does), drops a ``medusa_heads.``
    prefix (as vLLM's loader does), reads the block biases as zeros when ``medusa_fc_bias`` is false
    (vLLM's blocks then have none and it skips stored ones), returns shared heads bound to ``lm_heads.0`` when ``original_lm_head`` is true, and truncated
    heads with the ``token_map`` when ``truncated_vocab_size < vocab_size``.

    Raises:
        HeadsFormatError: missing files or keys, unexpected keys, a token map that contradicts the config,
            a ``logit_scale`` other than 1.0 (vLLM multiplies the heads' logits by it; these heads
            cannot).
    """
    directory = Path(directory)
    config = read_heads_config(directory)
    scale = config.get("logit_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or scale != 1.0:
        raise HeadsFormatError(
            f"{directory / HEADS_CONFIG} has logit_scale={json.dumps(scale)}: vLLM multiplies these heads' "
            "logits by it, medusa_train's heads have no such scale: multiply every lm_heads.*.weight "
            "tensor by it and set logit_scale to 1.0 (vLLM then computes the same logits)"
        )
    files = weights_files(directory, VLLM)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k.removeprefix("medusa_heads."): v for k, v in _load_safetensors(f).items()})
    try:
        num_heads, num_layers = int(config["num_heads"]), int(config["num_hidden_layers"])
        hidden_size, vocab_size = int(config["hidden_size"]), int(config["vocab_size"])
        truncated = int(config.get("truncated_vocab_size") or vocab_size)
    except KeyError as err:
        raise HeadsFormatError(f"{directory / HEADS_CONFIG} lacks {err.args[0]}") from None
    except (TypeError, ValueError):  # null, a string, a list: a damaged or foreign config
        raise HeadsFormatError(
            f"{directory / HEADS_CONFIG} has a non-integer num_heads, num_hidden_layers, hidden_size, "
            "vocab_size or truncated_vocab_size"
        ) from None
    token_map = state.pop(TOKEN_MAP, None)
    shared = bool(config.get("original_lm_head", False))
    if truncated > vocab_size or (truncated < vocab_size) != (token_map is not None):
        raise HeadsFormatError(
            f"{directory}: truncated_vocab_size={truncated} with vocab_size={vocab_size} needs a '{TOKEN_MAP}' "
            f"tensor of {truncated} ids exactly when it is smaller ({'one' if token_map is not None else 'none'} found)"
        )
    if shared and token_map is not None:
        raise HeadsFormatError(f"{directory}: original_lm_head with a truncated vocabulary is not supported")
    kind = "shared" if shared else "truncated" if token_map is not None else "own"
    try:
        heads = MedusaHeads(
            hidden_size,
            vocab_size,
            num_heads,
            num_layers,
            config.get("base_model_name_or_path"),
            head_projection=kind,
            token_map=token_map,
        )
    except HeadsFormatError as err:
        raise HeadsFormatError(f"{directory}: {err}") from None
    if heads.draft_vocab_size != truncated:
        raise HeadsFormatError(
            f"{directory}: token_map has {heads.draft_vocab_size} ids, truncated_vocab_size says {truncated}"
        )
    fc_bias = bool(config.get("medusa_fc_bias", False))
    skipped: list[str] = []
    ours: dict[str, torch.Tensor] = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            prefix = f"blocks.{h}.layers.{layer}"
            bias = state.pop(f"{prefix}.bias", None)
            if not fc_bias:
                if bias is not None:
                    skipped.append(f"{prefix}.bias")
                bias = torch.zeros(hidden_size, dtype=state.get(f"{prefix}.weight", torch.empty(0)).dtype)
            ours[f"{h}.{layer}.linear.weight"] = _pop(state, f"{prefix}.weight", directory)
            ours[f"{h}.{layer}.linear.bias"] = _require(bias, f"{prefix}.bias", directory)
        if not shared:
            ours[f"{h}.{num_layers}.weight"] = _pop(state, f"lm_heads.{h}.weight", directory)
    if shared:  # vLLM reads lm_heads.0 into the one lm_head all heads use
        lm_head = _pop(state, "lm_heads.0.weight", directory)
        if tuple(lm_head.shape) != (vocab_size, hidden_size):
            raise HeadsFormatError(
                f"{directory}: 'lm_heads.0.weight' has shape {tuple(lm_head.shape)}, config implies {(vocab_size, hidden_size)}"
            )
        heads.bind_lm_head(lm_head)
    if state:
        raise HeadsFormatError(
            f"{directory}: unexpected weights {sorted(state)[:4]} for {num_heads} heads x {num_layers} layers"
        )
    heads.load_checked(ours, directory)
    if skipped:
        log.warning(
            "%s: medusa_fc_bias is not true, so the block biases stored there (%s) are read as zeros, as vLLM "
            "builds and loads these heads",
            directory,
            ", ".join(skipped[:2] + (["..."] if len(skipped) > 2 else [])),
        )
    return heads


# -- either layout --------------------------------------------------------------------------------
def load_heads(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> MedusaHeads:
    """Load heads from a directory of either layout (or an export folder holding ``medusa/`` or ``vllm/``).

    Args:
        path: a ``medusa`` or ``vllm`` layout directory, or ``workdir/export`` itself
            (:func:`layout_dir`).
        device: where to put the heads.
        dtype: cast to this dtype; None keeps the stored one.

    Raises:
        HeadsFormatError: not a heads directory, or weights that do not match the config.
    """
    path = layout_dir(path)
    heads = load_vllm(path) if detect_layout(path) == VLLM else load_medusa(path)
    heads.eval()
    return heads.to(device=device, dtype=dtype) if dtype is not None else heads.to(device)


# -- base_model_name_or_path ----------------------------------------------------------------------
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def portable_base_model(name_or_path: str) -> str:
    """``base_model_name_or_path`` as a consumer resolves it from any working directory.

    A path that exists here becomes absolute (a relative one such as ``runs/default/backbone``
    resolves only from the folder training ran in); a Hub id (``org/name``) stays as it is; an
    absolute path that does not exist here is kept (another machine's path), with a warning.

    Raises:
        HeadsFormatError: a relative path that does not exist here and is no Hub id.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path.resolve())
    if _HUB_ID.match(name_or_path):
        return name_or_path
    if path.is_absolute():
        log.warning("base model %s does not exist on this machine; the export names it anyway", path)
        return str(path)
    raise HeadsFormatError(
        f"base model '{name_or_path}' is neither a folder under {Path.cwd()} nor a Hub id: run from the "
        "folder training ran in, or give the base model's Hub id or absolute path"
    )


def is_hub_id(name_or_path: str) -> bool:
    """True for a Hub id as :func:`portable_base_model` leaves it (not an absolute path)."""
    return not Path(name_or_path).is_absolute() and bool(_HUB_ID.match(name_or_path))


# -- helpers --------------------------------------------------------------------------------------
def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a damaged file is a :class:`HeadsFormatError`."""
    safetensors_shapes(path)  # truncated, foreign (a pickle) or damaged: one clear line
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise HeadsFormatError(f"cannot read {path}: {err}") from None


def _save_pickle(state: dict[str, torch.Tensor], path: Path) -> None:
    """``torch.save`` of ``state`` into ``path``: the same tensors give the same bytes.

    Saved through a file object, whose records torch names ``archive/``: given a path, it names them
    after the file, here :func:`~medusa_train.workdir.atomic_write`'s temp name (pid, random suffix).
    """
    with open(path, "wb") as fh:
        torch.save(state, fh)


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``torch.save`` file, through torch's restricted ``weights_only`` unpickler.

    A pickle that would run code (or import anything but tensors and containers), a damaged file or
    anything else that is not a dict of tensors is a :class:`HeadsFormatError`, never executed.
    """
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols it was not written with
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError):
        raise HeadsFormatError(
            f"refused {path}: it is not a plain torch pickle of tensors (it is damaged, or opening it would "
            f"need the unrestricted unpickler, which can run code): use heads saved as {HEADS_WEIGHTS}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise HeadsFormatError(f"{path} holds no dict of tensors")
    return dict(state)


def _pop(state: dict[str, torch.Tensor], key: str, directory: Path) -> torch.Tensor:
    return _require(state.pop(key, None), key, directory)


def _require(tensor: torch.Tensor | None, key: str, directory: Path) -> torch.Tensor:
    if tensor is None:
        raise HeadsFormatError(f"{directory}: weights lack '{key}'")
    return tensor
