"""Hugging Face ``Trainer`` pieces for Medusa: data collation, metrics, checkpoints, callbacks.

The stage (``medusa_train/stages/train.py``) assembles these; nothing here reads the Hydra config.
Per-head loss / top-1 / top-5 are summed over the micro-batches between two logging steps and across
processes, and added to the Trainer's logs (``head{k}/loss``, ``head{k}/top1``, ``head{k}/top5``;
Medusa-2 also ``lm_loss`` and ``lambda0``), which go to wandb through ``TrackerCallback`` (our tracker,
explicit mode). A logged loss is each of its terms' per-token mean over those micro-batches (the terms
of the optimised loss are normalised per token too); top-1/top-5 are counted on the logging step only
(:class:`MetricsScheduleCallback`).
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import shutil
import time
import warnings
import zipfile
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, PREFIX_CHECKPOINT_DIR, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import rotate_checkpoints
from transformers.utils import SAFE_WEIGHTS_NAME

from medusa_train.errors import DamagedArtefactError, HeadsFormatError, UserError
from medusa_train.head_targets import IGNORE_INDEX
from medusa_train.safetensors_check import safetensors_shapes
from medusa_train.training.losses import lambda0_schedule
from medusa_train.training.optim import FreezableAdamW, param_groups
from medusa_train.training.zero import MODULE_STATE_SHARD, OPTIMIZER_STATE_FILE
from medusa_train.workdir import fsync_dir, fsync_tree, read_json

log = logging.getLogger(__name__)


# -- data -------------------------------------------------------------------------------------------
class PadCollator:
    """Right-pads ``input_ids`` / ``loss_mask`` records into ``(B, T)`` tensors + ``attention_mask``."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, records: list[dict]) -> dict[str, torch.Tensor]:
        t = max(len(r["input_ids"]) for r in records)
        ids = torch.full((len(records), t), self.pad_token_id, dtype=torch.long)  # (B, T)
        attn = torch.zeros((len(records), t), dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(records), t), dtype=torch.long)  # (B, T)
        for i, r in enumerate(records):
            n = len(r["input_ids"])
            ids[i, :n] = torch.as_tensor(r["input_ids"])
            attn[i, :n] = 1
            mask[i, :n] = torch.as_tensor(r["loss_mask"])
        return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}


