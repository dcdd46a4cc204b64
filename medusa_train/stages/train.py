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
    1. Read the distilled data's manifest (workdir/distill); check the recipe's settings and DeepSpeed.
    2. Load the backbone; the distilled data must have been made by it.
    3. Skip if workdir/heads already holds heads trained and calibrated with the same settings
       (unless overwrite); if only the calibration's settings differ (`tree.max_nodes`, `tree.topk`,
       `tree.latency_context`, `training.calibration_max_records`), calibrate the published heads again.
    4. Data: the training split and the held-out records the calibration measures on;
       `training.head_projection=truncated`: the draft vocabulary (token_map), the
       `training.draft_vocab_size` most frequent target tokens of the training split.
    5. Train with the Hugging Face Trainer (DeepSpeed per `deepspeed=`), checkpointing to
       workdir/train and resuming from its last checkpoint automatically (all ranks).
    6. Rank 0: held-out top-1..10 accuracy per head; grow trees, time tree forwards on this machine,
       choose the size with the best expected tokens/s (``decoding/calibrate.py``).
    7. Rank 0: publish workdir/heads atomically: heads, calibration.json, medusa_choices.json
       (Medusa-2 also the trained backbone, or only its LoRA adapter, in workdir/heads/backbone).

Medusa-1 and Medusa-2 differ in which parameters train and in the loss; both come from the recipe
of ``training.mode`` (``training/recipes.py``), so this file has no mode branches.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from transformers import TrainingArguments

from medusa_train import dist
from medusa_train.backbone import (
    DTYPES,
    backbone_identity,
    check_backbone_source,
    identity_content,
    load_configured_backbone,
    resolve_device,
    resolve_dtype,
)
from medusa_train.data.distilled import data_key, load_distilled, read_manifest, split_heldout
from medusa_train.decoding.calibrate import calibrate
from medusa_train.decoding.tree import save_choices
from medusa_train.errors import DamagedArtefactError, UserError
from medusa_train.formats import save_tokenizer
from medusa_train.heads import HeadsFormatError, MedusaHeads, draft_token_map, safetensors_shapes
from medusa_train.tracking import start_tracking
from medusa_train.training.hidden_cache import HiddenCache, build_hidden_cache
from medusa_train.training.recipes import Recipe, recipe_for
from medusa_train.training.trainer import (
    MedusaTrainer,
    MetricsScheduleCallback,
    PadCollator,
    TimeBudgetCallback,
    TrackerCallback,
    last_complete_checkpoint,
    refused_pickle,
    row_collator,
)
from medusa_train.training.zero import (
    deepspeed_config,
    deepspeed_process,
    gather_zero3,
    is_zero3,
    register_gathered,
)
from medusa_train.workdir import (
    CALIBRATION,
    CHOICES,
    HEADS_CONFIG,
    HEADS_WEIGHTS,
    HIDDEN_CACHE,
    RUN_INFO,
    TRAINED_BACKBONE,
    Workdir,
    atomic_write_json,
    describe_diff,
    file_sha256,
    publish_dir,
    read_json,
    remove_stale,
    require,
    settings_key,
    staging_dir,
)

log = logging.getLogger(__name__)

HIDDEN_CACHE_VERSION = 2
"""Layout version of the hidden-state cache, part of its key (2: keyed by the whole run key)."""


