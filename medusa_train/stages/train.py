"""`stage=train`: Medusa heads (Medusa-1, frozen backbone) or heads + backbone (Medusa-2).

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774).

Run as:
    python -m medusa_train stage=train                                          # one process (CPU or 1 GPU)
    deepspeed --num_gpus 2 --module medusa_train stage=train deepspeed=zero2    # DeepSpeed launcher, N processes
    torchrun --nproc_per_node 2 -m medusa_train stage=train [deepspeed=zero2]   # torchrun: DDP, or DeepSpeed
(the deepspeed launcher spells "run a module" ``--module``, not ``-m``). Re-running the same command
resumes from the last checkpoint in workdir/train; a finished run with the same settings is skipped.

Steps:
    1. Read the distilled data (workdir/distill) and check it was made by this backbone.
    2. Skip if workdir/heads already holds heads trained and calibrated with the same settings
       (unless overwrite); if only the calibration settings differ (`tree.max_nodes`, `tree.topk`,
       `tree.latency_context`, `training.calibration_max_records`), go to 5 with the published heads.
    3. Build the heads (lm_head init) and the training module; optionally cache hidden states.
    4. Train with the Hugging Face Trainer (DeepSpeed per `deepspeed=`), checkpointing to
       workdir/train and resuming from its last checkpoint automatically.
    5. Rank 0: held-out top-1..10 accuracy per head -> calibration.json; grow trees, time tree
       forwards on this machine, choose the size with the best expected tokens/s -> medusa_choices.json;
       write everything to workdir/heads atomically (medusa2 also writes the trained backbone, or
       only its LoRA adapter, to workdir/heads/backbone).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from medusa_train.backbone import ADAPTER_CONFIG
from medusa_train.errors import UserError
from medusa_train.heads import CONFIG_NAME, WEIGHTS_NAME, HeadsFormatError, MedusaHeads
from medusa_train.stages import TRAINED_BACKBONE
from medusa_train.tracking import start_tracking
from medusa_train.workdir import Workdir, require

log = logging.getLogger(__name__)

CALIBRATION = "calibration.json"
CHOICES = "medusa_choices.json"
RUN_INFO = "run.json"
CACHE_DIR = "hidden_cache"


# -- helpers ----------------------------------------------------------------------------------------
def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_settings(cfg, identity: dict, manifest: dict) -> dict:
    """Everything that changes the trained heads: compared to skip finished work and to resume safely."""
    tc = cfg.training
    keys = (
        "mode",
        "num_heads",
        "num_layers",
        "init_from_lm_head",
        "decay",
        "lr",
        "weight_decay",
        "warmup_ratio",
        "lr_scheduler",
        "num_epochs",
        "max_steps",
        "max_seq_len",
        "seed",
        "init_heads",
        "head_lr_multiplier",
        "lambda0",
        "lambda_warmup",
        "lambda_warmup_steps",
        "lm_loss",
        "heads_only_steps",
        "backbone_tuning",
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
    )
    settings = {k: getattr(tc, k) for k in keys}
    settings["lora_target_modules"] = list(settings["lora_target_modules"])
    settings["model_dtype"] = cfg.model.dtype
    settings["model_quantization"] = cfg.model.quantization
    settings["global_batch_size"] = tc.per_device_batch_size * tc.gradient_accumulation_steps * _world_size()
    settings["eval_fraction"] = cfg.data.eval_fraction
    settings["backbone_fingerprint"] = identity["fingerprint"]
    # What the distilled data is (its settings and counts), not when or how fast it was written: a
    # distill run that only rewrote the manifest must not force a retrain.
    content = {
        "settings": manifest.get("settings"),
        "counts": manifest.get("counts"),
        "backbone": manifest.get("backbone"),
    }
    settings["distill"] = hashlib.sha256(
        json.dumps(content, sort_keys=True, default=str).encode()
    ).hexdigest()[:16]
    return settings


def calibration_settings(cfg) -> dict:
    """Everything the tree calibration after training depends on, besides the trained model itself.

    Stored in calibration.json: a change re-runs only the calibration (the heads stay as trained).
    """
    return {
        "calibration_max_records": cfg.training.calibration_max_records,
        "tree_max_nodes": cfg.tree.max_nodes,
        "tree_topk": cfg.tree.topk,
        "tree_latency_context": cfg.tree.latency_context,
    }


def _truncate(record: dict, max_len: int) -> dict:
    return {
        "input_ids": list(record["input_ids"][:max_len]),
        "loss_mask": list(record["loss_mask"][:max_len]),
    }


def _trained_positions(loss_mask: list[int]) -> int:
    """Tokens that can be a head target (head 1 needs t+2 >= 2, i.e. index >= 2)."""
    return sum(loss_mask[2:])


class _Records(torch.utils.data.Dataset):
    """Truncated ``input_ids``/``loss_mask`` records of a distilled split, read lazily."""

    def __init__(self, ds, indices: list[int], max_len: int) -> None:
        self.ds, self.indices, self.max_len = ds, indices, max_len

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        return _truncate(self.ds[self.indices[i]], self.max_len)


def _usable_indices(ds, max_len: int) -> list[int]:
    """Records with at least one head target inside the truncation window."""
    return [i for i, m in enumerate(ds["loss_mask"]) if _trained_positions(m[:max_len]) > 0]


def heads_complete(heads_dir: Path, settings: dict) -> dict | None:
    """The stored training result if ``heads_dir`` is complete and was trained with ``settings``."""
    cfg_path = heads_dir / CONFIG_NAME
    if not (cfg_path.is_file() and (heads_dir / WEIGHTS_NAME).is_file() and (heads_dir / CHOICES).is_file()):
        return None
    if settings["mode"] == "medusa2":  # the trained backbone: the model, or (LoRA/QLoRA) its adapter
        lora = settings["backbone_tuning"] in ("lora", "qlora")
        if not (heads_dir / TRAINED_BACKBONE / (ADAPTER_CONFIG if lora else CONFIG_NAME)).is_file():
            return None
    meta = json.loads(cfg_path.read_text())
    return meta.get("training_result") if meta.get("training") == settings else None


def calibrated_with(heads_dir: Path) -> dict | None:
    """The calibration settings stored in ``heads_dir/calibration.json`` (None: none recorded)."""
    try:
        return json.loads((heads_dir / CALIBRATION).read_text()).get("settings")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def _check_resume(train_dir: Path, info: dict, overwrite: bool) -> None:
    """Refuse to resume checkpoints of another backbone / other settings (or wipe them with overwrite)."""
    path = train_dir / RUN_INFO
    if train_dir.exists() and overwrite and _rank() == 0:
        shutil.rmtree(train_dir)
    if path.is_file() and not overwrite:
        old = json.loads(path.read_text())
        if old != info:
            diff = sorted(
                k
                for k in set(old["settings"]) | set(info["settings"])
                if old["settings"].get(k) != info["settings"].get(k)
            )
            raise UserError(
                f"{train_dir} holds checkpoints of another run (differs in: {', '.join(diff[:5])}): "
                "delete it or pass training.overwrite=true"
            )


def _load_init_heads(
    path: str, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int
) -> MedusaHeads:
    try:
        heads = MedusaHeads.from_pretrained(path)
    except HeadsFormatError as err:
        raise UserError(f"training.init_heads: {err}") from None
    got = (heads.hidden_size, heads.vocab_size, heads.num_heads, heads.num_layers)
    want = (hidden_size, vocab_size, num_heads, num_layers)
    if got != want:
        raise UserError(
            f"training.init_heads={path} has (hidden, vocab, heads, layers)={got} but this backbone/config needs {want}: "
            "those heads belong to another backbone or setting"
        )
    return heads


# -- calibration ------------------------------------------------------------------------------------
@torch.no_grad()
def heldout_topk_accuracy(
    backbone,
    heads: MedusaHeads,
    records: list[dict],
    max_k: int = 10,
    batch_size: int = 8,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head cumulative top-1..max_k accuracy on records (same targets as training).

    Returns:
        ``(acc (K, max_k), count (K,))``.
    """
    from medusa_train.training.losses import chunked_topk_correct, medusa_targets, select_trained_rows
    from medusa_train.training.model import last_hidden_state
    from medusa_train.training.trainer import PadCollator

    device = heads.proj(0).weight.device
    collate = PadCollator(0)
    hits = torch.zeros(heads.num_heads, max_k, dtype=torch.long)
    count = torch.zeros(heads.num_heads, dtype=torch.long)
    for start in range(0, len(records), batch_size):
        batch = {k: v.to(device) for k, v in collate(records[start : start + batch_size]).items()}
        h = last_hidden_state(backbone, batch["input_ids"], batch["attention_mask"])  # (B, T, d)
        tgt = medusa_targets(batch["input_ids"], batch["loss_mask"], batch["attention_mask"], heads.num_heads)
        rows, row_t = select_trained_rows(h, tgt)  # (N, d), (N, K)
        feats = heads.hidden(rows.to(heads.proj(0).weight.dtype))  # (K, N, d)
        for k in range(heads.num_heads):
            hits[k] += chunked_topk_correct(
                feats[k], heads.proj(k).weight, row_t[:, k], max_k, chunk_size
            ).cpu()
            count[k] += int((row_t[:, k] != -100).sum())
    return hits.float() / count.clamp_min(1)[:, None].float(), count


