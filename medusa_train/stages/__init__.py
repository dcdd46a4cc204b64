"""One module per stage, each exposing ``run(cfg) -> dict`` of the figures it produced.

Stages never import each other; what two stages share lives in a building block (``backbone``,
``workdir``, ``report``, ``decoding``, ``data``, ``training``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

STAGE_ORDER = ("pretrain", "distill", "train", "export", "eval")


def get_stage(name: str) -> Callable:
    """The ``run`` function of ``medusa_train.stages.<name>`` (imported lazily: stages pull heavy deps)."""
    return importlib.import_module(f"medusa_train.stages.{name}").run


def check_settings(cfg) -> None:
    """``stage=all``, before its first stage: what the later stages check of the settings alone, no
    input read (train's: the device, the training recipe, DeepSpeed, ``eval.attention`` on the device;
    :func:`medusa_train.stages.train.check_settings`). They are told at once instead of after
    pretraining and distillation (minutes on the demo, hours on a real backbone); each stage checks
    them again when it runs."""
    importlib.import_module("medusa_train.stages.train").check_settings(cfg)