# -- the stage --------------------------------------------------------------------------------------
def run(cfg) -> dict:
    """Train heads; write workdir/heads (+ calibration.json, medusa_choices.json). Returns the figures."""
    tc, wd = cfg.training, Workdir(Path(cfg.workdir))
    recipe = recipe_for(cfg)  # Medusa-1 | Medusa-2: which parameters train, and the loss
    start_time = time.time()

    # 1. Inputs exist; the recipe's settings and DeepSpeed can run (before any heavy work).
    require(wd.distill, "distilled data", "distill")
    manifest = read_manifest(wd.distill)
    check_backbone_source(cfg.model.name_or_path)
    device = resolve_device(cfg.model.device)
    precision = recipe.precision(DTYPES[resolve_dtype(cfg.model.dtype, device)])
    recipe.check()
    ds_config = None
    if cfg.deepspeed.enabled:
        ds_config = deepspeed_config(
            cfg.deepspeed.zero_stage,
            offload_optimizer=cfg.deepspeed.offload_optimizer,
            offload_param=cfg.deepspeed.offload_param,
            dtype=precision,  # must agree with TrainingArguments(bf16=/fp16=), or transformers refuses it
            on_cpu=device.type == "cpu",
        )

    # 2. Backbone; the distilled data must come from it.
    backbone, tokenizer = load_configured_backbone(cfg.model, device, trainable=recipe.trains_backbone)
    identity = backbone_identity(backbone, cfg.model.name_or_path, cfg.model.revision)
    made_by = manifest.get("backbone", {})
    if made_by.get("fingerprint") != identity["fingerprint"]:
        raise UserError(
            f"{wd.distill} was distilled from another backbone ({made_by.get('name_or_path')}, fingerprint "
            f"{made_by.get('fingerprint')}) than {cfg.model.name_or_path} (fingerprint {identity['fingerprint']}): "
            "run stage=distill with this model (distill.overwrite=true) or use the matching model"
        )

    # 3. Skip finished heads, or re-run only their calibration.
    key, calibration_settings = run_key(cfg, identity, manifest), calibration_key(cfg)
    if dist.is_main():
        remove_stale(wd.heads)  # a run killed while publishing them: the previous heads come back
        remove_stale(wd.train)  # temp files of writes a kill interrupted (run.json, the hidden cache)
    done = None if tc.overwrite else trained_with(wd.heads, key, recipe)
    if done is not None:
        stored = calibrated_with(wd.heads)
        if stored == calibration_settings:
            log.info(
                "heads in %s are complete for these settings: skipping (training.overwrite=true retrains)",
                wd.heads,
            )
            return {**done, "skipped": True}
        log.info(
            "heads in %s are trained with these settings but their tree was calibrated with other ones "
            "(%s): re-running the calibration only (training.overwrite=true retrains)",
            wd.heads,
            describe_diff(stored, calibration_settings) if stored else f"{CALIBRATION} missing or damaged",
        )

    # 4. Data: the training split and the records the calibration measures on.
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
    held_idx = _usable_indices(held_ds, tc.max_seq_len) if len(held_ds) else []
    if held_idx:
        calib_set, calib_split = _Records(held_ds, held_idx, tc.max_seq_len), "heldout"
    else:
        log.warning(
            "no held-out records (data.eval_fraction=%s): calibrating on training records",
            cfg.data.eval_fraction,
        )
        calib_set, calib_split = train_set, "train"
    calib_records = [calib_set[i] for i in range(min(len(calib_set), tc.calibration_max_records))]
    token_map, coverage = None, None
    if tc.head_projection == "truncated" and done is None:
        vocab = identity["vocab_size"]
        if tc.draft_vocab_size > vocab:
            raise UserError(
                f"training.draft_vocab_size={tc.draft_vocab_size} is larger than the backbone's vocabulary "
                f"({vocab} tokens): pick at most {vocab}"
            )
        token_map, coverage = draft_token_map(_target_counts(train_set, vocab), tc.draft_vocab_size)
        log.info(
            "draft vocabulary: the %d most frequent target tokens cover %.2f%% of the training targets",
            tc.draft_vocab_size,
            100 * coverage,
        )

    # 5. Train (all ranks), or take the published heads as they are (calibration settings changed).
    if done is None:
        result, heads, trained = _train(
            cfg, recipe, backbone, tokenizer, identity, key, train_set, ds_config, device, token_map
        )
        if not dist.is_main():
            return {"rank": dist.rank()}
        if trained is not None:  # calibrate with the backbone as trained (LoRA: adapters applied)
            backbone = recipe.decoding_backbone(trained)
        result.update(head_projection=tc.head_projection, draft_vocab_size=heads.draft_vocab_size)
        if coverage is not None:
            result["draft_vocab_coverage"] = round(coverage, 6)
    else:
        if not dist.is_main():
            return {"rank": dist.rank()}
        result, trained = dict(done), None
        try:
            heads = MedusaHeads.from_pretrained(wd.heads, device=device)
        except HeadsFormatError as err:
            raise DamagedArtefactError(
                f"the heads in {wd.heads} cannot be calibrated again: {err}: {_RETRAIN}"
            ) from None
        backbone = recipe.published_backbone(wd.heads, backbone, device)
    _attach(heads, backbone, cfg)  # shared heads: the lm_head of the backbone they decode with
    # 6. Rank 0: held-out accuracy -> the tree with the best expected tokens/s on this machine. A
    # trained backbone was left in training mode: no dropout (LoRA's included) while measuring.
    heads.eval()
    backbone.eval()
    collate = PadCollator(0)
    batches = (
        collate(calib_records[i : i + tc.per_device_batch_size])
        for i in range(0, len(calib_records), tc.per_device_batch_size)
    )
    calib = calibrate(
        backbone,
        heads,
        batches,
        max_nodes=cfg.tree.max_nodes,
        topk=cfg.tree.topk,
        context_len=cfg.tree.latency_context,
        chunk_size=tc.loss_chunk_size,
    )
    result.update(
        {
            "heldout_top1": [round(float(a), 4) for a in calib.acc[:, 0]],
            "heldout_top5": [round(float(a), 4) for a in calib.acc[:, 4]],
            "calibration_split": calib_split,
            "tree_size": len(calib.choices),
            "expected_tau": round(calib.tree["best"]["expected_tau"], 4),
            "seconds": round(time.time() - start_time, 1),
        }
    )
    calibration = {
        "settings": calibration_settings,
        "split": calib_split,
        "records": len(calib_records),
        **calib.to_json(),
    }

    # 7. Rank 0: publish workdir/heads with renames only (never a half-written heads folder).
    remove_stale(wd.heads)
    tmp = staging_dir(wd.heads)
    if done is None:
        # config.json: FasterDecoding keys + backbone identity (checked by later stages) + settings + figures.
        heads.save_pretrained(
            tmp, extra_config={"backbone": identity, "training": key, "training_result": result}
        )
        # Medusa-2: the trained backbone (LoRA: the adapter only) ships with the heads.
        if trained is not None:
            trained.save_pretrained(tmp / TRAINED_BACKBONE)
            save_tokenizer(tokenizer, tmp / TRAINED_BACKBONE)
    else:  # recalibrated: the same weights (hard links), new figures
        _link_tree(wd.heads, tmp, skip=(HEADS_CONFIG, CALIBRATION, CHOICES))
        meta = read_json(wd.heads / HEADS_CONFIG, repair=_RETRAIN)
        atomic_write_json(tmp / HEADS_CONFIG, {**meta, "training_result": result})
    save_choices(tmp / CHOICES, calib.choices)
    atomic_write_json(tmp / CALIBRATION, calibration)
    publish_dir(tmp, wd.heads)
    _print_summary(result)
    return result if done is None else {**result, "skipped": True, "recalibrated": True}