def calibrate_tree(backbone, acc: torch.Tensor, max_nodes: int, topk: int, context_len: int) -> dict:
    """Grow Medusa trees from the accuracy table and choose the size with the best expected tokens/s."""
    from medusa_train.decoding import calibrate
    from medusa_train.decoding.generate import context_limit

    per_rank = calibrate.per_rank_accuracy(acc[:, :topk])  # (K, topk)
    trees, taus = calibrate.grow_tree(per_rank, max_nodes)
    n_max = len(trees)
    sizes = sorted(
        {n + 1 for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if n <= n_max}
        | {n_max + 1}
    )
    limit = context_limit(backbone)
    if limit is not None:
        context_len = max(0, min(context_len, limit - max(sizes)))
    latency = calibrate.measure_forward_latency(backbone, sizes, context_len)
    choices, table = calibrate.choose_tree(trees, taus, latency)
    best = next(row for row in table if row["nodes"] == len(choices))
    return {"choices": choices, "table": table, "latency": latency, "context_len": context_len, "best": best}


def _link_heads(src: Path, dst: Path, skip: tuple[str, ...]) -> None:
    """Hard-link (copy where links are refused) every file of ``src`` into a new ``dst``, except the
    top-level ``skip`` names: a recalibrated heads folder shares the unchanged (large) weight files."""

    def link(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    shutil.copytree(
        src,
        dst,
        ignore=lambda folder, names: [n for n in names if Path(folder) == src and n in skip],
        copy_function=link,
    )


def _publish(tmp_dir: Path, final_dir: Path) -> None:
    """Replace ``final_dir`` by ``tmp_dir`` with renames only (never a half-written heads folder)."""
    trash = final_dir.with_name(f".{final_dir.name}.old-{os.getpid()}")
    if final_dir.exists():
        os.replace(final_dir, trash)
    os.replace(tmp_dir, final_dir)
    if trash.exists():
        shutil.rmtree(trash)


# -- the stage --------------------------------------------------------------------------------------
def run(cfg) -> dict:
    """Train heads; write workdir/heads (+ calibration.json, medusa_choices.json). Returns the figures."""
    from medusa_train.backbone import backbone_identity, check_backbone_source, resolve_device
    from medusa_train.data.distilled import load_distilled, read_manifest, split_heldout
    from medusa_train.stages import load_configured_backbone, load_trained_backbone
    from medusa_train.training.trainer import deepspeed_config

    tc, wd = cfg.training, Workdir(Path(cfg.workdir))
    start_time = time.time()

    # 1. Inputs exist; DeepSpeed can start (before any heavy work).
    require(wd.distill, "distilled data", "distill")
    manifest = read_manifest(wd.distill)
    check_backbone_source(cfg.model.name_or_path)
    device = resolve_device(cfg.model.device)
    on_cpu = device.type == "cpu"
    model_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.model.dtype, torch.float32)
    ds_config = None
    if cfg.deepspeed.enabled:
        ds_config = deepspeed_config(
            cfg.deepspeed.zero_stage,
            offload_optimizer=cfg.deepspeed.offload_optimizer,
            offload_param=cfg.deepspeed.offload_param,
            # Medusa-1 trains fp32 heads on (cast) hidden states of the frozen backbone, whatever its
            # dtype; mixed precision is for the trainable backbone of Medusa-2 only. This must agree
            # with TrainingArguments(bf16=/fp16=) below, or transformers refuses the DeepSpeed config.
            dtype=model_dtype if tc.mode == "medusa2" else torch.float32,
            on_cpu=on_cpu,
        )
    if tc.mode == "medusa2":
        from medusa_train.training import medusa2

        medusa2.check_supported(cfg)

    # 2. Backbone; the distilled data must come from it.
    backbone, tokenizer = load_configured_backbone(cfg.model, device, trainable=tc.mode == "medusa2")
    identity = backbone_identity(backbone, cfg.model.name_or_path, cfg.model.revision)
    made_by = manifest.get("backbone", {})
    if made_by.get("fingerprint") != identity["fingerprint"]:
        raise UserError(
            f"{wd.distill} was distilled from another backbone ({made_by.get('name_or_path')}, fingerprint "
            f"{made_by.get('fingerprint')}) than {cfg.model.name_or_path} (fingerprint {identity['fingerprint']}): "
            "run stage=distill with this model (distill.overwrite=true) or use the matching model"
        )
    settings, calibration_keys = run_settings(cfg, identity, manifest), calibration_settings(cfg)
    done = None if tc.overwrite else heads_complete(wd.heads, settings)
    if done is not None:
        stored = calibrated_with(wd.heads)
        if stored == calibration_keys:
            log.info(
                "heads in %s are complete for these settings: skipping (training.overwrite=true retrains)",
                wd.heads,
            )
            return {**done, "skipped": True}
        changed = sorted(k for k in calibration_keys if (stored or {}).get(k) != calibration_keys[k])
        log.info(
            "heads in %s are trained with these settings but their tree was calibrated with other ones "
            "(differs in: %s): re-running the calibration only (training.overwrite=true retrains)",
            wd.heads,
            ", ".join(changed),
        )

    # 3. Data.
    ds = load_distilled(wd.distill)
    train_ds, held_ds = split_heldout(ds, cfg.data.eval_fraction)
    train_idx = _usable_indices(train_ds, tc.max_seq_len) if len(train_ds) else []
    if not train_idx:
        raise UserError(
            f"no training data: {len(ds)} distilled records, {len(train_ds)} after holding out "
            f"data.eval_fraction={cfg.data.eval_fraction}, none with a loss-masked token inside training.max_seq_len="
            f"{tc.max_seq_len}: lower data.eval_fraction or distill more data"
        )
    train_set = _Records(train_ds, train_idx, tc.max_seq_len)

    if done is None:
        # 4. Heads, the training module, training (all ranks).
        result, heads, trained = _train_heads(
            cfg, backbone, tokenizer, identity, settings, train_set, ds_config, device, model_dtype
        )
        if result is None:  # not rank 0
            return {"rank": _rank()}
        if trained is not None:  # medusa2: calibrate with the backbone as trained (LoRA: adapters applied)
            backbone = trained if tc.backbone_tuning == "full" else trained.get_base_model()
    else:
        # 4. Calibration settings changed only: the published heads (and Medusa-2 backbone) as they are.
        if _rank() != 0:
            return {"rank": _rank()}
        result, trained = dict(done), None
        heads = MedusaHeads.from_pretrained(wd.heads, device=device)
        if tc.mode == "medusa2":  # the trained backbone replaces the base loaded above (LoRA: merged into it)
            base = None if tc.backbone_tuning == "full" else backbone
            backbone = None  # full tuning: the base goes before the trained copy loads
            backbone = load_trained_backbone(cfg.model, wd.heads / TRAINED_BACKBONE, device, base=base)

    # 5. Rank 0: calibration + publish.
    heads.eval()
    held_idx = _usable_indices(held_ds, tc.max_seq_len) if len(held_ds) else []
    if held_idx:
        calib_set, calib_name = _Records(held_ds, held_idx, tc.max_seq_len), "heldout"
    else:
        log.warning(
            "no held-out records (data.eval_fraction=%s): calibrating on training records",
            cfg.data.eval_fraction,
        )
        calib_set, calib_name = train_set, "train"
    records = [calib_set[i] for i in range(min(len(calib_set), tc.calibration_max_records))]
    # medusa2 trained the backbone (LoRA layers injected into the base in place) and left it in
    # training mode: no dropout (LoRA's included) while measuring.
    backbone.eval()
    acc, count = heldout_topk_accuracy(
        backbone, heads, records, 10, tc.per_device_batch_size, tc.loss_chunk_size
    )
    tree = calibrate_tree(backbone, acc, cfg.tree.max_nodes, cfg.tree.topk, cfg.tree.latency_context)

    result.update(
        {
            "heldout_top1": [round(float(a), 4) for a in acc[:, 0]],
            "heldout_top5": [round(float(a), 4) for a in acc[:, 4]],
            "calibration_split": calib_name,
            "tree_size": len(tree["choices"]),
            "expected_tau": round(tree["best"]["expected_tau"], 4),
            "seconds": round(time.time() - start_time, 1),
        }
    )
    calibration = {
        "settings": calibration_keys,
        "split": calib_name,
        "records": len(records),
        "count": count.tolist(),
        "head_topk_accuracy": [[round(float(x), 6) for x in row] for row in acc],
        "tree": {k: tree[k] for k in ("table", "context_len", "best")},
        "latency": {str(n): v for n, v in tree["latency"].items()},
    }
    from medusa_train.decoding.tree import save_choices

    tmp = wd.root / f".heads.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    if done is None:
        # config.json: FasterDecoding keys + backbone identity (checked by later stages) + settings + figures.
        heads.save_pretrained(
            tmp, extra_config={"backbone": identity, "training": settings, "training_result": result}
        )
        if trained is not None:  # medusa2: ship the trained backbone (LoRA: the adapter only) with the heads
            trained.save_pretrained(tmp / TRAINED_BACKBONE)
            tokenizer.save_pretrained(tmp / TRAINED_BACKBONE)
    else:  # recalibrated: the same weights (hard links), new figures
        _link_heads(wd.heads, tmp, skip=(CONFIG_NAME, CALIBRATION, CHOICES))
        meta = json.loads((wd.heads / CONFIG_NAME).read_text())
        (tmp / CONFIG_NAME).write_text(json.dumps({**meta, "training_result": result}, indent=2) + "\n")
    save_choices(tmp / CHOICES, tree["choices"])
    (tmp / CALIBRATION).write_text(json.dumps(calibration, indent=2) + "\n")
    _publish(tmp, wd.heads)
    _print_summary(result)
    return result if done is None else {**result, "skipped": True, "recalibrated": True}


