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
    1. Read the distilled data's manifest (workdir/distill); check the recipe's settings, DeepSpeed,
       that `eval.attention` runs here (step 6 times with it) and that a truncated draft vocabulary is
       smaller than the backbone's the manifest names.
    2. Load the backbone (ZeRO-3 with a backbone that trains: partitioned as it loads, no rank
       holding it whole); the distilled data must have been made by it, a tree-attention kernel
       named by `eval.attention` must compute its attention, and one language model under its LM head
       must return the hidden state the heads read (`head_targets.language_model`).
    3. Skip if workdir/heads already holds heads trained and calibrated with the same settings
       (unless overwrite); if only the calibration's settings differ (`tree.max_nodes`, `tree.topk`,
       `tree.latency_context`, `tree.tolerance`, `training.calibration_max_records`), calibrate the
       published heads again.
    4. Data: the training split and the held-out records the calibration measures on;
       `training.head_projection=truncated`: the draft vocabulary (token_map), the
       `training.draft_vocab_size` most frequent target tokens of the training split.
    5. Where the loss reads the backbone's distribution from lm_head(h) (soft head targets, Medusa-2's
       LM loss), check it against the backbone's forward on a few tokens (one forward); train with the
       Hugging Face Trainer (DeepSpeed per `deepspeed=`), checkpointing to workdir/train and resuming
       from its last checkpoint automatically (all ranks).
    6. Rank 0: held-out top-1..10 accuracy per head; grow trees, time tree forwards on this machine
       with the tree attention eval decodes with (`eval.attention`), choose the smallest size within
       `tree.tolerance` of the best expected tokens/s (`decoding/calibrate.py`).
    7. Rank 0: publish workdir/heads atomically: heads, calibration.json, medusa_choices.json
       (Medusa-2 also the trained backbone, or only its LoRA adapter, in workdir/heads/backbone:
       staged before step 6, which calibrates on what that folder holds, a LoRA adapter merged).

Medusa-1 and Medusa-2 differ in which parameters train and in the loss; both come from the recipe
of ``training.mode`` (``training/recipes.py``), so this file has no mode branches.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import pickle
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainingArguments

from medusa_train import __version__, dist, launch
from medusa_train.backbone import (
    DTYPES,
    backbone_identity,
    identity_content,
    load_configured_backbone,
    older_fingerprint,
    other_code_fingerprint,
    resolve_device,
    resolve_dtype,
)
from medusa_train.backbone_source import check_backbone_source
from medusa_train.card_inputs import CALIBRATION_INPUT, shape_problem
from medusa_train.config import Config, TrainingConfig
from medusa_train.data.distilled import check_made_by, data_key, load_distilled, read_manifest
from medusa_train.decoding.attention import AttentionBackendError, check_verifiable
from medusa_train.decoding.calibrate import Calibration, calibrate, timed_attention
from medusa_train.decoding.tree import save_choices
from medusa_train.errors import DamagedArtefactError, HeadsFormatError, UserError
from medusa_train.formats import MEDUSA_TRAIN_VERSION
from medusa_train.head_targets import hidden_width, language_model, logit_map
from medusa_train.heads import MedusaHeads
from medusa_train.heads_layout import check_heads_option, option_refusal
from medusa_train.safetensors_check import safetensors_shapes
from medusa_train.tracking import start_tracking
from medusa_train.training.hidden_cache import HiddenCache, build_hidden_cache
from medusa_train.training.model import lm_head_input_mismatch, logit_map_mismatch
from medusa_train.training.recipes import Recipe, recipe_for
from medusa_train.training.records import Records, check_draft_vocab_size, draft_vocabulary, training_data
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
    cast_unpartitioned,
    check_checkpoint_ranks,
    deepspeed_config,
    deepspeed_process,
    gather_zero3,
    gathered,
    is_zero3,
    load_masters,
    master_weights,
    own_dtypes,
    partitioned_loading,
    register_gathered,
    release_engine,
)
from medusa_train.transformers4 import save_tokenizer
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
    link_tree,
    publish_dir,
    read_json,
    remove_stale,
    require,
    settings_of,
    staging_dir,
)

log = logging.getLogger(__name__)

HIDDEN_CACHE_VERSION = 3
"""Layout version of the hidden-state cache, part of its settings (2: the whole :func:`train_settings`;
3: its stored targets end with each reply, so a cache of version 2 is built again)."""