# -- skip / resume keys -----------------------------------------------------------------------------
def run_key(cfg, identity: dict, manifest: dict) -> dict:
    """Everything that changes the trained heads: compared to skip finished work and to resume safely.

    Every ``training.*`` field except ``TrainingConfig.RUN_ONLY``, plus the inputs: the backbone
    (fingerprint, dtype, quantization), the global batch size, the held-out fraction and what the
    distilled data is (its settings and counts, not when or how fast it was written: a distill run
    that only rewrote the manifest must not force a retrain). Flat, as ``config.json["training"]``.

    Inputs count by content, not by place: the distilled data's settings without file paths
    (:func:`~medusa_train.data.distilled.comparable`), the backbone by fingerprint, and
    ``training.init_heads`` by its weights file's SHA-256, so a copied or moved workdir has the same
    key.
    """
    tc = cfg.training
    key = settings_key(
        training=tc,
        model_dtype=resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device)),
        model_quantization=cfg.model.quantization,
        global_batch_size=tc.per_device_batch_size * tc.gradient_accumulation_steps * dist.world_size(),
        eval_fraction=cfg.data.eval_fraction,
        backbone_fingerprint=identity["fingerprint"],
        distill=data_key(manifest),
    )
    flat = {**key.pop("training"), **key}
    if tc.init_heads:
        weights = Path(tc.init_heads) / HEADS_WEIGHTS
        flat["init_heads"] = f"sha256:{file_sha256(weights)[:16]}" if weights.is_file() else tc.init_heads
    return flat


def calibration_key(cfg) -> dict:
    """Everything the tree calibration depends on besides the trained model: every ``tree.*`` field
    except ``TreeConfig.RUN_ONLY`` (as ``tree_<field>``) and ``training.calibration_max_records``.

    Stored in calibration.json: a change re-runs only the calibration (the heads stay as trained).
    """
    key = settings_key(tree=cfg.tree, calibration_max_records=cfg.training.calibration_max_records)
    return {**{f"tree_{k}": v for k, v in key.pop("tree").items()}, **key}


_RETRAIN = "run `python -m medusa_train stage=train training.overwrite=true` to train the heads again"


