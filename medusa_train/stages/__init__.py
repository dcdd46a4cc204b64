"""One module per stage, each exposing ``run(cfg) -> dict`` of the figures it produced."""

from __future__ import annotations

import importlib
from collections.abc import Callable

STAGE_ORDER = ("backbone", "distill", "train", "export", "eval")


def get_stage(name: str) -> Callable:
    """The ``run`` function of ``medusa_train.stages.<name>`` (imported lazily: stages pull heavy deps)."""
    return importlib.import_module(f"medusa_train.stages.{name}").run
