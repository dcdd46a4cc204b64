"""A backbone's source, ``model.name_or_path`` (a local directory or a Hub id), checked with the
standard library only: the CLI checks it before it imports a stage (torch and transformers take
seconds to import), so a mistyped path is told at once; :mod:`medusa_train.backbone` checks it again
before it loads anything (a stage called as a library). The same for eval's draft model
(``eval.assistant_model``). A LoRA adapter's folder is told apart here too (Medusa-2 with LoRA/QLoRA
saves only the adapter, with no model of its own).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from medusa_train.errors import UserError
from medusa_train.workdir import remove_stale

CONFIG_NAME = "config.json"
"""A Hugging Face model directory's config (transformers.utils.CONFIG_NAME, spelt out here: this
module must not import transformers)."""

ADAPTER_CONFIG = "adapter_config.json"
"""A peft adapter directory (Medusa-2 with LoRA/QLoRA saves only the adapter) holds this file."""


def is_local_path(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is spelt as a local path, not a Hub id (``org/name``): it starts with
    ``.``, ``/`` or ``~``, or has more than one ``/`` ("runs/x/pretrain")."""
    return name_or_path.count("/") > 1 or name_or_path.startswith((".", "/", "~"))


def check_backbone_source(name_or_path: str) -> None:
    """Fail early (before loading any weights) when a local backbone directory is missing."""
    path = Path(name_or_path).expanduser()
    if not path.exists() and path.parent.is_dir():
        remove_stale(path)  # workdir/pretrain left aside by a run killed while publishing it comes back
    if path.exists():
        if not (path / CONFIG_NAME).is_file() and is_adapter_dir(path):
            raise UserError(_adapter_is_no_model(path))
        if not (path / CONFIG_NAME).is_file():
            raise UserError(
                f"model.name_or_path={path} is not a Hugging Face model directory (no config.json)"
            )
        return
    if name_or_path.rstrip("/").endswith("/pretrain"):  # model=tiny's place for the embedded backbone
        raise UserError(
            f"no backbone at {name_or_path}: run `python -m medusa_train stage=pretrain` first (model=tiny), "
            "or pass model=hf model.name_or_path=<hub id or directory>"
        )
    if is_local_path(name_or_path):
        raise UserError(
            f"model.name_or_path={name_or_path}: no such directory here (a Hub id has the form org/name): "
            "give the directory that holds the model's config.json, or a Hub id"
        )


def check_assistant_source(name_or_path: str) -> None:
    """``eval.assistant_model`` spelt as a local path (:func:`is_local_path`)
    names an existing directory with a config.json; a Hub id is left to the download."""
    path = Path(name_or_path).expanduser()
    if path.exists() or is_local_path(name_or_path):
        if not (path / CONFIG_NAME).is_file():
            reason = (
                "is not a Hugging Face model directory (no config.json)"
                if path.exists()
                else "does not exist"
            )
            raise UserError(
                f"eval.assistant_model={name_or_path} {reason}: give a Hugging Face causal LM "
                "name or directory, or eval.assistant_model=null"
            )


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """True for a peft adapter directory (no model of its own: it needs its base model)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _adapter_is_no_model(path: Path) -> str:
    """The one line for ``model.name_or_path`` naming a LoRA adapter (Medusa-2's ``heads/backbone``)."""
    try:
        base = json.loads((path / ADAPTER_CONFIG).read_bytes()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    return (
        f"model.name_or_path={path} is a LoRA adapter, not a whole model: pass its base model"
        + (f" ({base})" if isinstance(base, str) and base else "")
        + " (eval and export merge the adapter shipped with the heads into it)"
    )
