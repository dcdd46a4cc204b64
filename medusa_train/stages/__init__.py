"""One module per stage, each exposing ``run(cfg) -> dict`` of the figures it produced."""

from __future__ import annotations

import importlib
from collections.abc import Callable

STAGE_ORDER = ("backbone", "distill", "train", "export", "eval")


def get_stage(name: str) -> Callable:
    """The ``run`` function of ``medusa_train.stages.<name>`` (imported lazily: stages pull heavy deps)."""
    return importlib.import_module(f"medusa_train.stages.{name}").run


def load_configured_backbone(model_cfg, device=None, *, trainable: bool = False):
    """``(model, tokenizer)`` as ``cfg.model`` describes them: the one place stages turn config into a load.

    Args:
        model_cfg: ``cfg.model`` (:class:`medusa_train.config.ModelConfig`).
        device: defaults to ``resolve_device(model_cfg.device)``.
        trainable: False freezes the model (eval mode, no gradients).
    """
    from medusa_train.backbone import load_backbone, resolve_device

    return load_backbone(
        model_cfg.name_or_path,
        dtype=model_cfg.dtype,
        quantization=model_cfg.quantization,
        device=device if device is not None else resolve_device(model_cfg.device),
        trust_remote_code=model_cfg.trust_remote_code,
        revision=model_cfg.revision,
        trainable=trainable,
    )
