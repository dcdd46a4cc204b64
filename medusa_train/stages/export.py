"""Stage `export`: the trained heads in the layouts serving engines load, with a model card.

Run as:
    python -m medusa_train stage=export                                  # workdir/heads -> workdir/export
    python -m medusa_train stage=export export.heads_dir=path/to/heads export.dtype=float16
    python -m medusa_train stage=export export.formats=[vllm] tree=medusa63

Writes (into a staging folder, swapped into place, so a killed run never leaves half an export)::

    workdir/export/
      backbone/             training=medusa2 only: the trained backbone, LoRA merged (config.json,
                            *.safetensors, tokenizer); the heads' base_model_name_or_path names it
      medusa/               config.json + medusa_lm_head.safetensors  (FasterDecoding, TGI, TensorRT-LLM)
                            + medusa_lm_head.pt with export.write_pickle=true (FasterDecoding's loader)
      vllm/                 config.json + model.safetensors            (vLLM MedusaModel; the config
                            also names the base model, the heads' fingerprint, the backbone and the
                            medusa_train version that trained the heads)
      medusa_choices.json   the tree (calibrated by stage=train, or the configured one)
      calibration.json      per-head accuracy and tree table from stage=train (when present and whole)
      custom_generate/      generate.py + requirements.txt: `model.generate(**inputs,
                            custom_generate=<export>, trust_remote_code=True)` decodes with these heads
      README.md             Hub model card: YAML front matter, base model, data, training, head
                            accuracy, tau, how to load

Steps: (1) load the heads (either layout) and the tree; Medusa-2 heads: the trained backbone too
(`heads/backbone`; a LoRA adapter is merged into `model.name_or_path`, loaded unquantized), see
`medusa_train.backbone` for when `model.name_or_path` wins instead; (2) write every layout (and the
backbone); (3) load each one back and compare its weights and logits with the source's, bit for bit
(a mismatch fails the export and leaves the previous one in place); (4) the tree, the calibration,
`custom_generate/` (`medusa_train.custom_generate`) and the model card (`medusa_train.report`); (5) swap the folder into place. `stage=eval` rewrites the
card with the measured tau and speed-up. Only the main process (rank 0) works; a single process is
enough for any model size. The same heads exported again give the same bytes in every file, however
``workdir`` is spelt (docs/pipeline.md).
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_train.backbone import DTYPES, backbone_for_heads, base_model_here, load_backbone_for_heads
from medusa_train.card_inputs import calibration_input
from medusa_train.custom_generate import write_custom_generate
from medusa_train.decoding.tree import tree_for_heads
from medusa_train.errors import HeadsFormatError, UserError
from medusa_train.formats import (
    MEDUSA_CONFIG_KEYS,
    WHOLE_VOCABULARY_MAP,
    load_heads,
    portable_base_model,
    save_medusa,
    save_vllm,
)
from medusa_train.heads import MedusaHeads
from medusa_train.heads_layout import (
    MEDUSA,
    VLLM,
    check_heads_option,
    layout_dir,
    option_refusal,
    read_heads_config,
)
from medusa_train.launch import is_main
from medusa_train.report import (
    HEADS_FINGERPRINT,
    MANIFEST_INPUT,
    PROVENANCE_KEYS,
    REPORT_INPUT,
    belonging,
    model_card,
    read_json,
)
from medusa_train.transformers4 import add_legacy_config_keys, save_tokenizer
from medusa_train.workdir import (
    CALIBRATION,
    CHOICES,
    MANIFEST,
    MODEL_CARD,
    REPORT_JSON,
    TRAINED_BACKBONE,
    Workdir,
    atomic_write_text,
    publish_dir,
    published_path,
    remove_stale,
    require,
    staging_dir,
)

if TYPE_CHECKING:  # annotations only: config imports Hydra, which this stage does not need at run time
    from medusa_train.config import Config

log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """A written layout does not reproduce the trained weights (a bug or a bad disk, not a user error)."""


def run(cfg: Config) -> dict:
    """Export ``export.heads_dir`` (default ``workdir/heads``) to ``workdir/export``.

    Returns:
        ``{"export_dir", "formats", "num_heads", "num_layers", "tree", "tree_size", "roundtrip_identical",
        "bytes", "backbone"}`` (``backbone``: the exported Medusa-2 backbone's directory, or None);
        ``roundtrip_identical`` is True only when every written layout (and backbone) was read back
        with the same weights and logits.

    Raises:
        ExportError: a written layout does not reproduce the source (nothing is published).
    """
    wd = Workdir(Path(cfg.workdir))
    if not is_main():
        return {"export_dir": str(wd.export), "skipped": "not the main process"}

    # 1. Heads and tree (and, for Medusa-2 heads, where their trained backbone goes).
    source = _source(cfg, wd)

    wd.root.mkdir(parents=True, exist_ok=True)
    remove_stale(wd.export)
    tmp = staging_dir(wd.export)
    try:
        # 2. Every layout (and the backbone). 3. Each one read back: same weights, same logits.
        identical = _write_layouts(cfg, source, tmp, wd.export)
        # 4. Tree, calibration, the `model.generate(custom_generate=...)` folder, model card.
        _write_companions(cfg, source, tmp, wd)
        # 5. Into place: a reader sees the old export or the new one, never a mix.
        publish_dir(tmp, wd.export)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    size = sum(f.stat().st_size for f in wd.export.rglob("*") if f.is_file())
    heads = source.heads
    log.info("exported %d heads (%s) to %s", heads.num_heads, ", ".join(cfg.export.formats), wd.export)
    return {
        "export_dir": str(wd.export),
        "formats": list(cfg.export.formats),
        "num_heads": heads.num_heads,
        "num_layers": heads.num_layers,
        "tree": cfg.tree.name,
        "tree_size": len(source.choices),
        "roundtrip_identical": all(identical.values()),
        "bytes": size,
        "backbone": str(source.shipped) if source.shipped is not None else None,
    }


@dataclass
class _Source:
    """What step 1 read: the heads as they will be written, and what goes with them."""

    heads_dir: Path
    heads: MedusaHeads
    heads_config: dict
    """The heads' config.json as read."""
    fingerprints: set[str]
    """The heads' identity as trained (recorded by an earlier export of them, else as read) and as
    exported: the model card states only figures measured on one of these."""
    extra: dict
    """What the FasterDecoding layout's config.json carries beside its own keys."""
    choices: list[list[int]]
    shipped: Path | None
    """Medusa-2: where the trained backbone goes in the export (named by the heads' config and the card)."""


def _source(cfg: Config, wd: Workdir) -> _Source:
    """Step 1: load the heads (either layout), cast to ``export.dtype``, their tree and their base model."""
    if cfg.export.heads_dir:
        heads_dir = check_heads_option("export.heads_dir", cfg.export.heads_dir)
    else:
        heads_dir = require(wd.heads, "trained heads", "train")
    try:
        heads = load_heads(heads_dir)
        heads_config = read_heads_config(layout_dir(heads_dir))
    except HeadsFormatError as err:
        if cfg.export.heads_dir:
            raise option_refusal("export.heads_dir", err) from None
        raise UserError(
            f"cannot export: {err} (run `python -m medusa_train stage=train training.overwrite=true` to write "
            f"{heads_dir} again)"
        ) from None
    source_fingerprint = heads_config.get(HEADS_FINGERPRINT) or heads.fingerprint()
    fingerprints = {source_fingerprint, heads.fingerprint()}
    if heads.head_projection == "truncated" and heads.draft_vocab_size == heads.vocab_size:
        raise UserError(f"cannot export {heads_dir}: " + WHOLE_VOCABULARY_MAP.format(vocab=heads.vocab_size))
    if heads.head_projection == "truncated" and MEDUSA in cfg.export.formats:
        raise UserError(
            f"{heads_dir} holds heads with a truncated draft vocabulary ({heads.draft_vocab_size} tokens): the "
            "FasterDecoding/TGI layout has no token map, export them with export.formats=[vllm]"
        )
    if heads.head_projection == "shared":  # vLLM's layout carries the lm_head they share: the backbone's
        _bind_backbone_lm_head(cfg, heads, heads_dir)
    # NaN/inf weights read back unequal to themselves: caught here, the read-back would blame the disk.
    if bad := _non_finite(heads):
        raise UserError(
            f"cannot export {heads_dir}: {', '.join(bad[:4])} hold NaN or inf (training diverged): train the "
            "heads again, e.g. with a lower training.lr"
        )
    if cfg.export.dtype != "auto":
        heads = heads.to(DTYPES[cfg.export.dtype])
        if heads.head_projection == "shared":
            heads.bind_lm_head(heads.head_weight(0).to(DTYPES[cfg.export.dtype]))
        if bad := _non_finite(heads):
            raise UserError(
                f"cannot export {heads_dir} as export.dtype={cfg.export.dtype}: {', '.join(bad[:4])} exceed its "
                "range (inf after the cast): use export.dtype=bfloat16, float32 or auto"
            )
        fingerprints.add(heads.fingerprint())
    choices = tree_for_heads(cfg.tree, heads_dir, heads)
    extra = {k: v for k, v in heads_config.items() if k not in MEDUSA_CONFIG_KEYS}
    extra[HEADS_FINGERPRINT] = source_fingerprint
    shipped = None
    if backbone_for_heads(cfg.model, heads_dir) is not None:
        shipped = published_path(wd.export) / TRAINED_BACKBONE
        heads.base_model_name_or_path = str(shipped)
    else:  # a Hub id stays one; a local path becomes absolute, so consumers resolve it from anywhere
        try:
            heads.base_model_name_or_path = portable_base_model(
                base_model_here(cfg.model, heads_dir, heads.base_model_name_or_path)
            )
        except HeadsFormatError as err:
            raise UserError(f"cannot export: {err}") from None
    return _Source(heads_dir, heads, heads_config, fingerprints, extra, choices, shipped)


def _non_finite(heads: MedusaHeads) -> list[str]:
    """Names of the heads' weights (and a shared head's lm_head) that hold NaN or inf."""
    weights = dict(heads.heads.named_parameters())
    if heads.head_projection == "shared":
        weights["lm_head"] = heads.head_weight(0)
    return [name for name, w in weights.items() if not bool(torch.isfinite(w).all())]


def _write_layouts(cfg: Config, source: _Source, tmp: Path, export_dir: Path) -> dict[str, bool]:
    """Steps 2 and 3: every layout of ``export.formats`` (and the trained backbone) into ``tmp``,
    each read back; ``{layout: identical}``.

    Raises:
        ExportError: a layout read back with other weights or logits than the source.
    """
    identical: dict[str, bool] = {}
    if source.shipped is not None:
        identical[TRAINED_BACKBONE] = _export_backbone(cfg, source.heads_dir, tmp / TRAINED_BACKBONE)
    for fmt in cfg.export.formats:
        if fmt == MEDUSA:
            save_medusa(
                source.heads, tmp / MEDUSA, extra_config=source.extra, write_pickle=cfg.export.write_pickle
            )
        else:  # the heads' identity, their backbone's and what trained them, in keys vLLM does not read
            identity = {k: source.extra[k] for k in PROVENANCE_KEYS if k in source.extra}
            save_vllm(source.heads, tmp / VLLM, extra_config=identity)
        identical[fmt] = roundtrip_identical(source.heads, tmp / fmt)
    failed = [name for name, same in identical.items() if not same]
    if failed:
        raise ExportError(
            f"the exported {', '.join(failed)} read back with other weights or logits than the source: "
            f"nothing published ({export_dir} is unchanged); check the disk and run stage=export again"
        )
    return identical


def _write_companions(cfg: Config, source: _Source, tmp: Path, wd: Workdir) -> None:
    """Step 4: the tree, the calibration (lets stage=eval on the export report head accuracy),
    ``custom_generate/`` and the model card (stage=eval adds its figures when it runs later).

    A damaged calibration.json (:data:`~medusa_train.card_inputs.CALIBRATION_INPUT`) is left out of the
    export as of its card, with one warning line naming it, as the card's other optional inputs are:
    the export ships no file stage=eval on it would refuse."""
    atomic_write_text(tmp / CHOICES, json.dumps(source.choices) + "\n")
    calibration = read_json(
        source.heads_dir / CALIBRATION,
        calibration_input(source.heads_dir),
        consequence="the export and its model card are written without it",
    )
    if calibration is not None:
        shutil.copyfile(source.heads_dir / CALIBRATION, tmp / CALIBRATION)
    final = published_path(wd.export)
    write_custom_generate(tmp, final)
    # Only figures measured on these heads: heads from elsewhere (export.heads_dir) never get this
    # workdir's tau or distilled data.
    manifest, report = belonging(
        source.fingerprints,
        source.heads_config,
        read_json(wd.distill / MANIFEST, MANIFEST_INPUT),
        read_json(wd.eval / REPORT_JSON, REPORT_INPUT),
    )
    card = model_card(
        heads=source.heads,
        heads_config=source.heads_config,
        formats=list(cfg.export.formats),
        tree_name=cfg.tree.name,
        choices=source.choices,
        manifest=manifest,
        calibration=calibration,
        report=report,
        backbone=str(source.shipped) if source.shipped is not None else None,
        export_dir=final,
        pickle=MEDUSA in cfg.export.formats and cfg.export.write_pickle,
    )
    atomic_write_text(tmp / MODEL_CARD, card)


def roundtrip_identical(heads: MedusaHeads, directory: Path) -> bool:
    """Read the layout in ``directory`` back: True when its tensors (token map, and for shared heads the
    lm_head copy vLLM reads) and its logits equal ``heads``' exactly.

    The logits are compared on fixed random hidden states ``(2, 3, d)``, in ``heads``' dtype and device.
    A file that no longer parses counts as not identical.
    """
    device, dtype = heads.device, heads.dtype
    try:
        back = load_heads(directory, device=device)
    except (HeadsFormatError, OSError) as err:
        log.error("cannot read back %s: %s", directory, err)
        return False
    if back.head_projection != heads.head_projection:
        return False
    if heads.token_map is not None and not torch.equal(back.token_map.to(device), heads.token_map):
        return False
    theirs, ours = back.heads.state_dict(), heads.heads.state_dict()
    if theirs.keys() != ours.keys() or not all(torch.equal(theirs[k], ours[k]) for k in ours):
        return False
    if heads.head_projection == "shared":  # vLLM's copy of the lm_head must be the one the heads use
        lm_head = heads.head_weight(0)
        if back.is_bound and not torch.equal(back.head_weight(0).to(lm_head.device), lm_head):
            return False
        back.bind_lm_head(lm_head)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, heads.hidden_size, generator=gen).to(device=device, dtype=dtype)
    with torch.no_grad():
        return torch.equal(back(hidden), heads(hidden))  # (K, 2, 3, V_draft) each