def row_collator(records: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenates cached rows: ``hidden_states (N, d)``, ``targets (N, K)`` and, when the records
    have them, ``sources (N, K)`` (record-local rows shifted to rows of the batch)."""
    out = {
        "hidden_states": torch.cat([r["hidden_states"] for r in records]),
        "targets": torch.cat([r["targets"] for r in records]),
    }
    if "sources" in records[0]:
        parts, base = [], 0
        for r in records:
            src = r["sources"]  # (n, K)
            parts.append(torch.where(src == IGNORE_INDEX, IGNORE_INDEX, src + base))
            base += r["hidden_states"].shape[0]
        out["sources"] = torch.cat(parts)
    return out


# -- trainer ----------------------------------------------------------------------------------------
class MedusaTrainer(Trainer):
    """``Trainer`` with Medusa's optimizer groups and per-head metrics in the logs, whose checkpoints
    are on disk when saved.

    Args:
        head_lr_multiplier: heads lr = lr * multiplier (medusa2; 1.0 in medusa1 where only heads train).
        fsync_checkpoints: flush each checkpoint to disk before training goes on and before the
            rotation deletes an older one (:meth:`_save_checkpoint`); False saves as the Trainer does.
        All other arguments go to ``transformers.Trainer``.
    """

    def __init__(
        self, *args, head_lr_multiplier: float = 1.0, fsync_checkpoints: bool = True, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.head_lr_multiplier = head_lr_multiplier
        self.fsync_checkpoints = fsync_checkpoints
        # Summed since the last log, (7K + 3,): every loss term summed over its rows and those rows (each
        # (2K + 1,), MedusaTrainingModel.forward's loss_sums / loss_rows), top-1 and top-5 hits, the
        # targets of the micro-batches that counted them (each (K,)), the Medusa-2 joint micro-batches.
        self._sums: torch.Tensor | None = None
        self.head_history: list[dict] = []

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            groups = param_groups(
                self.model if model is None else model,
                self.args.learning_rate,
                self.args.weight_decay,
                self.head_lr_multiplier,
            )
            self.optimizer = FreezableAdamW(
                groups,
                lr=self.args.learning_rate,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
            )
        return self.optimizer

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Our module is not a PreTrainedModel, so the Trainer writes its state dict with safetensors,
        # which refuses two names for one memory: Medusa-2 over a backbone with tied input/output
        # embeddings (the embedded tiny one, many small models) failed at the first checkpoint.
        state = self.model.state_dict() if state_dict is None else state_dict
        super()._save(output_dir, state_dict=unshared(state))

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's save of ``checkpoint-N``, with the new checkpoint on disk before the rotation
        deletes any older one (``fsync_checkpoints``).

        The Trainer and DeepSpeed write their files without fsync, and the Trainer deletes the
        checkpoints beyond ``save_total_limit`` at the end of its save, before any callback runs: a
        power loss then could leave the new checkpoint damaged (an empty optimizer.pt beside a
        trainer_state.json that reached the disk: :func:`checkpoint_problem` skips it) and, with a
        limit of 1, no older one to resume from. Here the rotation waits: every process flushes the
        checkpoint once its own part is written (:func:`flush_checkpoint`: each rank its RNG state
        and DeepSpeed shards; on a shared disk a file another rank already flushed costs nothing),
        the processes wait for one another, then the saving ones delete what the Trainer would and
        flush ``train/`` again (the deletions).

        Cost, measured on a 2-core VM (2026-12-07): the write-back the disk does anyway, waited for
        once per ``training.save_steps``. The tests' tiny checkpoint (6 files, 140 KB): 2-3 ms (the
        first ~10 ms) beside ~8 ms for the Trainer's save of it. A 256 MB file: 0.46 s after a
        0.57 s ``torch.save``, so a large checkpoint's save takes up to about twice as long.
        """
        if not self.fsync_checkpoints:
            super()._save_checkpoint(model, trial)
            return
        # transformers 5.24's _save_checkpoint reads save_total_limit only as it rotates, at its end, through
        # trainer_utils.rotate_checkpoints, a module function (no Trainer method to override); nothing it
        # calls before reads it (save_model, the optimizer's, RNG and state files, push_to_hub), and the
        # callbacks that do (ClearML's) run after it returns. Setting it aside for the call is the hook.
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # the Trainer's rotation: below, once the new one is on disk
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        run_dir = Path(self._get_output_dir(trial=trial))
        flush_checkpoint(run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if limit is not None and limit > 0:
            self.accelerator.wait_for_everyone()  # every rank's files on disk before anything is deleted
            if self.args.should_save:
                rotate_checkpoints(
                    output_dir=str(run_dir),
                    save_total_limit=limit,
                    best_model_checkpoint=self.state.best_model_checkpoint,
                    use_mtime=True,
                )
                fsync_dir(run_dir)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The optimizer step's micro-batches and what each loss term of the step is divided by: its
        counted rows over all of them and over every rank (:meth:`MedusaTrainingModel.loss_counts`).

        With these the micro-batches' losses add up to the step's per-token mean: the same gradient
        whether the step's records come as one micro-batch or as several (``per_device_batch_size`` x
        ``gradient_accumulation_steps`` x processes are run-only settings), where the Trainer's own
        normalisation (each micro-batch's mean divided by the accumulation steps) weighs a token of a
        micro-batch with few targets more than one of a micro-batch with many.
        """
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batches:
            return batches, None
        counts = sum(self.model.loss_counts(batch) for batch in batches)  # (2K + 1,)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            counts = counts.to(self.args.device)
            torch.distributed.all_reduce(counts)  # every rank fetches its step's batches here
        return batches, counts.cpu()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, step_counts=num_items_in_batch)
        if num_items_in_batch is not None and self.accelerator.num_processes > 1:
            # The counts are the global step's, but DDP and DeepSpeed average the ranks' gradients.
            outputs["loss"] = outputs["loss"] * self.accelerator.num_processes
        if model.training:
            metrics_on = float(model_metrics_on(model))
            stats = torch.cat(
                [
                    outputs["loss_sums"].float(),
                    outputs["loss_rows"].float(),
                    outputs["head_top1"].float(),
                    outputs["head_top5"].float(),
                    outputs["head_count"].float() * metrics_on,
                    outputs["loss_sums"].new_full((1,), float("lm_loss" in outputs)),
                ]
            ).detach()  # (7K + 3,)
            self._sums = stats if self._sums is None else self._sums + stats
        return (outputs["loss"], outputs) if return_outputs else outputs["loss"]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every rank reaches a logging step together (the Trainer gathers the loss there too),
        # so the all-reduce below cannot deadlock.
        if "loss" in logs and self._sums is not None:
            sums = self._sums.to(self.args.device)  # one all-reduce for every figure
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(sums)
            k_heads = (sums.numel() - 3) // 7
            n = 2 * k_heads + 1
            loss_sums, loss_rows, top1, top5, metric_count, joint = sums.split([n, n, *[k_heads] * 3, 1])
            # Each term's per-token mean over the micro-batches since the last log (every rank's): the
            # optimised loss divides each term by its own rows too.
            means = loss_sums / loss_rows.clamp_min(1)  # (2K + 1,): CE per head, soft terms per head, LM
            for k in range(k_heads):
                logs[f"head{k + 1}/loss"] = round(float(means[k] + means[k_heads + k]), 5)
                if metric_count[k] > 0:  # no top-k counted since the last log (a stop by the time budget)
                    logs[f"head{k + 1}/top1"] = round(float(top1[k] / metric_count[k]), 5)
                    logs[f"head{k + 1}/top5"] = round(float(top5[k] / metric_count[k]), 5)
            if joint > 0:  # Medusa-2 joint steps since the last log: the LM loss and the heads' weight
                logs["lm_loss"] = round(float(means[2 * k_heads]), 5)
                logs["lambda0"] = round(float(self.model.lambda0), 5)
            self.head_history.append({"step": self.state.global_step, **logs})
            self._sums = None
        super().log(logs, start_time)


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` where a tensor whose memory an earlier entry already uses is a copy (safetensors
    refuses shared memory). Resuming loads both names into the one tied parameter: same values.
    A state dict without shared memory (Medusa-1: the heads) comes back unchanged."""
    seen: set[tuple[str, int]] = set()
    out = {}
    for name, tensor in state.items():
        key = (str(tensor.device), tensor.untyped_storage().data_ptr())
        out[name] = tensor.clone() if tensor.numel() and key in seen else tensor
        if tensor.numel():
            seen.add(key)
    return out


def model_metrics_on(model) -> bool:
    """Whether the (possibly DeepSpeed/DDP-wrapped) training module counts top-k hits right now."""
    return bool(getattr(getattr(model, "module", model), "with_metrics", True))


# -- checkpoints ------------------------------------------------------------------------------------
def last_complete_checkpoint(train_dir: Path, remove_incomplete: bool = False) -> str | None:
    """The newest ``checkpoint-N`` whose save finished (the Trainer writes trainer_state.json last)
    and whose files are whole (:func:`checkpoint_problem`).

    A run killed while saving leaves a newer, incomplete folder; a full disk, a power loss before the
    checkpoint reached the disk, a damaged disk or a bad copy a checkpoint with an empty or truncated
    file. Either is skipped with one warning naming the file (and removed when ``remove_incomplete``),
    so the same command resumes from the previous checkpoint.
    """
    found = sorted(
        (int(p.name.split("-")[1]), p)
        for p in train_dir.glob("checkpoint-*")
        if p.is_dir() and p.name.split("-")[1].isdigit()
    )
    for _, path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        log.warning("ignoring checkpoint %s: %s", path, problem)
        if remove_incomplete:
            shutil.rmtree(path, ignore_errors=True)
    return None


def flush_checkpoint(folder: Path) -> None:
    """fsync every file and folder of the Trainer checkpoint ``folder``, then the folder holding it
    (its name); nothing where this process has no such folder."""
    if folder.is_dir():
        fsync_tree(folder)
        fsync_dir(folder.parent)


TORCH_ARCHIVE_SUFFIXES = (".pt", ".pth", ".bin")
"""What ``torch.save`` writes in a Trainer checkpoint: optimizer, scheduler, RNG state, training
arguments, DeepSpeed's module and optimizer shards."""

RNG_STATE_OF_RANK = re.compile(r"rng_state_(\d+)\.pth")
"""The Trainer's RNG state of one rank in a checkpoint of several (one process: ``rng_state.pth``)."""

DEEPSPEED_LATEST = "latest"
"""DeepSpeed's file naming the ``global_stepN`` folder its resume loads (the Trainer passes no tag)."""


def checkpoint_problem(path: Path) -> str | None:
    """Why the Trainer checkpoint ``path`` cannot be resumed from, or None.

    Looks at every file the resume reads, cheaply (sizes, headers, a zip's end records; never the
    weights): each is there (the Trainer resumes without optimizer.pt or scheduler.pt silently, with a
    fresh optimizer), none is empty, and :func:`file_damage` finds nothing. DeepSpeed's ``latest``
    names a ``global_stepN`` folder of the checkpoint holding the module's states.

    Raises:
        UserError: a file cannot be read for another reason than its absence (EIO, EACCES, a stale
            NFS handle): a checkpoint that may be whole is never taken for a damaged one (deleted).
    """
    state = path / TRAINER_STATE_NAME
    if not state.is_file():
        return "incomplete (killed while saving)"
    try:
        state.open("rb").close()  # unreadable: the OSError below, not damage
        try:
            read_json(state, repair="", keys=("global_step",))
        except DamagedArtefactError:
            return f"{TRAINER_STATE_NAME} is damaged"
        files = sorted(p for p in path.rglob("*") if p.is_file())
        deepspeed = any(p.is_dir() for p in path.glob("global_step*"))
        needed = [SCHEDULER_NAME] if deepspeed else [SAFE_WEIGHTS_NAME, OPTIMIZER_NAME, SCHEDULER_NAME]
        for name in needed:
            if not (path / name).is_file():
                return f"{name} is missing"
        if not any(path.glob("rng_state*.pth")):
            return "rng_state.pth is missing"
        if deepspeed:
            problem = _deepspeed_latest_problem(path)
            if problem is not None:
                return problem
        problem = _missing_rank_files(path, files)
        if problem is not None:
            return problem
        for file in files:
            try:
                damage = file_damage(file)
            except HeadsFormatError as err:  # names the file already
                return str(err)
            if damage is not None:
                return f"{file.relative_to(path)} is damaged ({damage})"
    except FileNotFoundError:  # deleted while looked at (rank 0 removing it)
        return "removed while being checked"
    except OSError as err:  # not damage: a disk error or permissions, which deleting it would not mend
        raise UserError(
            f"cannot read checkpoint {path} ({err.strerror or err}: {err.filename or path}): fix the disk "
            "or the permissions, then run the same command again (nothing was deleted)"
        ) from None
    return None


def file_damage(file: Path) -> str | None:
    """What is visibly wrong with the checkpoint file ``file``, or None: empty, a JSON file that does
    not parse, a torch archive (``TORCH_ARCHIVE_SUFFIXES``) whose zip lacks its end records (cut
    short: they come last). Reads the head and the end of a file, never its data. A torch file in the
    format before zip (a bare pickle) passes: only ``torch.load`` can check it.

    Raises:
        HeadsFormatError: a safetensors file whose header does not parse or announces more or fewer
            bytes than the file holds (:func:`safetensors_shapes`).
        OSError: the file cannot be read.
    """
    if file.stat().st_size == 0:
        return "empty (0 bytes)"
    if file.suffix == ".safetensors":
        safetensors_shapes(file)
    elif file.suffix == ".json":
        try:
            json.loads(file.read_bytes())
        except (ValueError, RecursionError):
            return "not valid JSON"
    elif file.suffix in TORCH_ARCHIVE_SUFFIXES:
        with open(file, "rb") as fh:
            magic = fh.read(4)
        if magic.startswith(b"\x80"):  # a pickle's PROTO opcode: torch.save's format before zip
            return None
        if magic != b"PK\x03\x04":
            return "not a torch archive"
        try:
            with zipfile.ZipFile(file):  # reads the end record and the central directory only
                pass
        except (zipfile.BadZipFile, ValueError, EOFError):
            return f"cut short: its zip archive has no valid end record ({file.stat().st_size} bytes)"
    return None


def _deepspeed_latest_problem(path: Path) -> str | None:
    """What is wrong with DeepSpeed's ``latest`` file of the checkpoint ``path``, or None."""
    latest = path / DEEPSPEED_LATEST
    if not latest.is_file():
        return f"{DEEPSPEED_LATEST} is missing"
    tag = latest.read_text(errors="replace").strip()
    if not tag or not (path / tag).is_dir() or not any((path / tag).glob("*model_states.pt")):
        return f"{DEEPSPEED_LATEST} is damaged (names no folder of the checkpoint with the module's states)"
    return None


def _missing_rank_files(path: Path, files: list[Path]) -> str | None:
    """Which files one rank writes (RNG state, ZeRO optimizer and ZeRO-3 module shards) some rank of
    the checkpoint ``path`` lacks, or None.

    The ranks that wrote it are counted from every such file (the highest rank any names, plus one):
    a rank whose RNG state is there but whose shard is missing is named, not taken for a checkpoint
    of fewer ranks. A last rank that wrote none of its files cannot be told from a run without it.
    """
    written: dict[tuple[Path, re.Pattern], dict[int, Path]] = {}
    for file in files:
        for pattern in (RNG_STATE_OF_RANK, OPTIMIZER_STATE_FILE, MODULE_STATE_SHARD):
            if match := pattern.fullmatch(file.name):
                written.setdefault((file.parent, pattern), {})[int(match.group(1))] = file
    ranks = 1 + max((rank for of_kind in written.values() for rank in of_kind), default=-1)
    missing = []
    for (_, pattern), of_kind in written.items():
        sample = next(iter(of_kind.values()))
        start, end = pattern.fullmatch(sample.name).span(1)
        for rank in sorted(set(range(ranks)) - set(of_kind)):
            name = sample.parent / f"{sample.name[:start]}{rank}{sample.name[end:]}"
            missing.append((rank, str(name.relative_to(path))))
    if not missing:
        return None
    names = ", ".join(name for _, name in sorted(missing))
    lacking = sorted({rank for rank, _ in missing})
    which = f"rank{'s' if len(lacking) > 1 else ''} {', '.join(map(str, lacking))}"
    return f"{names} {'is' if len(missing) == 1 else 'are'} missing ({which} of the {ranks} that wrote it)"


def refused_pickle(checkpoint: Path) -> DamagedArtefactError:
    """The one-line error for a checkpoint whose ``.pt``/``.pth`` file (optimizer, scheduler, RNG
    state) holds more than tensors and plain values: ``torch.load(weights_only=True)``, as the Trainer
    resumes, refuses it without running it. Names the first such file (the folder if none reloads
    that way now) and the fix."""
    culprit: Path = checkpoint
    for file in sorted([*checkpoint.glob("*.pt"), *checkpoint.glob("*.pth")]):
        try:
            with warnings.catch_warnings():  # torch warns about the pickle protocol of the very file refused
                warnings.simplefilter("ignore")
                torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            culprit = file
            break
        except Exception:  # damaged otherwise: the refusal below still names the checkpoint
            continue
    return DamagedArtefactError(
        f"{culprit} holds a pickle that is not plain tensors (refused, not run): resume from a checkpoint you "
        f"trust by deleting {checkpoint} (the run resumes from the one before it), or pass "
        "training.overwrite=true to train from scratch"
    )


# -- callbacks --------------------------------------------------------------------------------------
class MetricsScheduleCallback(TrainerCallback):
    """Top-1/top-5 cost one more logits pass: count them only on the steps that get logged.

    The logged losses cover every micro-batch since the last log; top-1/top-5 the logging step's own
    micro-batches (a step counted but not logged would be pooled into the next log). The last step is
    logged too (the Trainer logs only multiples of ``logging_steps``): the final loss and top-k of
    ``training_result`` are those of the end of training, not of the last multiple before it.
    """

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            step = state.global_step + 1  # the step about to run
            # The Trainer logs on its state's logging_steps: after a resume, the checkpoint's.
            logged = step % state.logging_steps == 0 or (step == 1 and args.logging_first_step)
            getattr(model, "module", model).with_metrics = logged or step == state.max_steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_log = True
        return control


class TrackerCallback(TrainerCallback):
    """Sends the Trainer's logged figures (loss, lr, per-head loss/top-1/top-5) to our wandb tracker.

    We do not use ``report_to="wandb"``: the Hugging Face integration calls ``wandb.init`` without a
    mode, and wandb reads ``WANDB_MODE`` only once per process, so after an earlier stage's run in
    ``stage=all`` it asked for a login instead of staying offline.
    """

    def __init__(self, tracker) -> None:
        self.tracker = tracker

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and state.is_world_process_zero:
            figures = {f"train/{k}": v for k, v in logs.items() if isinstance(v, (int, float))}
            self.tracker.log(figures, step=state.global_step)


class TimeBudgetCallback(TrainerCallback):
    """Stops training cleanly (with a checkpoint and a log) once ``max_minutes`` of optimisation have passed."""

    def __init__(self, max_minutes: float) -> None:
        self.max_seconds = max_minutes * 60
        self.start = time.time()
        self.stopped_early = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        elapsed = torch.tensor(time.time() - self.start)
        # Ranks must agree on stopping: use rank 0's clock.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            elapsed = elapsed.to(args.device)
            torch.distributed.broadcast(elapsed, src=0)
        if float(elapsed) >= self.max_seconds:
            self.stopped_early = True
            control.should_training_stop = True
            control.should_save = True
            control.should_log = True  # the figures of the last step (and those since the last log)
        return control


class Lambda0Callback(TrainerCallback):
    """Medusa-2: sets ``model.lambda0`` from the warm-up schedule before every optimizer step.

    The warm-up counts from ``start_step`` (the end of the heads-only phase): Medusa's two-stage
    recipe trains the heads alone first, then warms lambda0 up during joint training.
    """

    def __init__(self, model, final: float, warmup_steps: int, kind: str, start_step: int = 0) -> None:
        self.model, self.final, self.warmup_steps, self.kind = model, final, warmup_steps, kind
        self.start_step = start_step

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step - self.start_step  # < 0 in the heads-only phase (the schedule clamps it)
        self.model.lambda0 = lambda0_schedule(step, self.final, self.warmup_steps, self.kind)
