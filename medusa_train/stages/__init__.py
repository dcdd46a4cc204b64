"""One module per stage, each exposing ``run(cfg) -> dict`` of the figures it produced.

Also the one place stages turn ``cfg.model`` into a loaded backbone, including the rule export and
eval follow after Medusa-2 (``training=medusa2``), which trains the backbone too and ships it next
to the heads as ``backbone/`` (the full model, or a LoRA adapter):

1. the heads come with such a ``backbone/`` (``workdir/heads/backbone``, or ``backbone/`` of the
   export a ``medusa/``/``vllm/`` folder belongs to) and ``model.name_or_path`` is the base the run
   started from (the same name or directory, or the same checkpoint files by fingerprint, so a
   moved or copied base still counts; or the record is missing): that trained backbone is used;
   a LoRA adapter is merged into ``model.name_or_path`` (loaded with ``model.dtype``/``model.quantization``);
2. otherwise (Medusa-1 heads, or ``model.name_or_path`` names another checkpoint): ``model.name_or_path``
   as given.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

STAGE_ORDER = ("backbone", "distill", "train", "export", "eval")
TRAINED_BACKBONE = "backbone"
"""Medusa-2: the folder next to the heads holding the trained backbone (or its LoRA adapter)."""


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


def trained_backbone_dir(heads_dir: Path) -> Path | None:
    """The Medusa-2 backbone that ships with ``heads_dir``, or None (Medusa-1 heads, heads from elsewhere).

    Looked for in ``heads_dir/backbone`` (``workdir/heads``, an export folder) and, for a
    ``medusa/``/``vllm/`` layout folder, in ``backbone/`` of the export it belongs to.
    """
    from medusa_train.backbone import is_adapter_dir
    from medusa_train.formats import LAYOUTS

    candidates = [heads_dir / TRAINED_BACKBONE]
    if heads_dir.name in LAYOUTS:
        candidates.append(heads_dir.parent / TRAINED_BACKBONE)
    return next((p for p in candidates if (p / "config.json").is_file() or is_adapter_dir(p)), None)


def recorded_base(heads_dir: Path) -> dict | None:
    """Identity (``name_or_path``, ``fingerprint``, ...) of the backbone training started from, as
    stage=train recorded it with the heads (an export keeps it in ``medusa/config.json``)."""
    from medusa_train.formats import MEDUSA, read_heads_config
    from medusa_train.heads import HeadsFormatError

    for directory in (heads_dir, heads_dir / MEDUSA, heads_dir.parent / MEDUSA):
        try:
            identity = read_heads_config(directory).get("backbone")
        except HeadsFormatError:
            continue
        if isinstance(identity, dict) and identity.get("name_or_path"):
            return identity
    return None


def _same_path(a: str, b: str) -> bool:
    """The same hub id, or the same local directory however spelt."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return a == b or (pa.exists() and pb.exists() and pa.resolve() == pb.resolve())


def _is_base(model_cfg, base: dict) -> bool:
    """``model.name_or_path`` is the recorded base: the same name, or the same checkpoint files."""
    from medusa_train.backbone import checkpoint_fingerprint

    if _same_path(model_cfg.name_or_path, str(base["name_or_path"])):
        return True
    found = checkpoint_fingerprint(model_cfg.name_or_path, model_cfg.revision)
    return found is not None and found == base.get("fingerprint")


def backbone_for_heads(model_cfg, heads_dir: Path) -> Path | None:
    """The trained Medusa-2 backbone to use with ``heads_dir``, or None for ``model.name_or_path``.

    See the module docstring for the rule; a warning says when a trained backbone is passed over.
    """
    trained = trained_backbone_dir(heads_dir)
    if trained is None:
        return None
    base = recorded_base(heads_dir)
    if base is None or _is_base(model_cfg, base) or _same_path(model_cfg.name_or_path, str(trained)):
        return trained
    log.warning(
        "the heads in %s were trained together with the backbone in %s (training=medusa2), but "
        "model.name_or_path=%s is another model than their base %s: using %s as asked",
        heads_dir,
        trained,
        model_cfg.name_or_path,
        base["name_or_path"],
        model_cfg.name_or_path,
    )
    return None


def load_trained_backbone(model_cfg, directory: Path, device=None, *, base=None):
    """The Medusa-2 backbone saved in ``directory``: a full model, or a LoRA adapter merged into its base.

    Args:
        model_cfg: ``cfg.model``: dtype, quantization and ``trust_remote_code`` apply; for an adapter,
            ``name_or_path`` is its base.
        directory: ``heads/backbone`` (full model or adapter) or an export's ``backbone`` (full model).
        device: defaults to ``resolve_device(model_cfg.device)``.
        base: an already loaded base model to merge an adapter into (loaded from ``model_cfg`` if None).

    Returns:
        The model, in eval mode without gradients.
    """
    from medusa_train.backbone import is_adapter_dir, load_backbone, merge_adapter, resolve_device

    device = device if device is not None else resolve_device(model_cfg.device)
    if is_adapter_dir(directory):
        if base is None:
            base, _ = load_configured_backbone(model_cfg, device)
        return merge_adapter(base, directory)
    model, _ = load_backbone(
        str(directory),
        dtype=model_cfg.dtype,
        quantization=model_cfg.quantization,
        device=device,
        trust_remote_code=model_cfg.trust_remote_code,
    )
    return model


def load_backbone_for_heads(model_cfg, heads_dir: Path, device=None, *, quantize: bool = True):
    """``(model, tokenizer, source, trained)`` for evaluating or exporting the heads in ``heads_dir``.

    ``source`` names what was loaded: the trained backbone's directory (``trained`` True: Medusa-2,
    see :func:`backbone_for_heads`) or ``model.name_or_path``. ``quantize=False`` loads without
    ``model.quantization`` (export writes full weights).
    """
    from medusa_train.backbone import load_tokenizer

    if not quantize:
        model_cfg = dataclasses.replace(model_cfg, quantization="none")
    trained = backbone_for_heads(model_cfg, heads_dir)
    if trained is None:
        model, tokenizer = load_configured_backbone(model_cfg, device)
        return model, tokenizer, str(model_cfg.name_or_path), False
    model = load_trained_backbone(model_cfg, trained, device)
    tokenizer = load_tokenizer(str(trained), trust_remote_code=model_cfg.trust_remote_code)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer, str(trained), True