def trained_with(heads_dir: Path, key: dict, recipe: Recipe) -> dict | None:
    """The stored training result if ``heads_dir`` is complete, whole and was trained with ``key``;
    None otherwise (a damaged heads folder is trained again, with a warning)."""
    config = heads_dir / HEADS_CONFIG
    if not all((heads_dir / name).is_file() for name in (HEADS_CONFIG, HEADS_WEIGHTS, CHOICES)):
        return None
    if not recipe.is_published(heads_dir):  # Medusa-2: the trained backbone (or its adapter) too
        return None
    try:
        meta = read_json(config, repair=_RETRAIN)
        safetensors_shapes(heads_dir / HEADS_WEIGHTS)
    except (DamagedArtefactError, HeadsFormatError) as err:
        log.warning("%s: training the heads again", err)
        return None
    return meta.get("training_result") if meta.get("training") == key else None


def calibrated_with(heads_dir: Path) -> dict | None:
    """The calibration settings stored in ``heads_dir/calibration.json`` (None: none recorded, or
    the file is damaged: the calibration then runs again)."""
    try:
        settings = read_json(heads_dir / CALIBRATION, repair=_RETRAIN).get("settings")
    except DamagedArtefactError:
        return None
    return settings if isinstance(settings, dict) else None


def _check_resume(train_dir: Path, info: dict, overwrite: bool) -> None:
    """Refuse to resume checkpoints of another backbone / other settings (or wipe them with overwrite).

    ``info`` is this run's ``run.json`` (``settings``: the run key, ``backbone``: its identity). The
    backbone counts by content (its fingerprint), not by where it lies, so a moved or copied workdir
    resumes.
    """
    path = train_dir / RUN_INFO
    if train_dir.exists() and overwrite and dist.is_main():
        shutil.rmtree(train_dir)
    if path.is_file() and not overwrite:
        old = read_json(
            path,
            repair=f"pass training.overwrite=true to start training again (the checkpoints in {train_dir} are discarded)",
        )
        same_settings = old.get("settings") == info["settings"]
        same_backbone = identity_content(old.get("backbone")) == identity_content(info["backbone"])
        if not (same_settings and same_backbone):
            if not same_settings:
                what = describe_diff(old.get("settings"), info["settings"])
            else:
                what = describe_diff(
                    identity_content(old.get("backbone")), identity_content(info["backbone"])
                )
                what = "the backbone: " + what
            raise UserError(
                f"{train_dir} holds checkpoints of another run (differs in {what}): run with the old values to "
                "resume them, pass training.overwrite=true to discard them, or use another workdir="
            )


# -- data -------------------------------------------------------------------------------------------
def _truncate(record: dict, max_len: int) -> dict:
    return {
        "input_ids": list(record["input_ids"][:max_len]),
        "loss_mask": list(record["loss_mask"][:max_len]),
    }


def _usable_indices(ds, max_len: int) -> list[int]:
    """Records with at least one head target inside the truncation window (head 1 needs index >= 2)."""
    return [i for i, m in enumerate(ds["loss_mask"]) if sum(m[2:max_len]) > 0]


