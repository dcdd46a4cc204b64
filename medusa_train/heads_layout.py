"""What a heads folder holds, read with the standard library only: its layout (FasterDecoding's
``medusa`` or vLLM's ``vllm``, :mod:`medusa_train.formats` writes and loads both), its config.json,
and the checks made of a folder before any tensor is read. The CLI runs these before it imports a
stage (torch and transformers take seconds to import), so heads named in the config that are not
there (``training.init_heads``, ``eval.compare``) are told at once, and with ``stage=all`` before
pretraining and training instead of after; the stages run them again (a stage can be called as a
library).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
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
    try:
        config = json.loads(config_path.read_bytes())
    except (ValueError, RecursionError):
        raise HeadsFormatError(f"{config_path} is damaged (not valid JSON)") from None
    if not isinstance(config, dict):
        raise HeadsFormatError(f"{config_path} is damaged (not a JSON object)")
    safetensors_shapes(weights_path)
    return config, weights_path


@contextlib.contextmanager
def init_heads_refusal() -> Iterator[None]:
    """Reading ``training.init_heads``: a heads folder that is missing or damaged, as one line."""
    try:
        yield
    except HeadsFormatError as err:
        raise UserError(f"training.init_heads: {err}") from None


def check_init_heads(directory: str | os.PathLike) -> None:
    """``training.init_heads``, checked as :func:`check_heads_directory` checks it, as one line."""
    with init_heads_refusal():
        check_heads_directory(directory)


def compare_heads_dir(entry: str | os.PathLike) -> Path:
    """An ``eval.compare`` entry's heads folder: the entry as given, or ``<entry>/heads`` for a workdir;
    checked to hold heads of either layout (their config.json and weights file, not their shapes).

    Raises:
        UserError: it is not there or holds no heads (one line, saying what to give).
    """
    path = Path(entry)
    if not path.exists():
        raise UserError(
            f"eval.compare: {path} does not exist (give heads folders or workdirs holding heads/)"
        )
    heads_dir = path / "heads" if (path / "heads").is_dir() else path
    try:
        detect_layout(layout_dir(heads_dir))
    except HeadsFormatError as err:
        raise UserError(f"eval.compare: {err} (give heads folders or workdirs holding heads/)") from None
    return heads_dir


def _read_config(directory: Path) -> dict:
    try:
        config = json.loads((directory / HEADS_CONFIG).read_text())
    except FileNotFoundError:
        raise HeadsFormatError(f"{directory} has no {HEADS_CONFIG}") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, bad UTF-8, nesting too deep
        raise HeadsFormatError(f"{directory / HEADS_CONFIG} is damaged (not valid JSON: {err})") from None
    if not isinstance(config, dict):
        raise HeadsFormatError(f"{directory / HEADS_CONFIG} is not a JSON object")
    return config