# -- the stage --------------------------------------------------------------------------------------
def run(cfg: Config) -> dict:
    """Train heads; write workdir/heads (+ calibration.json, medusa_choices.json). Returns the figures."""
    tc, wd = cfg.training, Workdir(Path(cfg.workdir))
    recipe = recipe_for(cfg)  # Medusa-1 | Medusa-2: which parameters train, and the loss
    start_time = time.time()

    # 1. Inputs exist; the recipe's settings and DeepSpeed can run (before any heavy work).
    require(wd.distill, "distilled data", "distill")
    manifest = read_manifest(wd.distill)
    distilled_vocab = manifest["backbone"].get("vocab_size")
    if tc.head_projection == "truncated" and isinstance(distilled_vocab, int):
        # The distilled data names its backbone's vocabulary: N >= V is refused before any load.
        check_draft_vocab_size(tc.draft_vocab_size, distilled_vocab)
    check_backbone_source(cfg.model.name_or_path)
    if tc.init_heads:  # loaded in step 5, after the backbone: a folder of no heads must not wait for that
        check_heads_option("training.init_heads", tc.init_heads)
    device, ds_config = _check_settings(cfg, recipe)
    # ZeRO-3 partitions a backbone that trains as it loads; Medusa-1's frozen backbone runs outside the
    # engine and stays whole, as does a quantized one (transformers loads it whole).
    partitioned = is_zero3(ds_config) and recipe.trains_backbone and cfg.model.quantization == "none"

    # Steps 2-5 in one DeepSpeed process state (nothing without DeepSpeed): a partitioned load
    # needs its process group.
    with deepspeed_process(ds_config is not None):
        # 2. Backbone (partitioned: each rank holds its part only); the distilled data must come from it.
        loading = (
            partitioned_loading(ds_config, tc.per_device_batch_size, tc.gradient_accumulation_steps, device)
            if partitioned
            else contextlib.nullcontext()
        )
        with loading:
            backbone, tokenizer = load_configured_backbone(
                cfg.model, device, trainable=recipe.trains_backbone
            )
        _check_attention(cfg, device, backbone)
        # the heads train and calibrate on its language model's last_hidden_state: none is refused now
        language_model(backbone)
        identity = backbone_identity(
            backbone,
            cfg.model.name_or_path,
            cfg.model.revision,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        if older_fingerprint(manifest["backbone"]["fingerprint"], identity["fingerprint"]):
            raise UserError(
                f"{wd.distill} names its backbone by a fingerprint an earlier medusa_train computed from other "
                "bytes than this version reads: run stage=distill with distill.overwrite=true to distill again"
            )
        other_code = None  # another fingerprint: was the data distilled with the other trust_remote_code?
        if manifest["backbone"]["fingerprint"] != identity["fingerprint"]:
            other_code = other_code_fingerprint(
                cfg.model.name_or_path, cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
            )
        check_made_by(
            manifest,
            identity,
            wd.distill,
            cfg.model.name_or_path,
            trust_remote_code=cfg.model.trust_remote_code,
            other_code_fingerprint=other_code,
        )
        if tc.head_projection == "truncated":  # a manifest without the vocabulary: checked on the loaded one
            check_draft_vocab_size(tc.draft_vocab_size, identity["vocab_size"])

        # 3. Skip finished heads, or re-run only their calibration.
        settings, calib_settings = train_settings(cfg, identity, manifest), calibration_settings(cfg)
        done, calibrated = _published(wd, settings, calib_settings, recipe, tc.overwrite)
        if calibrated:
            return {**done, "skipped": True}

        # 4. Data: the training split and the records the calibration measures on.
        data = training_data(
            load_distilled(wd.distill), cfg.data.eval_fraction, tc.max_seq_len, tc.calibration_max_records
        )
        token_map, coverage = None, None
        if tc.head_projection == "truncated" and done is None:
            token_map, coverage = draft_vocabulary(data.train, identity["vocab_size"], tc.draft_vocab_size)

        # 5. Train (all ranks), or take the published heads as they are (calibration settings changed).
        if done is None:
            _check_lm_head(tc, recipe, backbone, data.train, partitioned)
            result, heads, trained, state = _train(
                cfg, recipe, backbone, tokenizer, identity, settings, data.train, ds_config, device, token_map
            )
    if not launch.is_main():
        return {"rank": launch.rank()}
    if done is None:
        if state is not None:
            # ZeRO-3 left the module that trained partitioned: its consolidated weights go into a fresh
            # copy, loaded whole now that the DeepSpeed process state is released.
            trained = recipe.rebuild_trained(state, device)
        staged = None
        if trained is not None:
            # heads/backbone is written now: the calibration runs on the model it holds, which for
            # LoRA/QLoRA is the adapter merged into the weights in place (peft cannot save it after).
            staged = _stage_backbone(wd.heads, trained, tokenizer)
            backbone = recipe.decoding_backbone(trained)
        # What training left is cyclic garbage until a gc pass: with DeepSpeed the destroyed engine's
        # leftovers (the module that trained, ZeRO-3's partitioned backbone just replaced, DeepSpeed's
        # process groups on their parameters: until then the gloo groups' threads stay, and the
        # interpreter's exit under them can abort the process after its work is done); under mixed
        # precision the training module (accelerate binds its forward back to it), with a KL
        # teacher's whole copy of the backbone. Freed before calibration times anything.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result.update(head_projection=tc.head_projection, draft_vocab_size=heads.draft_vocab_size)
        if coverage is not None:
            result["draft_vocab_coverage"] = round(coverage, 6)
    else:
        result, staged = dict(done), None
        if partitioned:  # each rank loaded a part of the base: the calibration needs it whole
            backbone, _ = load_configured_backbone(cfg.model, device, trainable=recipe.trains_backbone)
        heads, backbone = _published_heads(wd.heads, recipe, backbone, device)
    _attach(heads, backbone, cfg)  # shared heads: the lm_head of the backbone they decode with

    # 6. Rank 0: held-out accuracy -> the tree with the best expected tokens/s on this machine.
    calib = _calibrate(cfg, backbone, heads, data.calibration)
    result.update(
        {
            "heldout_top1": [round(float(a), 4) for a in calib.acc[:, 0]],
            "heldout_top5": [round(float(a), 4) for a in calib.acc[:, 4]],
            "calibration_split": data.calibration_split,
            "tree_size": len(calib.choices),
            "expected_tau": round(calib.tree["best"]["expected_tau"], 4),
            "seconds": round(time.time() - start_time, 1),
        }
    )
    calibration = {
        "settings": calib_settings,
        "split": data.calibration_split,
        "records": len(data.calibration),
        **calib.to_json(),
    }

    # 7. Rank 0: publish workdir/heads with renames only (never a half-written heads folder).
    if done is None:
        # the Hub revision the base was loaded at, recorded with the heads for the export's card (not in
        # the identity runs compare: the fingerprint says which files they are, wherever they came from)
        base = {**identity, "revision": cfg.model.revision} if cfg.model.revision else identity
        # which medusa_train trained them: for bug reports and format differences, never read to load them
        extra = {
            "backbone": base,
            MEDUSA_TRAIN_VERSION: __version__,
            "training": settings,
            "training_result": result,
        }
        _publish(
            wd.heads,
            calib.choices,
            calibration,
            heads=heads,
            extra=extra,
            staged=staged,
        )
    else:
        _publish(wd.heads, calib.choices, calibration, result=result)
    _print_summary(result)
    return result if done is None else {**result, "skipped": True, "recalibrated": True}


def check_settings(cfg: Config) -> None:
    """What step 1 checks of the settings alone, reading no input: the device (``model.device``), the
    recipe's settings, DeepSpeed's (``deepspeed=``: the package, offload on a CPU) and that
    ``eval.attention`` runs on the device. ``stage=all`` runs it before its first stage
    (:func:`medusa_train.stages.check_settings`), so a setting this machine cannot run is told before
    pretraining and distillation, not after them.

    Raises:
        UserError: one line naming the setting.
    """
    _check_settings(cfg, recipe_for(cfg))


def _check_settings(cfg: Config, recipe: Recipe) -> tuple[torch.device, dict | None]:
    """:func:`check_settings`; returns the device and the DeepSpeed config (None when off)."""
    device = resolve_device(cfg.model.device)
    recipe.check()
    ds_config = _deepspeed(cfg, recipe, device)
    _check_attention(cfg, device)
    return device, ds_config


def _deepspeed(cfg: Config, recipe: Recipe, device: torch.device) -> dict | None:
    """Step 1: the DeepSpeed config of ``deepspeed=`` (None when off), in the recipe's precision."""
    if not cfg.deepspeed.enabled:
        return None
    return deepspeed_config(
        cfg.deepspeed.zero_stage,
        offload_optimizer=cfg.deepspeed.offload_optimizer,
        offload_param=cfg.deepspeed.offload_param,
        # must agree with TrainingArguments(bf16=/fp16=), or transformers refuses it
        dtype=recipe.precision(DTYPES[resolve_dtype(cfg.model.dtype, device)]),
        on_cpu=device.type == "cpu",
    )


def _published(
    wd: Workdir, settings: dict, calib_settings: dict, recipe: Recipe, overwrite: bool
) -> tuple[dict | None, bool]:
    """Step 3: ``(training result, calibrated)`` of the heads published in ``wd.heads``: ``(None,
    False)`` when they must be trained (none, damaged, other settings, ``overwrite``), ``(result,
    False)`` when only their calibration settings differ, ``(result, True)`` when they are done."""
    heads_dir = wd.heads
    if launch.is_main():
        remove_stale(heads_dir)  # a run killed while publishing them: the previous heads come back
        remove_stale(wd.train)  # temp files of writes a kill interrupted (run.json, the hidden cache)
    done = None if overwrite else trained_with(heads_dir, settings, recipe)
    if done is None:
        return None, False
    stored = calibrated_with(heads_dir)
    if stored == calib_settings:
        log.info(
            "heads in %s are complete for these settings: skipping (training.overwrite=true retrains)",
            heads_dir,
        )
        return done, True
    log.info(
        "heads in %s are trained with these settings but their tree was calibrated with other ones "
        "(%s): re-running the calibration only (training.overwrite=true retrains)",
        heads_dir,
        describe_diff(stored, calib_settings) if stored else f"{CALIBRATION} missing or damaged",
    )
    return done, False


def _published_heads(
    heads_dir: Path, recipe: Recipe, backbone: PreTrainedModel, device: torch.device
) -> tuple[MedusaHeads, PreTrainedModel]:
    """Step 5 without training: the published heads and the backbone they decode with."""
    try:
        heads = MedusaHeads.from_pretrained(heads_dir, device=device)
    except HeadsFormatError as err:
        raise DamagedArtefactError(
            f"the heads in {heads_dir} cannot be calibrated again: {err}: {_RETRAIN}"
        ) from None
    return heads, recipe.published_backbone(heads_dir, backbone, device)


def _check_lm_head(
    tc: TrainingConfig, recipe: Recipe, backbone: PreTrainedModel, train_set: Records, partitioned: bool
) -> None:
    """Step 5, before training: what reads the backbone's lm_head over the heads' ``h`` (its decoder's
    last hidden state) -- the heads' projections copied from it (``training.init_from_lm_head``) or
    projecting with it (``shared``) where it reads vectors of another width than ``h``, the soft targets
    and Medusa-2's LM loss (``Recipe.reads_distribution``) -- reads it where it reads ``h`` (not a
    prediction head's output: ELECTRA, RemBERT, ModernBERT's decoder, the BERT family's causal LMs);
    and for the latter two, what ``head_targets.logit_map`` makes of it is the distribution the
    backbone's forward gives. On the first 16 tokens of the first training record (a forward each);
    else one-line UserError. A backbone ZeRO-3 loaded partitioned is not checked by a forward: no rank
    holds it whole, and gathering it would hold it whole on every rank (an LM head of another width than
    ``h`` is refused from the weights' shapes there too)."""
    readers = []  # (what reads lm_head over h, the setting that reads nothing of it)
    # Heads copied from lm_head or projecting with it over a prediction head of h's own width (ModernBERT's
    # decoder, the BERT family's) start from, or map through, a head of vectors h is not: a starting point
    # training moves from, trained as before. Over one of another width (ELECTRA, RemBERT) they cannot.
    weight = backbone.get_output_embeddings().weight  # ds_shape: a ZeRO-3 partition's whole
    read, hidden = int(getattr(weight, "ds_shape", weight.shape)[1]), hidden_width(backbone)
    other_width = read != hidden
    if other_width and tc.head_projection == "shared":
        readers.append(
            (
                "training.head_projection=shared (whose heads project with it)",
                "use training.head_projection=own",
            )
        )
    elif other_width and tc.init_from_lm_head and not tc.init_heads:
        readers.append(
            (
                "training.init_from_lm_head=true (which copies it into the heads)",
                "set training.init_from_lm_head=false",
            )
        )
    reads = recipe.reads_distribution()
    if reads is not None:
        readers.append(reads)
    if not readers:
        return
    base = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone  # peft
    kind = getattr(base.config, "model_type", None)
    name = f"{type(base).__name__}{f' ({kind})' if kind else ''}"
    if other_width:  # the weights' shapes say it, partitioned or not
        problem = f"its LM head reads {read}-wide vectors, not its decoder's {hidden}-wide last hidden state"
    elif partitioned:
        log.info("the backbone's lm_head and logits are not checked: it is partitioned (ZeRO-3)")
        return
    else:
        ids = torch.tensor([train_set[0]["input_ids"][:16]], device=backbone.device)  # (1, T)
        problem = lm_head_input_mismatch(backbone, ids)
    if problem is not None:
        raise UserError(
            f"{name}: {problem}, the heads' input (a prediction head sits between the two), so "
            f"{' and '.join(what for what, _ in readers)} would apply the LM head to vectors it does not "
            f"read: {' and '.join(instead for _, instead in readers)}"
        )
    if reads is None:  # hard targets only: decoding and calibration read the forward or a top-k
        return
    problem = logit_map_mismatch(backbone, ids)  # (not partitioned: that returned above)
    if problem is None:
        return
    what, instead = reads
    raise UserError(
        f"{name}: its forward changes its logits after lm_head in a way medusa_train does not know "
        f"({problem}), so {what} would not read the distribution it decodes from: {instead}, or report the "
        "architecture to medusa_train"
    )


def _check_attention(cfg: Config, device: torch.device, model: PreTrainedModel | None = None) -> None:
    """Steps 1 and 2: ``eval.attention`` runs on ``device`` and, once it is loaded, computes ``model``'s
    attention (step 6 times the tree forwards with it: a kernel refused there would end the run after
    its training). A model no tree decoder verifies (:func:`check_verifiable`) is refused first, in its own
    words: no attention setting would serve it."""
    if model is not None:
        check_verifiable(model)
    try:
        timed_attention(cfg.eval.attention, device, cfg.tree.latency_context, model=model)
    except AttentionBackendError as err:
        raise AttentionBackendError(
            f"eval.attention={cfg.eval.attention}: {err} (the tree calibration after training times its "
            "forwards with it)"
        ) from None


def _calibrate(
    cfg: Config, backbone: PreTrainedModel, heads: MedusaHeads, records: list[dict]
) -> Calibration:
    """Step 6: measure the heads on ``records`` and choose the tree (``decoding/calibrate.py``), its
    forwards timed with the tree attention eval decodes with (``eval.attention``). A trained backbone
    was left in training mode: no dropout (LoRA's included) while measuring."""
    heads.eval()
    backbone.eval()
    collate, size = PadCollator(0), cfg.training.per_device_batch_size
    batches = (collate(records[i : i + size]) for i in range(0, len(records), size))
    return calibrate(
        backbone,
        heads,
        batches,
        max_nodes=cfg.tree.max_nodes,
        topk=cfg.tree.topk,
        context_len=cfg.tree.latency_context,
        chunk_size=cfg.training.loss_chunk_size,
        tolerance=cfg.tree.tolerance,
        attention=cfg.eval.attention,
    )


def _publish(
    heads_dir: Path,
    choices: list[list[int]],
    calibration: dict,
    *,
    heads: MedusaHeads | None = None,
    extra: dict | None = None,
    staged: Path | None = None,
    result: dict | None = None,
) -> None:
    """Step 7: swap in ``heads_dir`` with renames only (never a half-written heads folder).

    Trained ``heads`` are saved with ``extra`` in config.json (FasterDecoding keys + backbone identity
    + medusa_train version + settings + figures), into ``staged`` when :func:`_stage_backbone` began the folder with
    Medusa-2's trained backbone; recalibrated heads keep their files (hard links) with a new
    ``result`` in config.json.
    """
    if staged is None:
        remove_stale(heads_dir)
    tmp = staged if staged is not None else staging_dir(heads_dir)
    if heads is not None:
        heads.save_pretrained(tmp, extra_config=extra)
    else:
        link_tree(heads_dir, tmp, skip=(HEADS_CONFIG, CALIBRATION, CHOICES))
        meta = read_json(heads_dir / HEADS_CONFIG, repair=_RETRAIN)
        atomic_write_json(tmp / HEADS_CONFIG, {**meta, "training_result": result})
    save_choices(tmp / CHOICES, choices)
    atomic_write_json(tmp / CALIBRATION, calibration)
    publish_dir(tmp, heads_dir)


def _stage_backbone(heads_dir: Path, trained: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Step 7 begun before step 6: a staging folder for ``heads_dir`` holding Medusa-2's trained
    backbone as published (``save_pretrained``: the whole model, or with LoRA/QLoRA the adapter only)
    and the tokenizer in ``backbone/``; :func:`_publish` completes and swaps it in."""
    remove_stale(heads_dir)
    tmp = staging_dir(heads_dir)
    trained.save_pretrained(tmp / TRAINED_BACKBONE)
    save_tokenizer(tokenizer, tmp / TRAINED_BACKBONE)
    return tmp


# -- skip / resume settings -------------------------------------------------------------------------
def train_settings(cfg: Config, identity: dict, manifest: dict) -> dict:
    """Everything that changes the trained heads: compared to skip finished work and to resume safely.

    Every ``training.*`` field but the ``run_only`` ones, plus the inputs: the backbone
    (fingerprint, dtype, quantization), the global batch size, the held-out fraction and what the
    distilled data is (its settings and counts, not when or how fast it was written: a distill run
    that only rewrote the manifest must not force a retrain). Flat, as ``config.json["training"]``.

    Inputs count by content, not by place: the distilled data's settings without file paths
    (:func:`~medusa_train.data.distilled.comparable`), the backbone by fingerprint, and
    ``training.init_heads`` by its weights file's SHA-256, so a copied or moved workdir has the same
    settings.
    """
    tc = cfg.training
    settings = settings_of(
        training=tc,
        model_dtype=resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device)),
        model_quantization=cfg.model.quantization,
        global_batch_size=tc.per_device_batch_size * tc.gradient_accumulation_steps * launch.world_size(),
        eval_fraction=cfg.data.eval_fraction,
        backbone_fingerprint=identity["fingerprint"],
        distill=data_key(manifest),
    )
    flat = {**settings.pop("training"), **settings}
    if tc.init_heads:
        weights = Path(tc.init_heads) / HEADS_WEIGHTS
        flat["init_heads"] = f"sha256:{file_sha256(weights)[:16]}" if weights.is_file() else tc.init_heads
    return flat


def calibration_settings(cfg: Config) -> dict:
    """Everything the tree calibration depends on besides the trained model: every ``tree.*`` field
    but the ``run_only`` ones (as ``tree_<field>``) and ``training.calibration_max_records``.

    Stored in calibration.json: a change re-runs only the calibration (the heads stay as trained).
    """
    settings = settings_of(tree=cfg.tree, calibration_max_records=cfg.training.calibration_max_records)
    return {**{f"tree_{k}": v for k, v in settings.pop("tree").items()}, **settings}


_RETRAIN = "run `python -m medusa_train stage=train training.overwrite=true` to train the heads again"


def trained_with(heads_dir: Path, settings: dict, recipe: Recipe) -> dict | None:
    """The stored training result if ``heads_dir`` is complete, whole and was trained with ``settings``;
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
    return meta.get("training_result") if meta.get("training") == settings else None


def calibrated_with(heads_dir: Path) -> dict | None:
    """The calibration settings stored in ``heads_dir/calibration.json`` (None: none recorded, or
    the file is damaged, an entry its readers take of the wrong type included
    (:func:`~medusa_train.card_inputs.shape_problem`): the calibration then runs again, as the message of
    stage=eval's refusal of such a file says)."""
    try:
        calibration = read_json(heads_dir / CALIBRATION, repair=_RETRAIN)
    except DamagedArtefactError:
        return None
    if shape_problem(calibration, CALIBRATION_INPUT) is not None:
        return None
    settings = calibration.get("settings")
    return settings if isinstance(settings, dict) else None


def one_device_per_process(args: TrainingArguments, device: torch.device) -> None:
    """Keep the Trainer on the stage's one device.

    One process that sees several GPUs makes transformers' Trainer wrap the module in ``DataParallel``,
    whose copies on the other GPUs would read the frozen backbone (and the heads' targets) left on the
    first: it is told it has one GPU, as the Trainer tells itself for a model-parallel module. It also
    moves the module to ``args.device`` (one process: ``cuda:0``; under a launcher: ``cuda:LOCAL_RANK``,
    as ``model.device`` resolves there), so another ``model.device`` is refused.

    Raises:
        UserError: ``model.device`` is not the device the Trainer trains on.
    """
    if args.n_gpu > 1:
        args._n_gpu = 1
    if device.type != "cuda":
        return  # the Trainer's device is the same kind (DeepSpeed on a CPU names it cpu:0)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device != args.device:
        raise UserError(
            f"model.device={device} but stage=train in one process trains on {args.device}: use "
            f"model.device=cuda, and CUDA_VISIBLE_DEVICES={device.index} to train on that GPU"
        )


def _check_resume(wd: Workdir, info: dict, overwrite: bool) -> None:
    """Refuse to resume checkpoints (``wd.train``) of another backbone / other settings / another
    ``deepspeed=`` (or wipe them with overwrite); the checkpoints of the run that trained the heads in
    ``wd.heads`` are named as such (there is nothing of it to resume).

    ``info`` is this run's ``run.json`` (``settings``: :func:`train_settings`, ``backbone``: its identity,
    ``deepspeed``: :func:`_checkpoint_format`). The backbone counts by content (its fingerprint), not by
    where it lies, so a moved or copied workdir resumes. ``deepspeed`` is no setting (the trained heads
    are the same either way) but decides how checkpoints hold the optimizer state.
    """
    train_dir = wd.train
    path = train_dir / RUN_INFO
    if train_dir.exists() and overwrite and launch.is_main():
        shutil.rmtree(train_dir)
    if path.is_file() and not overwrite:
        old = read_json(
            path,
            repair=f"pass training.overwrite=true to start training again (the checkpoints in {train_dir} are discarded)",
        )
        same_settings = old.get("settings") == info["settings"]
        same_backbone = identity_content(old.get("backbone")) == identity_content(info["backbone"])
        # A run.json written before the preset was recorded resumes as it did then (nothing to compare).
        same_format = "deepspeed" not in old or old["deepspeed"] == info["deepspeed"]
        if not (same_settings and same_backbone and same_format):
            if not same_settings:
                what = describe_diff(old.get("settings"), info["settings"])
            elif not same_backbone:
                what = describe_diff(
                    identity_content(old.get("backbone")), identity_content(info["backbone"])
                )
                what = "the backbone: " + what
            else:
                what = describe_diff({"deepspeed": old.get("deepspeed")}, {"deepspeed": info["deepspeed"]})
            if _finished(wd.heads, old.get("settings")):
                raise UserError(
                    f"{train_dir} holds the checkpoints of the finished run that trained the heads in "
                    f"{wd.heads} (differs in {what}): pass training.overwrite=true to train "
                    "with these settings (its checkpoints are discarded; the heads are replaced once "
                    "training ends), or use another workdir="
                )
            raise UserError(
                f"{train_dir} holds checkpoints of another run (differs in {what}): run with the old values to "
                "resume them, pass training.overwrite=true to discard them, or use another workdir="
            )


def _finished(heads_dir: Path, settings: dict | None) -> bool:
    """Whether the heads in ``heads_dir`` were trained with ``settings`` (a run.json's): that run ended."""
    try:
        return (
            settings is not None
            and read_json(heads_dir / HEADS_CONFIG, repair="").get("training") == settings
        )
    except DamagedArtefactError:
        return False


def _checkpoint_format(cfg: Config) -> str:
    """``none``, ``zero2``, ...: the ``deepspeed=`` preset, which decides how a checkpoint holds the
    optimizer state. The Trainer's own checkpoints hold it in ``optimizer.pt``; DeepSpeed's in its
    ``global_stepN/`` files, partitioned per ZeRO stage. Resumed without DeepSpeed, a DeepSpeed
    checkpoint (which has no ``optimizer.pt``) restarts Adam's moments without a word; the other way
    round, or across ZeRO stages, the load fails deep inside the Trainer or DeepSpeed."""
    return f"zero{cfg.deepspeed.zero_stage}" if cfg.deepspeed.enabled else "none"


# -- training ---------------------------------------------------------------------------------------
def _initial_heads(
    cfg: Config, backbone: PreTrainedModel, identity: dict, token_map: torch.Tensor | None = None
) -> MedusaHeads:
    """Fresh heads (projections copied from lm_head, or bound to it when shared) or
    ``training.init_heads``, checked against the backbone and ``training.head_projection``.

    Args:
        token_map: the draft vocabulary of ``head_projection=truncated`` (None otherwise); heads from
            ``training.init_heads`` keep their own.
    """
    tc = cfg.training
    # d: the width of the last hidden state the heads read, not of what the LM head reads (ELECTRA's
    # prediction head maps it to another), nor always the config's hidden_size (OPT-350m projects it)
    want = (hidden_width(backbone), identity["vocab_size"], tc.num_heads, tc.num_layers)
    if tc.init_heads:
        try:
            heads = MedusaHeads.from_pretrained(tc.init_heads)
        except HeadsFormatError as err:
            raise option_refusal("training.init_heads", err) from None
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


def _attach(heads: MedusaHeads, backbone: PreTrainedModel, cfg: Config) -> MedusaHeads:
    """:meth:`MedusaHeads.attach` with its refusals as one-line user errors."""
    try:
        return heads.attach(backbone)
    except HeadsFormatError as err:
        raise UserError(f"training.head_projection={cfg.training.head_projection}: {err}") from None


def _train(
    cfg: Config,
    recipe: Recipe,
    backbone: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    identity: dict,
    settings: dict,
    train_set: Records,
    ds_config: dict | None,
    device: torch.device,
    token_map: torch.Tensor | None,
) -> tuple[dict | None, MedusaHeads | None, PreTrainedModel | None, dict[str, torch.Tensor] | None]:
    """Step 5: heads, the resume check, the training module, the Trainer run (all ranks), inside the
    stage's :func:`deepspeed_process`.

    Returns:
        ``(figures, trained heads, trained backbone, ZeRO-3 backbone state)`` on rank 0, four Nones
        elsewhere. The trained backbone (Medusa-2; None for Medusa-1) is the module that trained (a
        peft model with LoRA/QLoRA); after ZeRO-3 it is left partitioned, None here, and the state
        holds its consolidated weights instead (by its own parameter names), for
        ``Recipe.rebuild_trained`` once the DeepSpeed process state is released.
    """
    tc, wd = cfg.training, Workdir(Path(cfg.workdir))
    on_cpu = device.type == "cpu"
    # A backbone loaded partitioned (ZeRO-3, Medusa-2): the heads are checked against and copied from
    # its lm_head whole.
    with gathered(backbone.get_output_embeddings().weight):
        heads = _initial_heads(cfg, backbone, identity, token_map).to(device)
    info = {"settings": settings, "backbone": identity, "deepspeed": _checkpoint_format(cfg)}
    _check_resume(wd, info, tc.overwrite)
    wd.train.mkdir(parents=True, exist_ok=True)

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
        ddp_backend="gloo" if on_cpu and launch.world_size() > 1 else None,
        deepspeed=ds_config,
        bf16=not on_cpu and precision == torch.bfloat16,
        fp16=not on_cpu and precision == torch.float16,
        report_to="none",  # our TrackerCallback logs to wandb with an explicit mode (see trainer.py)
        run_name=cfg.tracking.run_name or f"train-{wd.root.resolve().name}",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=False,
        eval_strategy="no",
        ddp_timeout=int(dist.COLLECTIVE_TIMEOUT.total_seconds()),  # transformers': 30 minutes
    )
    one_device_per_process(args, device)
    if args.process_index == 0:
        atomic_write_json(wd.train / RUN_INFO, info)

    # The data the module reads: tokens (online), or the frozen backbone's stored hidden states.
    if tc.cache_hidden_states:  # Medusa-1 only (the config refuses it otherwise)
        dataset, collator = (
            _hidden_cache(
                args, backbone, train_set, wd.train / HIDDEN_CACHE, settings, tc, recipe.head_loss.soft
            ),
            row_collator,
        )
        lm_head = backbone.get_output_embeddings().weight  # (V, d): the soft losses' targets
        model, callbacks, extra = recipe.training_module(
            heads, None, lm_head=lm_head, logit_map=logit_map(backbone)
        )
    else:
        dataset, collator = train_set, PadCollator(tokenizer.pad_token_id or 0)
        model, callbacks, extra = recipe.training_module(heads, backbone)
    if is_zero3(ds_config):  # the losses read these weights directly: ZeRO-3 gathers them for the module
        register_gathered(model, model.directly_read_weights())
    dtypes = own_dtypes(model)  # before DeepSpeed's bf16/fp16 casts them (heads, LoRA adapters: fp32)
    if is_zero3(ds_config):  # beside a backbone loaded partitioned, the engine casts nothing itself
        cast_unpartitioned(model, ds_config)
    last = last_complete_checkpoint(wd.train, remove_incomplete=args.process_index == 0)
    if last:
        check_checkpoint_ranks(Path(last))  # before DeepSpeed stops at it inside the Trainer
        log.info("resuming from %s", last)
    budget = TimeBudgetCallback(tc.max_minutes) if tc.max_minutes else None
    # The run is closed on the way out, as failed if anything raises once it is open; a resumed
    # checkpoint continues the run of the training that wrote it.
    run_config = {"training": asdict(tc), "run": info}
    resume = last is not None
    with start_tracking(cfg.tracking, wd.root, "train", config=run_config, resume=resume) as tracker:
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
            fsync_checkpoints=tc.fsync_checkpoints,
        )
        t0 = time.time()
        try:
            out = trainer.train(resume_from_checkpoint=last)
        except pickle.UnpicklingError:
            if not last:
                raise
            raise refused_pickle(Path(last)) from None
    train_seconds = time.time() - t0
    trained, state = recipe.trained_backbone(model), None
    main = trainer.is_world_process_zero()  # asked before DeepSpeed's process state is released
    # Collectives below: every rank takes part, rank 0 keeps whole weights. Under bf16/fp16 what is
    # published comes from DeepSpeed's fp32 master weights, in the dtype each parameter has without
    # DeepSpeed (empty under fp32: nothing was cast).
    masters = master_weights(model, dtypes, keep=main) if ds_config is not None else {}
    if is_zero3(ds_config):
        heads, state = gather_zero3(trainer, heads, with_backbone=trained is not None, masters=masters)
    if ds_config is not None:
        # Everything below reads plain tensors. (Not needed without DeepSpeed, where nothing
        # stays, and not free: a gc pass, ~0.5 s on a 2-core VM.)
        release_engine(trainer, is_zero3(ds_config))
        if not is_zero3(ds_config):  # ZeRO-1/2: the heads and adapters that trained, whole
            load_masters(model, masters)
    if not main:
        return None, None, None, None

    hist = trainer.head_history  # the last entry: the last step (a stop by the time budget too)
    final = hist[-1] if hist else {}

    def last_logged(key: str) -> float | None:  # top-k: the last step that counted them
        return next((h[key] for h in reversed(hist) if key in h), None)

    result = {
        "mode": tc.mode,
        "steps": trainer.state.global_step,
        "final_loss": round(float(final.get("loss", out.training_loss)), 5),
        "train_top1": [last_logged(f"head{k + 1}/top1") for k in range(tc.num_heads)],
        "train_top5": [last_logged(f"head{k + 1}/top5") for k in range(tc.num_heads)],
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
    return result, heads, None if state is not None else trained, state


def _hidden_cache(
    args: TrainingArguments,
    backbone: PreTrainedModel,
    train_set: Records,
    directory: Path,
    settings: dict,
    tc: TrainingConfig,
    soft: bool,
) -> HiddenCache:
    """The frozen backbone's hidden states of the training split, built once by rank 0 (resumable)
    and stored with the run's settings: checkpoints of another run are refused or wiped with it anyway."""
    cache_settings = settings_of(run=settings, cache_version=HIDDEN_CACHE_VERSION)
    # Global rank 0 builds it (local=False: on several nodes every other rank waits for it, not only
    # node 0's), under the Trainer's group, whose timeout is dist's (ddp_timeout): a build takes hours.
    with args.main_process_first(local=False, desc="hidden-state cache"):
        if args.process_index == 0:
            t0 = time.time()
            records = [train_set[i] for i in range(len(train_set))]
            build_hidden_cache(
                backbone,
                records,
                directory,
                tc.num_heads,
                cache_settings,
                tc.per_device_batch_size,
                soft=soft,
            )
            log.info("hidden-state cache ready in %.1fs", time.time() - t0)
    return HiddenCache(directory)


# -- publishing -------------------------------------------------------------------------------------
def _print_summary(result: dict) -> None:
    lines = [
        f"train: {result['steps']} steps, final loss {result['final_loss']}, {result['tokens_per_s']} tokens/s"
    ]
    for k, (t1, t5) in enumerate(zip(result["heldout_top1"], result["heldout_top5"], strict=True)):
        lines.append(f"  head {k + 1}: held-out top-1 {t1:.3f}  top-5 {t5:.3f}")
    lines.append(f"  tree: {result['tree_size']} nodes, expected tau {result['expected_tau']}")
    print("\n".join(lines), flush=True)