def _target_counts(records: _Records, vocab_size: int) -> torch.Tensor:
    """``(V,)`` how often each token is a head target in the training split: loss-masked tokens at
    positions 2 .. max_len - 1 of the truncated records (head 1 at position 0 predicts position 2)."""
    rows = records.ds.select(records.indices)
    picked = [
        np.asarray(ids[2 : records.max_len])[np.asarray(mask[2 : records.max_len], dtype=bool)]
        for ids, mask in zip(rows["input_ids"], rows["loss_mask"], strict=True)
    ]
    flat = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
    counts = np.bincount(flat.astype(np.int64), minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


class _Records(torch.utils.data.Dataset):
    """Truncated ``input_ids``/``loss_mask`` records of a distilled split, read lazily."""

    def __init__(self, ds, indices: list[int], max_len: int) -> None:
        self.ds, self.indices, self.max_len = ds, indices, max_len

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        return _truncate(self.ds[self.indices[i]], self.max_len)

    def count_tokens(self) -> int:
        return sum(min(len(r), self.max_len) for r in self.ds.select(self.indices)["input_ids"])


# -- training ---------------------------------------------------------------------------------------
def _initial_heads(cfg, backbone, identity: dict, token_map: torch.Tensor | None = None) -> MedusaHeads:
    """Fresh heads (projections copied from lm_head, or bound to it when shared) or
    ``training.init_heads``, checked against the backbone and ``training.head_projection``.

    Args:
        token_map: the draft vocabulary of ``head_projection=truncated`` (None otherwise); heads from
            ``training.init_heads`` keep their own.
    """
    tc = cfg.training
    want = (identity["hidden_size"], identity["vocab_size"], tc.num_heads, tc.num_layers)
    if tc.init_heads:
        try:
            heads = MedusaHeads.from_pretrained(tc.init_heads)
        except HeadsFormatError as err:
            raise UserError(f"training.init_heads: {err}") from None
        got = (heads.hidden_size, heads.vocab_size, heads.num_heads, heads.num_layers)
        if got != want:
            raise UserError(
                f"training.init_heads={tc.init_heads} has (hidden, vocab, heads, layers)={got} but this "
                f"backbone/config needs {want}: those heads belong to another backbone or setting"
            )
        if heads.head_projection != tc.head_projection or (
            token_map is not None and heads.draft_vocab_size != len(token_map)
        ):
            raise UserError(
                f"training.init_heads={tc.init_heads} are {heads.head_projection} heads (draft vocabulary "
                f"{heads.draft_vocab_size}) but training.head_projection={tc.head_projection}"
                f"{f' with draft_vocab_size={len(token_map)}' if token_map is not None else ''}: make them agree"
            )
        heads.base_model_name_or_path = cfg.model.name_or_path
        return _attach(heads, backbone, cfg)
    torch.manual_seed(tc.seed)
    heads = MedusaHeads(
        *want,
        base_model_name_or_path=cfg.model.name_or_path,
        head_projection=tc.head_projection,
        token_map=token_map,
    )
    _attach(heads, backbone, cfg)
    if tc.init_from_lm_head and tc.head_projection != "shared":
        heads.init_from_lm_head(backbone.get_output_embeddings().weight.detach().float())
    return heads


def _attach(heads: MedusaHeads, backbone, cfg) -> MedusaHeads:
    """:meth:`MedusaHeads.attach` with its refusals as one-line user errors."""
    try:
        return heads.attach(backbone)
    except HeadsFormatError as err:
        raise UserError(f"training.head_projection={cfg.training.head_projection}: {err}") from None


def _train(cfg, recipe: Recipe, backbone, tokenizer, identity, key, train_set, ds_config, device, token_map):
    """Step 5: heads, the resume check, the training module, the Trainer run (all ranks).

    Returns:
        ``(figures, trained heads, trained backbone or None)`` on rank 0, ``(None, None, None)``
        elsewhere. The trained backbone (Medusa-2) is the module that trained (a peft model with
        LoRA/QLoRA); after ZeRO-3 a fresh copy of it holding the consolidated weights.
    """
    tc, wd = cfg.training, Workdir(Path(cfg.workdir))
    on_cpu = device.type == "cpu"
    heads = _initial_heads(cfg, backbone, identity, token_map).to(device)
    info = {"settings": key, "backbone": identity}
    _check_resume(wd.train, info, tc.overwrite)
    wd.train.mkdir(parents=True, exist_ok=True)

    with deepspeed_process(ds_config is not None):
        precision = recipe.precision(DTYPES[resolve_dtype(cfg.model.dtype, device)])
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
            ddp_backend="gloo" if on_cpu and dist.world_size() > 1 else None,
            deepspeed=ds_config,
            bf16=not on_cpu and precision == torch.bfloat16,
            fp16=not on_cpu and precision == torch.float16,
            report_to="none",  # our TrackerCallback logs to wandb with an explicit mode (see trainer.py)
            run_name=cfg.tracking.run_name or f"train-{wd.root.resolve().name}",
            remove_unused_columns=False,
            dataloader_num_workers=0,
            disable_tqdm=False,
            eval_strategy="no",
        )
        if args.process_index == 0:
            atomic_write_json(wd.train / RUN_INFO, info)

        # The data the module reads: tokens (online), or the frozen backbone's stored hidden states.
        if tc.cache_hidden_states:  # Medusa-1 only (the config refuses it otherwise)
            dataset, collator = (
                _hidden_cache(
                    args, backbone, train_set, wd.train / HIDDEN_CACHE, key, tc, recipe.head_loss.soft
                ),
                row_collator,
            )
            lm_head = backbone.get_output_embeddings().weight  # (V, d): the soft losses' targets
            model, callbacks, extra = recipe.training_module(heads, None, lm_head=lm_head)
        else:
            dataset, collator = train_set, PadCollator(tokenizer.pad_token_id or 0)
            model, callbacks, extra = recipe.training_module(heads, backbone)
        if is_zero3(ds_config):  # the losses read these weights directly: ZeRO-3 gathers them for the module
            register_gathered(model, model.directly_read_weights())
        tracker = start_tracking(cfg.tracking, wd.root, "train", config={"training": asdict(tc), "run": info})
        budget = TimeBudgetCallback(tc.max_minutes) if tc.max_minutes else None
        trainer = MedusaTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=collator,
            callbacks=[
                *callbacks,
                MetricsScheduleCallback(),
                TrackerCallback(tracker),
                *([budget] if budget else []),
            ],
            head_lr_multiplier=recipe.head_lr_multiplier,
        )
        last = last_complete_checkpoint(wd.train, remove_incomplete=args.process_index == 0)
        if last:
            log.info("resuming from %s", last)
        t0 = time.time()
        try:
            out = trainer.train(resume_from_checkpoint=last)
        except pickle.UnpicklingError:
            if not last:
                raise
            raise refused_pickle(Path(last)) from None
        finally:
            tracker.finish()
        train_seconds = time.time() - t0
        trained, state = recipe.trained_backbone(model), None
        if is_zero3(ds_config):  # a collective: every rank takes part, rank 0 gets whole weights
            heads, state = gather_zero3(trainer, heads, with_backbone=trained is not None)
        main = trainer.is_world_process_zero()  # asked before DeepSpeed's process state is released
    if not main:
        return None, None, None
    if state is not None:
        # ZeRO-3 left the module that trained partitioned: load its consolidated weights into a fresh
        # copy, now that from_pretrained no longer partitions what it loads.
        trained = recipe.rebuild_trained(state, device)

    hist = trainer.head_history
    final = hist[-1] if hist else {}
    result = {
        "mode": tc.mode,
        "steps": trainer.state.global_step,
        "final_loss": round(float(final.get("loss", out.training_loss)), 5),
        "train_top1": [final.get(f"head{k + 1}/top1") for k in range(tc.num_heads)],
        "train_top5": [final.get(f"head{k + 1}/top5") for k in range(tc.num_heads)],
        "train_seconds": round(train_seconds, 1),
        "stopped_by_time_budget": bool(budget and budget.stopped_early),
        "resumed_from": last,
        "samples_per_s": out.metrics.get("train_samples_per_second"),
    }
    if isinstance(dataset, HiddenCache):
        result["trained_rows_per_epoch"] = int(dataset.offsets[-1])
    tokens = train_set.count_tokens() * max(out.metrics.get("epoch", 0.0) or 0.0, 0.0)
    if last:  # resumed: train_runtime covers only this run's steps, so count only their tokens
        done_before = int(Path(last).name.split("-")[1])
        tokens *= max(trainer.state.global_step - done_before, 0) / max(trainer.state.global_step, 1)
    result["tokens_per_s"] = round(tokens / max(out.metrics.get("train_runtime", train_seconds), 1e-9), 1)
    result.update(extra)
    return result, heads, trained


