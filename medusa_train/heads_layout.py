"""What a heads folder holds, read with the standard library only: its layout (FasterDecoding's
``medusa`` or vLLM's ``vllm``, :mod:`medusa_train.formats` writes and loads both), its config.json,
and the checks made of a folder before any tensor is read. The CLI runs these before it imports a
stage (torch and transformers take seconds to import), so heads named in the config
(:data:`HEADS_OPTIONS`) that are not there or damaged are told at once, and with ``stage=all`` before
pretraining and training instead of after; the stages run them again (a stage can be called as a
library).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from medusa_train.errors import HeadsFormatError, UserError
from medusa_train.safetensors_check import safetensors_shapes
from medusa_train.workdir import HEADS_CONFIG, HEADS_WEIGHTS

MEDUSA = "medusa"
VLLM = "vllm"
LAYOUTS = (MEDUSA, VLLM)
LEGACY_WEIGHTS_NAME = "medusa_lm_head.pt"
"""A torch pickle: the only weights file FasterDecoding's loader opens (its published checkpoints, e.g.
FasterDecoding/medusa-vicuna-7b-v1.3, ship one); TensorRT-LLM's converter prefers it when present."""


def detect_layout(path: str | os.PathLike) -> str:
    """``"medusa"`` or ``"vllm"`` for a heads directory.

    Raises:
        HeadsFormatError: ``path`` is not a directory of either layout (the message says what is there).
    """
    path = Path(path)
    if not path.is_dir():
        raise HeadsFormatError(f"{path} is not a directory of Medusa heads")
    config_path = path / HEADS_CONFIG
    if not config_path.is_file():
        raise HeadsFormatError(
            f"{path} has no {HEADS_CONFIG}: not a Medusa heads directory (FasterDecoding or vLLM layout)"
        )
    config = _read_config(path)
    if "medusa_num_heads" in config:
        if not any((path / name).is_file() for name in (HEADS_WEIGHTS, LEGACY_WEIGHTS_NAME)):
            raise HeadsFormatError(f"{path} has a Medusa config.json but no {HEADS_WEIGHTS}")
        return MEDUSA
    if config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or []):
        return VLLM
    raise HeadsFormatError(
        f"{config_path} is neither a FasterDecoding Medusa config (medusa_num_heads) nor a vLLM one "
        "(model_type: medusa); is this the backbone's directory?"
    )


def layout_dir(path: str | os.PathLike) -> Path:
    """The heads folder of ``path``: ``path`` itself when it holds a config.json, else the layout an
    export folder holds (its ``medusa/``, else its ``vllm/``: an export of truncated heads has only
    that one), else ``path`` (which :func:`~medusa_train.formats.load_heads` then refuses, saying
    what is there)."""
    path = Path(path)
    if not path.is_dir() or (path / HEADS_CONFIG).exists():
        return path
    return next((path / name for name in LAYOUTS if (path / name / HEADS_CONFIG).is_file()), path)


def read_heads_config(path: str | os.PathLike) -> dict:
    """The raw config.json of a heads directory (extra keys such as training settings included)."""
    return _read_config(Path(path))


def check_heads_directory(directory: str | os.PathLike) -> tuple[dict, Path]:
    """The checks :meth:`MedusaHeads.from_pretrained <medusa_train.heads.MedusaHeads.from_pretrained>`
    makes before it reads any weight, each a :class:`HeadsFormatError`: the config and weights files
    are there, the config is a JSON object and the weights file's safetensors header matches its size.
    Cheap (no tensor is read): a stage checks heads it will load only later with it.

    Returns:
        ``(config, weights file)``.
    """
    directory = Path(directory)
    config_path, weights_path = directory / HEADS_CONFIG, directory / HEADS_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise HeadsFormatError(
            f"{directory} is not a Medusa heads directory (needs {HEADS_CONFIG} and {HEADS_WEIGHTS})"
        )
    config = _read_config(directory)
    safetensors_shapes(weights_path)
    return config, weights_path


HEADS_OPTIONS = {
    "training.init_heads": "",
    "export.heads_dir": " (give a heads folder of either layout, or an export folder holding one)",
    "eval.heads_dir": " (give a heads folder of either layout, or an export folder holding one)",
    "eval.compare": " (give heads folders or workdirs holding heads/)",
}
"""The options naming a heads folder, each with what its refusal says to give (``training.init_heads``
says nothing more: its message names the two files it needs)."""


def check_heads_option(option: str, value: str | os.PathLike) -> Path:
    """The heads folder an option of :data:`HEADS_OPTIONS` names, checked as its stage reads it before
    any tensor is read: ``training.init_heads`` a folder of this package's layout
    (:func:`check_heads_directory`; training goes on from its weights), the others heads of either
    layout or an export folder holding them (:func:`check_heads_folder`), an ``eval.compare`` entry
    also a workdir holding ``heads/``.

    Returns:
        The folder to load: ``value``, or ``<value>/heads`` for an ``eval.compare`` workdir.

    Raises:
        UserError: one line naming the option (:func:`option_refusal`).
    """
    path = Path(value)
    try:
        if option == "training.init_heads":
            check_heads_directory(path)
            return path
        if not path.exists():
            raise HeadsFormatError(f"{path} does not exist")
        if option == "eval.compare" and (path / "heads").is_dir():
            path = path / "heads"
        check_heads_folder(path)
    except HeadsFormatError as err:
        raise option_refusal(option, err) from None
    return path


def option_refusal(option: str, err: HeadsFormatError) -> UserError:
    """The one line refusing heads that ``option`` names (missing, damaged, or weights that do not
    match their config): the option, the problem, what to give."""
    return UserError(f"{option}: {err}{HEADS_OPTIONS[option]}")


def check_heads_folder(path: str | os.PathLike) -> Path:
    """Heads of either layout at ``path``, or an export folder holding them (:func:`layout_dir`), whole
    as far as can be told without reading a tensor: the layout's config.json, and the safetensors
    header and size of every weights file :func:`~medusa_train.formats.load_heads` reads (a
    ``medusa_lm_head.pt`` alone is read with torch, so only when loaded).

    Returns:
        The layout's folder.

    Raises:
        HeadsFormatError: no heads there, or a damaged file (the message says which).
    """
    directory = layout_dir(path)
    for weights in weights_files(directory, detect_layout(directory)):
        safetensors_shapes(weights)
    return directory


def weights_files(directory: Path, layout: str) -> list[Path]:
    """The safetensors files a loader reads of heads of ``layout`` in ``directory``: the FasterDecoding
    layout's ``medusa_lm_head.safetensors`` (none where only its pickle is there), every
    ``*.safetensors`` of vLLM's (as vLLM reads them).

    Raises:
        HeadsFormatError: a vLLM layout without any.
    """
    if layout == MEDUSA:
        return [directory / HEADS_WEIGHTS] if (directory / HEADS_WEIGHTS).is_file() else []
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise HeadsFormatError(f"{directory} has a vLLM Medusa config.json but no *.safetensors weights")
    return files


def _read_config(directory: Path) -> dict:
    """config.json of a heads folder, read the one way every check and loader here reads it."""
    try:
        config = json.loads((directory / HEADS_CONFIG).read_text())
    except FileNotFoundError:
        raise HeadsFormatError(f"{directory} has no {HEADS_CONFIG}") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, bad UTF-8, nesting too deep
        raise HeadsFormatError(f"{directory / HEADS_CONFIG} is damaged (not valid JSON: {err})") from None
    if not isinstance(config, dict):
        raise HeadsFormatError(f"{directory / HEADS_CONFIG} is not a JSON object")
    return config