def _train_heads(cfg, backbone, tokenizer, identity, settings, train_set, ds_config, device, model_dtype):
    """Step 4: fresh (or ``init_heads``) heads, the resume check, the Trainer run (all ranks).

    Returns:
        ``(figures, trained heads, trained Medusa-2 backbone or None)`` on rank 0, ``(None, None, None)``
        elsewhere. The Medusa-2 backbone is the module that trained: a peft model with LoRA/QLoRA
        (``save_pretrained`` then writes the adapter only); after ZeRO-3 a fresh copy of it holding the
        consolidated weights.
    """
    tc, wd = cfg.training, Workdir(Path(cfg.workdir))
    d, vocab = identity["hidden_size"], identity["vocab_size"]
    if tc.init_heads:
        heads = _load_init_heads(tc.init_heads, d, vocab, tc.num_heads, tc.num_layers)
        heads.base_model_name_or_path = cfg.model.name_or_path
    else:
        torch.manual_seed(tc.seed)
        heads = MedusaHeads(
            d, vocab, tc.num_heads, tc.num_layers, base_model_name_or_path=cfg.model.name_or_path
        )
        if tc.init_from_lm_head:
            heads.init_from_lm_head(backbone.get_output_embeddings().weight.detach().float())
    heads.to(device)

    info = {"settings": settings, "backbone": identity}
    _check_resume(wd.train, info, tc.overwrite)
    wd.train.mkdir(parents=True, exist_ok=True)

    # DeepSpeed runs leave process-wide state behind (TrainingArguments exports
    # ACCELERATE_USE_DEEPSPEED, transformers keeps the config in a module global, and a 1-process
    # group may be ours): restore all of it after training so later stages in this process
    # (stage=all) and library users get plain from_pretrained / Trainer behaviour back.
    saved_env = {k: os.environ.get(k) for k in _PROCESS_ENV}
    own_group = ds_config is not None and "WORLD_SIZE" not in os.environ
    try:
        result, heads, trained = _train(
            cfg, backbone, tokenizer, heads, train_set, ds_config, info, device, model_dtype
        )
    finally:
        if ds_config is not None:
            _release_deepspeed(saved_env, own_group)
    if isinstance(trained, dict):
        # ZeRO-3 left the module that trained partitioned; rank 0 got its consolidated weights. Load
        # them into a fresh copy, now that from_pretrained no longer partitions what it loads.
        trained = _backbone_from_state(cfg, trained, device)
    return result, heads, trained


