"""Stage `export`: the trained heads in the layouts serving engines load, with a model card.

Run as:
    python -m medusa_train stage=export                                  # workdir/heads -> workdir/export
    python -m medusa_train stage=export export.heads_dir=path/to/heads export.dtype=float16
    python -m medusa_train stage=export export.formats=[vllm] tree=medusa63

Writes (into a temporary folder, renamed into place, so a killed run never leaves half an export)::

    workdir/export/
      backbone/             training=medusa2 only: the trained backbone, LoRA merged (config.json,
                            *.safetensors, tokenizer); the heads' base_model_name_or_path names it
      medusa/               config.json + medusa_lm_head.safetensors  (FasterDecoding, TGI, TensorRT-LLM)
      vllm/                 config.json + model.safetensors            (vLLM MedusaModel)
      medusa_choices.json   the tree (calibrated by stage=train, or the configured one)
      calibration.json      per-head accuracy and tree table from stage=train (when present)
      README.md             model card: base model, data, training, head accuracy, tau, how to load

Steps: (1) load the heads (either layout) and the tree; Medusa-2 heads: the trained backbone too
(`heads/backbone`; a LoRA adapter is merged into `model.name_or_path`, loaded unquantized), see
`medusa_train.stages` for when `model.name_or_path` wins instead; (2) write every layout (and the
backbone); (3) load each one back and check that its logits equal the source's bit for bit; (4) the
model card; (5) rename the folder into place. `stage=eval` rewrites the card with the measured tau
and speed-up. Only the main process (rank 0) works; a single process is enough for any model size.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from medusa_train.errors import UserError
from medusa_train.formats import (
    MEDUSA,
    MEDUSA_CONFIG_KEYS,
    VLLM,
    load_heads,
    read_heads_config,
    save_medusa,
    save_vllm,
)
from medusa_train.heads import HeadsFormatError, MedusaHeads
from medusa_train.workdir import TRAINED_BACKBONE, Workdir, require

log = logging.getLogger(__name__)

CHOICES_NAME = "medusa_choices.json"
CARD_NAME = "README.md"
CALIBRATION_NAME = "calibration.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run(cfg) -> dict:
    """Export ``export.heads_dir`` (default ``workdir/heads``) to ``workdir/export``.

    Returns:
        ``{"export_dir", "formats", "num_heads", "num_layers", "tree_size", "roundtrip_identical", "bytes",
        "backbone"}`` (``backbone``: the exported Medusa-2 backbone's directory, or None).
    """
    from medusa_train.backbone import backbone_for_heads
    from medusa_train.stages.eval import tree_choices
    from medusa_train.tracking import is_main_process

    wd = Workdir(Path(cfg.workdir))
    if not is_main_process():
        return {"export_dir": str(wd.export), "skipped": "not the main process"}
    # 1. Heads and tree.
    heads_dir = (
        Path(cfg.export.heads_dir) if cfg.export.heads_dir else require(wd.heads, "trained heads", "train")
    )
    try:
        heads = load_heads(heads_dir)
        heads_config = read_heads_config(
            heads_dir if (heads_dir / "config.json").exists() else heads_dir / MEDUSA
        )
    except HeadsFormatError as err:
        raise UserError(f"cannot export: {err}") from None
    if cfg.export.dtype != "auto":
        heads = heads.to(DTYPES[cfg.export.dtype])
    tree_name, choices = tree_choices(cfg.tree, heads_dir, heads.num_heads)
    extra = {k: v for k, v in heads_config.items() if k not in MEDUSA_CONFIG_KEYS}
    shipped = None  # Medusa-2: where the trained backbone goes, named by the heads' config and the card
    if backbone_for_heads(cfg.model, heads_dir) is not None:
        shipped = wd.export / TRAINED_BACKBONE
        heads.base_model_name_or_path = str(shipped)

    wd.root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-tmp-", dir=wd.root))
    try:
        # 2. Every layout. 3. Each one loaded back must give the same logits bit for bit.
        if shipped is not None:
            export_backbone(cfg, heads_dir, tmp / TRAINED_BACKBONE)
        for fmt in cfg.export.formats:
            if fmt == MEDUSA:
                save_medusa(heads, tmp / MEDUSA, extra_config=extra)
            else:
                save_vllm(heads, tmp / VLLM)
            check_roundtrip(heads, tmp / fmt)
        (tmp / CHOICES_NAME).write_text(json.dumps(choices) + "\n")
        if (heads_dir / CALIBRATION_NAME).is_file():  # lets stage=eval on the export report head accuracy
            shutil.copyfile(heads_dir / CALIBRATION_NAME, tmp / CALIBRATION_NAME)
        # 4. Model card (eval figures are added by stage=eval when it runs later).
        card = model_card(
            heads=heads,
            heads_config=heads_config,
            formats=list(cfg.export.formats),
            tree_name=tree_name,
            tree_size=len(choices),
            manifest=_read_json(wd.distill / "manifest.json"),
            calibration=_read_json(heads_dir / CALIBRATION_NAME),
            report=_read_json(wd.eval / "report.json"),
            backbone=str(shipped) if shipped is not None else None,
        )
        (tmp / CARD_NAME).write_text(card)
        # 5. Into place: the old export (if any) moves aside first, then goes.
        _replace_dir(tmp, wd.export)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    size = sum(f.stat().st_size for f in wd.export.rglob("*") if f.is_file())
    log.info("exported %d heads (%s) to %s", heads.num_heads, ", ".join(cfg.export.formats), wd.export)
    return {
        "export_dir": str(wd.export),
        "formats": list(cfg.export.formats),
        "num_heads": heads.num_heads,
        "num_layers": heads.num_layers,
        "tree": tree_name,
        "tree_size": len(choices),
        "roundtrip_identical": True,
        "bytes": size,
        "backbone": str(shipped) if shipped is not None else None,
    }


def export_backbone(cfg, heads_dir: Path, directory: Path) -> None:
    """Write the trained Medusa-2 backbone as a plain Hugging Face model (LoRA merged) + tokenizer.

    Loaded without quantization (a QLoRA adapter is merged into the full-precision base), cast to
    ``export.dtype`` unless auto, saved, then loaded back: its logits on fixed tokens must equal the
    in-memory model's bit for bit. Only one copy of the model is held at a time.

    Raises:
        AssertionError: the written model does not reproduce the logits (a bug, not a user error).
    """
    import gc

    from transformers import AutoModelForCausalLM

    from medusa_train.backbone import load_backbone_for_heads

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
    tokenizer.save_pretrained(directory)
    del model
    gc.collect()
    back = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code
    ).to(device)
    back.eval()
    with torch.no_grad():
        same = torch.equal(back(input_ids=ids.to(device)).logits, expected)  # (1, 8, V)
    assert same, f"export to {directory} does not reproduce the trained backbone's logits"


def check_roundtrip(heads: MedusaHeads, directory: Path) -> None:
    """Load ``directory`` back and require bit-identical head logits on random hidden states.

    Raises:
        AssertionError: the written files do not reproduce ``heads`` (a bug, not a user error).
    """
    weight = heads.proj(0).weight
    back = load_heads(directory, device=weight.device)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, heads.hidden_size, generator=gen).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        same = torch.equal(back(hidden), heads(hidden))  # (K, 2, 3, V) each
    assert same, f"export to {directory} does not reproduce the heads' logits"


def write_model_card(
    export_dir: Path, *, heads_dir: Path, wd: Workdir, tree_name: str, tree_size: int
) -> None:
    """Rewrite ``export_dir/README.md`` (atomically) from what is on disk now; used by stage=eval."""
    layouts = [fmt for fmt in (MEDUSA, VLLM) if (export_dir / fmt).is_dir()]
    source = export_dir / layouts[0]
    backbone = export_dir / TRAINED_BACKBONE
    card = model_card(
        heads=load_heads(source),
        heads_config=read_heads_config(export_dir / MEDUSA if MEDUSA in layouts else heads_dir),
        formats=layouts,
        tree_name=tree_name,
        tree_size=tree_size,
        manifest=_read_json(wd.distill / "manifest.json"),
        calibration=_read_json(heads_dir / CALIBRATION_NAME) or _read_json(export_dir / CALIBRATION_NAME),
        report=_read_json(wd.eval / "report.json"),
        backbone=str(backbone) if backbone.is_dir() else None,
    )
    tmp = export_dir / f".{CARD_NAME}.tmp"
    tmp.write_text(card)
    os.replace(tmp, export_dir / CARD_NAME)


def model_card(
    *,
    heads: MedusaHeads,
    heads_config: dict,
    formats: list[str],
    tree_name: str,
    tree_size: int,
    manifest: dict | None,
    calibration: dict | None,
    report: dict | None,
    backbone: str | None = None,
) -> str:
    """The export's README.md: what the heads are, how they were made and measured, how to load them.

    ``backbone``: the exported Medusa-2 backbone (the base model to load with the heads), if any.
    """
    from medusa_train.stages.eval import head_accuracy

    base = (
        backbone
        or heads.base_model_name_or_path
        or heads_config.get("base_model_name_or_path")
        or "<base model>"
    )
    k = heads.num_heads
    lines = [
        f"# Medusa heads for `{base}`",
        "",
        f"{k} Medusa heads (Cai et al., arXiv:2401.10774), {heads.num_layers} residual block(s) each, "
        f"hidden size {heads.hidden_size}, vocabulary {heads.vocab_size}, dtype {str(heads.proj(0).weight.dtype).removeprefix('torch.')}. "
        "Head k reads the base model's last hidden state and predicts token t+k+1; a tree of their "
        "candidates is verified in one forward pass of the base model.",
        "",
        "## Base model",
        "",
    ]
    identity = heads_config.get("backbone") or heads_config.get("backbone_identity")
    pad = ""
    if backbone:  # Medusa-2: the shipped backbone first, then the one training started from
        tuning = (heads_config.get("training") or {}).get("backbone_tuning", "full")
        merged = ", LoRA adapter merged" if tuning in ("lora", "qlora") else ""
        lines += [
            f"- `{base}`: trained together with the heads (Medusa-2, backbone_tuning `{tuning}`{merged}) and "
            "exported in `backbone/`; the heads match this backbone, not the original",
            "- started from:",
        ]
        pad = "  "
    else:
        lines.append(f"- `{base}`")
    if isinstance(identity, dict):
        lines += [f"{pad}- {key}: `{value}`" for key, value in identity.items()]
    lines += ["", "## Data", ""]
    if manifest:  # the sections of distill/manifest.json a reader wants; all of it if none is there
        picked = {
            key: manifest[key] for key in ("data", "generation", "counts", "created") if key in manifest
        }
        lines += _bullets(picked or manifest)
    else:
        lines.append("- (no distill manifest found: heads trained elsewhere)")
    training = {
        key: v
        for key, v in heads_config.items()
        if key not in MEDUSA_CONFIG_KEYS and key not in ("backbone", "backbone_identity")
    }
    lines += ["", "## Training", ""]
    lines += _bullets(training) if training else ["- (no training settings recorded in config.json)"]
    lines += ["", "## Measured", ""]
    acc = head_accuracy(calibration) if calibration else None
    if acc:
        lines += ["| head | predicts | top-1 | top-5 |", "|---|---|---|---|"]
        lines += [
            f"| {i + 1} | t+{i + 2} | {t1:.3f} | {t5:.3f} |"
            for i, (t1, t5) in enumerate(zip(*acc, strict=True))
        ]
        lines += ["", "Held-out self-distilled data (`calibration.json`)."]
    else:
        lines.append("- head accuracy: not measured (no calibration.json)")
    if report:
        lines += [
            "",
            f"- tau (tokens per verification step, greedy, {report.get('tree_size')}-node tree): **{report.get('tau', 0):.2f}**",
            f"- speed-up over plain greedy `generate`: **{report.get('speedup', 0):.2f}x** "
            f"({report.get('tokens_per_s_medusa', 0):.1f} vs {report.get('tokens_per_s_baseline', 0):.1f} tokens/s, "
            f"{report.get('num_prompts')} prompts, {(report.get('machine') or {}).get('device', 'this machine')})",
            f"- Medusa greedy output identical to plain greedy: {report.get('greedy_identical', 0):.0%} of prompts",
        ]
    else:
        lines.append("- tau / speed-up: run `python -m medusa_train stage=eval` (it updates this card)")
    lines += ["", f"Tree: `{tree_name}`, {tree_size} nodes, in `medusa_choices.json`.", ""]
    lines += _usage(base, k, formats)
    return "\n".join(lines) + "\n"


def _usage(base: str, k: int, formats: list[str]) -> list[str]:
    out = ["## Loading", ""]
    if VLLM in formats:
        out += [
            "**vLLM** (`vllm/`; vLLM's Medusa proposer drafts the top-1 chain, the tree is not used):",
            "",
            "```python",
            "from vllm import LLM",
            f'llm = LLM(model="{base}", speculative_config={{"method": "medusa", "model": "export/vllm", "num_speculative_tokens": {k}}})',
            "```",
            "",
        ]
    if MEDUSA in formats:
        out += [
            "**TGI** (`medusa/`; `base_model_name_or_path` in its config.json must name the base model TGI can load):",
            "",
            "```bash",
            "text-generation-launcher --model-id export/medusa",
            "```",
            "",
            "**TensorRT-LLM** (`medusa/`, see TensorRT-LLM's `examples/medusa`):",
            "",
            "```bash",
            f"python convert_checkpoint.py --model_dir {base} --medusa_model_dir export/medusa --num_medusa_heads {k} --output_dir ckpt",
            "trtllm-build --checkpoint_dir ckpt --speculative_decoding_mode medusa --output_dir engine",
            'python ../run.py --engine_dir engine --medusa_choices="$(cat export/medusa_choices.json)" --temperature 1.0 ...',
            "```",
            "",
            "**FasterDecoding Medusa** (`medusa/`):",
            "",
            "```python",
            "from medusa.model.medusa_model import MedusaModel",
            'model = MedusaModel.from_pretrained("export/medusa")  # loads the base model named in config.json',
            "```",
            "",
            "**medusa_train** (either layout): `python -m medusa_train stage=eval eval.heads_dir=export/medusa`, or",
            "`medusa_train.formats.load_heads(dir)` + `medusa_train.decoding.medusa_generate(model, heads, ids, tree=choices, ...)`.",
            "",
        ]
    return out


def _bullets(d: dict, depth: int = 0) -> list[str]:
    """Scalars and short lists as a bullet list, nested dicts indented; long lists summarised, nulls left out."""
    out = []
    for key, value in d.items():
        if value is None or value == {}:
            continue
        pad = "  " * depth
        if isinstance(value, dict):
            out.append(f"{pad}- {key}:")
            out += _bullets(value, depth + 1)
        elif isinstance(value, list) and len(value) > 8:
            out.append(f"{pad}- {key}: ({len(value)} entries)")
        else:
            out.append(f"{pad}- {key}: `{value}`")
    return out


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _replace_dir(new: Path, target: Path) -> None:
    """Rename ``new`` onto ``target``; an existing ``target`` is moved aside first, then deleted."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}-old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