def _hidden_cache(
    args, backbone, train_set: _Records, directory: Path, key: dict, tc, soft: bool
) -> HiddenCache:
    """The frozen backbone's hidden states of the training split, built once by rank 0 (resumable)
    and keyed by the run key: checkpoints of another run are refused or wiped with it anyway."""
    settings = settings_key(run=key, cache_version=HIDDEN_CACHE_VERSION)
    with args.main_process_first(desc="hidden-state cache"):
        if args.process_index == 0:
            t0 = time.time()
            records = [train_set[i] for i in range(len(train_set))]
            build_hidden_cache(
                backbone, records, directory, tc.num_heads, settings, tc.per_device_batch_size, soft=soft
            )
            log.info("hidden-state cache ready in %.1fs", time.time() - t0)
    return HiddenCache(directory)


# -- publishing -------------------------------------------------------------------------------------
def _link_tree(src: Path, dst: Path, skip: tuple[str, ...]) -> None:
    """Hard-link (copy where links are refused) every file of ``src`` into ``dst``, except the
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
        dirs_exist_ok=True,
    )


def _print_summary(result: dict) -> None:
    lines = [
        f"train: {result['steps']} steps, final loss {result['final_loss']}, {result['tokens_per_s']} tokens/s"
    ]
    for k, (t1, t5) in enumerate(zip(result["heldout_top1"], result["heldout_top5"], strict=True)):
        lines.append(f"  head {k + 1}: held-out top-1 {t1:.3f}  top-5 {t5:.3f}")
    lines.append(f"  tree: {result['tree_size']} nodes, expected tau {result['expected_tau']}")
    print("\n".join(lines), flush=True)