def _train(cfg, backbone, tokenizer, heads, train_set, ds_config, info, device, model_dtype):
    """Step 4: the Trainer run (all ranks).

    Returns:
        ``(figures, trained heads, trained Medusa-2 backbone or None)`` on rank 0, ``(None, None, None)``
        elsewhere. The Medusa-2 backbone is the module that trained, or under ZeRO-3 its consolidated
        state dict (the module stays partitioned).
    """
    from transformers import TrainingArguments

    from medusa_train.training.model import MedusaTrainingModel
    from medusa_train.training.trainer import (
        MedusaTrainer,
        MetricsScheduleCallback,
        PadCollator,
        TimeBudgetCallback,
        TrackerCallback,
        row_collator,
    )

    tc, wd = cfg.training, Workdir(Path(cfg.workdir))
    on_cpu = device.type == "cpu"
    if ds_config is not None and "WORLD_SIZE" not in os.environ:
        _single_process_rendezvous()  # DeepSpeed without a launcher would otherwise look for MPI
    args = TrainingArguments(
        output_dir=str(wd.train),
        per_device_train_batch_size=tc.per_device_batch_size,
        gradient_accumulation_steps=tc.gradient_accumulation_steps,
        learning_rate=tc.lr,
        weight_decay=tc.weight_decay,
        warmup_steps=tc.warmup_ratio,  # a float < 1 is a ratio of the total steps
        lr_scheduler_type=tc.lr_scheduler,
        num_train_epochs=tc.num_epochs,
        max_steps=tc.max_steps,
        logging_steps=tc.logging_steps,
        save_steps=tc.save_steps,
        save_total_limit=tc.save_total_limit,
        save_only_model=False,
        seed=tc.seed,
        use_cpu=on_cpu,
        ddp_backend="gloo" if on_cpu and _world_size() > 1 else None,
        deepspeed=ds_config,
        bf16=not on_cpu and tc.mode == "medusa2" and model_dtype == torch.bfloat16,
        fp16=not on_cpu and tc.mode == "medusa2" and model_dtype == torch.float16,
        report_to="none",  # our TrackerCallback logs to wandb with an explicit mode (see trainer.py)
        run_name=cfg.tracking.run_name or f"train-{wd.root.resolve().name}",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=False,
        eval_strategy="no",
    )
    if args.process_index == 0:
        (wd.train / RUN_INFO).write_text(json.dumps(info, indent=2) + "\n")

    model_kwargs = {"decay": tc.decay, "chunk_size": tc.loss_chunk_size}
    callbacks = []
    extra: dict = {}
    if tc.mode == "medusa2":
        from medusa_train.training import medusa2

        model, callbacks, extra = medusa2.build(cfg, backbone, heads, model_kwargs)
        collator = PadCollator(tokenizer.pad_token_id or 0)
        dataset = train_set
    elif tc.cache_hidden_states:
        from medusa_train.training.hidden_cache import HiddenCache, build_hidden_cache

        keys = ("backbone_fingerprint", "distill", "eval_fraction", "max_seq_len", "num_heads")
        cache_settings = {**{k: info["settings"][k] for k in keys}, "cache_version": 1}
        with args.main_process_first(desc="hidden-state cache"):
            if args.process_index == 0:
                t0 = time.time()
                records = [train_set[i] for i in range(len(train_set))]
                build_hidden_cache(
                    backbone,
                    records,
                    wd.train / CACHE_DIR,
                    tc.num_heads,
                    cache_settings,
                    tc.per_device_batch_size,
                )
                log.info("hidden-state cache ready in %.1fs", time.time() - t0)
        dataset = HiddenCache(wd.train / CACHE_DIR)
        collator = row_collator
        model = MedusaTrainingModel(heads, None, **model_kwargs)
    else:
        model = MedusaTrainingModel(heads, backbone, **model_kwargs)
        collator = PadCollator(tokenizer.pad_token_id or 0)
        dataset = train_set
    callbacks.append(MetricsScheduleCallback())
    tracker = start_tracking(cfg.tracking, wd.root, "train", config={"training": asdict(tc), "run": info})
    callbacks.append(TrackerCallback(tracker))
    if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3:
        # The fused loss reads each head's (V, d) projection weight directly instead of calling the
        # Linear: tell ZeRO-3 to gather those weights whenever the training module runs.
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter

        for k in range(heads.num_heads):
            register_external_parameter(model, heads.proj(k).weight)
        if tc.mode == "medusa2":  # the LM loss reads lm_head's weight the same way
            register_external_parameter(model, model.backbone.get_output_embeddings().weight)
    budget = TimeBudgetCallback(tc.max_minutes) if tc.max_minutes else None
    if budget:
        callbacks.append(budget)
    trainer = MedusaTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=collator,
        callbacks=callbacks,
        head_lr_multiplier=tc.head_lr_multiplier if tc.mode == "medusa2" else 1.0,
    )
    last = last_complete_checkpoint(wd.train, remove_incomplete=args.process_index == 0)
    if last:
        log.info("resuming from %s", last)
    t0 = time.time()
    try:
        out = trainer.train(resume_from_checkpoint=last)
    finally:
        tracker.finish()
    train_seconds = time.time() - t0
    trained = model.backbone if tc.mode == "medusa2" else None
    if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3:
        heads, trained = _gather_zero3(trainer, heads, medusa2=tc.mode == "medusa2")  # collective
    if not trainer.is_world_process_zero():
        return None, None, None
    hist = trainer.head_history
    final = hist[-1] if hist else {}
    k_heads = tc.num_heads
    trained_rows = int(dataset.offsets[-1]) if tc.cache_hidden_states and tc.mode == "medusa1" else None
    result = {
        "mode": tc.mode,
        "steps": trainer.state.global_step,
        "final_loss": round(float(final.get("loss", out.training_loss)), 5),
        "train_top1": [final.get(f"head{k + 1}/top1") for k in range(k_heads)],
        "train_top5": [final.get(f"head{k + 1}/top5") for k in range(k_heads)],
        "train_seconds": round(train_seconds, 1),
        "stopped_by_time_budget": bool(budget and budget.stopped_early),
        "resumed_from": last,
        "samples_per_s": out.metrics.get("train_samples_per_second"),
    }
    if trained_rows is not None:
        result["trained_rows_per_epoch"] = trained_rows
    tokens = _count_tokens(train_set) * max(out.metrics.get("epoch", 0.0) or 0.0, 0.0)
    if last:  # resumed: train_runtime covers only this run's steps, so count only their tokens
        done_before = int(Path(last).name.split("-")[1])
        tokens *= max(trainer.state.global_step - done_before, 0) / max(trainer.state.global_step, 1)
    result["tokens_per_s"] = round(tokens / max(out.metrics.get("train_runtime", train_seconds), 1e-9), 1)
    result.update(extra)
    return result, heads, trained