def _bind_backbone_lm_head(cfg: Config, heads: MedusaHeads, heads_dir: Path) -> None:
    """Shared heads: bind the lm_head of their backbone (loaded on the CPU, unquantized), which the
    vLLM layout stores as ``lm_heads.0.weight``. Refuses a backbone without one, or of another shape."""
    model, _, source, _ = load_backbone_for_heads(
        cfg.model, heads_dir, device=torch.device("cpu"), quantize=False
    )
    try:
        heads.attach(model)
    except HeadsFormatError as err:
        raise UserError(f"cannot export shared heads over {source}: {err}") from None


def _export_backbone(cfg: Config, heads_dir: Path, directory: Path) -> bool:
    """Write the trained Medusa-2 backbone as a plain Hugging Face model (LoRA merged) + tokenizer.

    Loaded without quantization (a QLoRA adapter is merged into the full-precision base), cast to
    ``export.dtype`` unless auto, saved, then loaded back. config.json and the tokenizer files also
    carry what transformers 4.x consumers read (:func:`~medusa_train.transformers4.add_legacy_config_keys`,
    :func:`~medusa_train.transformers4.save_tokenizer`). Only one copy of the model is held at a
    time.

    Returns:
        True when the written model's logits on fixed tokens equal the in-memory model's bit for bit
        and the written tokenizer encodes a sample text as the in-memory one does.
    """
    model, tokenizer, source, _ = load_backbone_for_heads(cfg.model, heads_dir, quantize=False)
    log.info("export: backbone %s (trained with the heads: training=medusa2)", source)
    if cfg.export.dtype != "auto":
        model = model.to(DTYPES[cfg.export.dtype])
    weight = model.get_output_embeddings().weight  # (V, d)
    device, dtype = weight.device, weight.dtype
    ids = torch.randint(0, weight.shape[0], (1, 8), generator=torch.Generator().manual_seed(0))
    del weight
    with torch.no_grad():
        expected = model(input_ids=ids.to(device)).logits  # (1, 8, V)
    model.save_pretrained(directory)
    # transformers 4.x consumers read rope_theta/rope_scaling/torch_dtype at the top level and cannot
    # read transformers 5's tokenizer class name or tokenizers >= 0.20's merges; the reloads below
    # (transformers 5) must still give the same logits and token ids with those files adapted.
    added = add_legacy_config_keys(directory)
    changed = save_tokenizer(tokenizer, directory)
    log.info("export: backbone files adapted for transformers 4.x consumers: %s", sorted(added) + changed)
    sample = "Medusa heads draft tokens; the backbone verifies them."
    reloaded = AutoTokenizer.from_pretrained(directory, trust_remote_code=cfg.model.trust_remote_code)
    if reloaded(sample).input_ids != tokenizer(sample).input_ids:
        log.error("the tokenizer written to %s encodes differently", directory)
        return False
    del model
    gc.collect()
    back = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code
    ).to(device)
    back.eval()
    with torch.no_grad():
        return torch.equal(back(input_ids=ids.to(device)).logits, expected)  # (1, 8, V)