def _gather_zero3(trainer, heads: MedusaHeads, medusa2: bool) -> tuple[MedusaHeads, dict | None]:
    """ZeRO-3 leaves the module partitioned across ranks: rebuild whole heads from the consolidated
    state, and (medusa2) return the backbone's part of it (its own parameter names). Every rank
    must call this; the results are rank 0's (the others get their inputs back)."""
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # full tensors on rank 0 only
    if not trainer.is_world_process_zero():
        return heads, None
    whole = MedusaHeads(
        heads.hidden_size, heads.vocab_size, heads.num_heads, heads.num_layers, heads.base_model_name_or_path
    )
    prefix = "module." if any(k.startswith("module.heads.") for k in state) else ""
    whole.heads.load_state_dict(
        {
            k.removeprefix(f"{prefix}heads.heads."): v.float()
            for k, v in state.items()
            if k.startswith(f"{prefix}heads.heads.")
        }
    )
    backbone_state = None
    if medusa2:
        start = f"{prefix}backbone."
        backbone_state = {k.removeprefix(start): v for k, v in state.items() if k.startswith(start)}
    return whole.to(trainer.args.device), backbone_state


def _backbone_from_state(cfg, state: dict[str, torch.Tensor], device) -> torch.nn.Module:
    """The Medusa-2 backbone as it trained (LoRA: the same peft wrapping), from the base checkpoint
    loaded again and the trained weights ``state`` (all of them, adapters and frozen base alike)."""
    from medusa_train.stages import load_configured_backbone
    from medusa_train.training import medusa2

    base, _ = load_configured_backbone(cfg.model, device, trainable=True)
    backbone = medusa2.trainable_backbone(cfg.training, base)
    backbone.load_state_dict(state)
    return backbone


def last_complete_checkpoint(train_dir: Path, remove_incomplete: bool = False) -> str | None:
    """The newest ``checkpoint-N`` whose save finished (the Trainer writes trainer_state.json last).

    A run killed while saving leaves a newer, incomplete folder: it is skipped (and removed when
    ``remove_incomplete``), so the same command resumes from the previous checkpoint.
    """
    found = sorted(
        (int(p.name.split("-")[1]), p)
        for p in train_dir.glob("checkpoint-*")
        if p.is_dir() and p.name.split("-")[1].isdigit()
    )
    for _, path in reversed(found):
        if (path / "trainer_state.json").is_file():
            return str(path)
        log.warning("ignoring incomplete checkpoint %s (killed while saving)", path)
        if remove_incomplete:
            shutil.rmtree(path, ignore_errors=True)
    return None


_PROCESS_ENV = ("ACCELERATE_USE_DEEPSPEED", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _release_deepspeed(saved_env: dict[str, str | None], own_group: bool) -> None:
    """Undo the process-wide state a DeepSpeed run leaves (see the comment where it is saved)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    for key, value in saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if own_group:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
        import deepspeed.comm

        if deepspeed.comm.is_initialized():
            # DeepSpeed's own teardown: it also forgets the groups it derived from this one, which a
            # second DeepSpeed run in this process would otherwise use ("group is not registered").
            deepspeed.comm.destroy_process_group()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _single_process_rendezvous() -> None:
    """Environment of a 1-process group, so DeepSpeed starts without a launcher."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(port))


def _count_tokens(train_set: _Records) -> int:
    return sum(min(len(r), train_set.max_len) for r in train_set.ds.select(train_set.indices)["input_ids"])


def _print_summary(result: dict) -> None:
    lines = [
        f"train: {result['steps']} steps, final loss {result['final_loss']}, {result['tokens_per_s']} tokens/s"
    ]
    for k, (t1, t5) in enumerate(zip(result["heldout_top1"], result["heldout_top5"], strict=True)):
        lines.append(f"  head {k + 1}: held-out top-1 {t1:.3f}  top-5 {t5:.3f}")
    lines.append(f"  tree: {result['tree_size']} nodes, expected tau {result['expected_tau']}")
    print("\n".join(lines), flush=True)
