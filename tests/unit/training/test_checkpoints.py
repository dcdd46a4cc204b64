"""Trainer checkpoints: which one a run resumes from (a damaged or missing file skips it, read
cheaply) and each one flushed to disk when the Trainer saves it, before an older one is deleted.

The checkpoints here are built by hand in the Trainer's layout (plain and DeepSpeed's), from real
``torch.save`` / safetensors files; tests/stages/test_train.py resumes a real damaged one.
"""

from __future__ import annotations

import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from medusa_train.heads import MedusaHeads
from medusa_train.training.model import MedusaTrainingModel
from medusa_train.training.trainer import (
    MedusaTrainer,
    PadCollator,
    checkpoint_problem,
    file_damage,
    flush_checkpoint,
    last_complete_checkpoint,
)
from tests.helpers.syncs import record_syncs
from tests.helpers.training import VOCAB, cpu_training_args, tiny_llama, trainer_checkpoint


def _truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def test_whole_checkpoints_pass(tmp_path: Path) -> None:
    for deepspeed in (False, True):
        path = trainer_checkpoint(tmp_path / str(deepspeed), 3, deepspeed=deepspeed)
        assert checkpoint_problem(path) is None


# (file, how it is damaged) -> what the problem names
DAMAGE = {
    "truncated optimizer": ("optimizer.pt", lambda f: _truncate(f), "optimizer.pt is damaged (cut short"),
    "optimizer cut by a block": ("optimizer.pt", lambda f: _truncate(f, 0.99), "optimizer.pt is damaged"),
    "empty scheduler": ("scheduler.pt", lambda f: f.write_bytes(b""), "scheduler.pt is damaged (empty"),
    "zeros for the rng state": (
        "rng_state.pth",
        lambda f: f.write_bytes(bytes(f.stat().st_size)),
        "rng_state.pth is damaged (not a torch archive)",
    ),
    "truncated training args": ("training_args.bin", lambda f: _truncate(f), "training_args.bin is damaged"),
    "truncated weights": ("model.safetensors", lambda f: _truncate(f), "model.safetensors: truncated"),
    "missing optimizer": ("optimizer.pt", lambda f: f.unlink(), "optimizer.pt is missing"),
    "missing scheduler": ("scheduler.pt", lambda f: f.unlink(), "scheduler.pt is missing"),
    "missing weights": ("model.safetensors", lambda f: f.unlink(), "model.safetensors is missing"),
    "missing rng state": ("rng_state.pth", lambda f: f.unlink(), "rng_state.pth is missing"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_or_missing_file_is_named(tmp_path: Path, case: str) -> None:
    name, damage, problem = DAMAGE[case]
    path = trainer_checkpoint(tmp_path, 3)
    damage(path / name)
    assert problem in checkpoint_problem(path)


DEEPSPEED_DAMAGE = {
    "truncated optimizer shard": (
        "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        lambda f: _truncate(f),
        "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt is damaged (cut short",
    ),
    "empty module states": (
        "global_step3/mp_rank_00_model_states.pt",
        lambda f: f.write_bytes(b""),
        "mp_rank_00_model_states.pt is damaged (empty",
    ),
    "missing module states": (
        "global_step3/mp_rank_00_model_states.pt",
        lambda f: f.unlink(),
        "latest is damaged",
    ),
    "empty latest": ("latest", lambda f: f.write_text(""), "latest is damaged"),
    "latest naming another step": ("latest", lambda f: f.write_text("global_step9"), "latest is damaged"),
    "missing latest": ("latest", lambda f: f.unlink(), "latest is missing"),
    "empty recovery script": ("zero_to_fp32.py", lambda f: f.write_bytes(b""), "zero_to_fp32.py is damaged"),
}


@pytest.mark.parametrize("case", DEEPSPEED_DAMAGE)
def test_a_damaged_deepspeed_file_is_named(tmp_path: Path, case: str) -> None:
    name, damage, problem = DEEPSPEED_DAMAGE[case]
    path = trainer_checkpoint(tmp_path, 3, deepspeed=True)
    damage(path / name)
    assert problem in checkpoint_problem(path)


def _bytes_read() -> int:
    """What this process has read so far (``rchar``: every read call's bytes, cached or not)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_checking_a_checkpoint_reads_none_of_its_data(tmp_path: Path) -> None:
    """Headers and a zip's end records only: checking a checkpoint whose files hold 32 MiB of tensors
    reads a few KiB of them."""
    if not Path("/proc/self/io").is_file():
        pytest.skip("needs /proc/self/io to count the bytes read")
    path = trainer_checkpoint(tmp_path, 3)
    torch.save({"state": {0: {"exp_avg": torch.zeros(4 << 20)}}}, path / "optimizer.pt")  # 16 MiB
    save_file({"heads.0.weight": torch.zeros(4 << 20)}, str(path / "model.safetensors"))  # 16 MiB
    before = _bytes_read()
    assert checkpoint_problem(path) is None
    assert _bytes_read() - before < 512 << 10


def test_a_torch_file_of_the_format_before_zip_is_left_to_torch_load(tmp_path: Path) -> None:
    """A bare pickle (torch.save's legacy format, or a hostile file the resume refuses in one line:
    training.trainer.refused_pickle) is not called damaged: only torch.load can judge it."""
    legacy = tmp_path / "scheduler.pt"
    torch.save({"last_epoch": 3}, legacy, _use_new_zipfile_serialization=False)
    assert file_damage(legacy) is None
    (tmp_path / "optimizer.pt").write_bytes(pickle.dumps({"state": {}}))
    assert file_damage(tmp_path / "optimizer.pt") is None


def test_invalid_json_is_damage(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"a": ')
    assert file_damage(tmp_path / "x.json") == "not valid JSON"
    (tmp_path / "y.json").write_text("[1, 2]")
    assert file_damage(tmp_path / "y.json") is None


def test_a_damaged_newest_checkpoint_falls_back_with_one_warning(tmp_path: Path, caplog) -> None:
    """The newest checkpoint's optimizer.pt cut short: the one before it is resumed, one warning line
    names the file, and the damaged one is removed when asked (as an incomplete one)."""
    train = tmp_path / "train"
    for step in (2, 4):
        trainer_checkpoint(train, step)
    _truncate(train / "checkpoint-4" / "optimizer.pt")
    with caplog.at_level(logging.WARNING, logger="medusa_train.training.trainer"):
        assert last_complete_checkpoint(train) == str(train / "checkpoint-2")
    assert [r.getMessage() for r in caplog.records] == [
        f"ignoring checkpoint {train / 'checkpoint-4'}: optimizer.pt is damaged "
        f"(cut short: its zip archive has no valid end record "
        f"({(train / 'checkpoint-4' / 'optimizer.pt').stat().st_size} bytes))"
    ]
    assert last_complete_checkpoint(train, remove_incomplete=True) == str(train / "checkpoint-2")
    assert sorted(p.name for p in train.iterdir()) == ["checkpoint-2"]


@pytest.mark.parametrize("deepspeed", [False, True])
def test_a_whole_checkpoint_of_several_ranks_passes(tmp_path: Path, deepspeed: bool) -> None:
    assert checkpoint_problem(trainer_checkpoint(tmp_path, 3, deepspeed=deepspeed, ranks=4)) is None


def _zero3(path: Path) -> None:
    """ZeRO-3's module states instead of ZeRO-1/2's: one shard per rank, not one file whole."""
    tag = path / "global_step3"
    for rank in (0, 1):
        torch.save(
            {"module": {"w": torch.zeros(32)}}, tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        )
    (tag / "mp_rank_00_model_states.pt").unlink()


# (ranks, what is removed, ZeRO-3) -> what the problem says
MISSING_RANK_FILES = {
    "the last rank's optimizer shard": (
        2,
        ["global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"],
        False,
        "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt is missing (rank 1 of the 2 that wrote it)",
    ),
    "the first rank's optimizer shard": (
        2,
        ["global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt"],
        False,
        "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt is missing (rank 0 of the 2 that wrote it)",
    ),
    "two ranks' shards of four": (
        4,
        [
            "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "global_step3/zero_pp_rank_3_mp_rank_00_optim_states.pt",
        ],
        False,
        "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt, global_step3/zero_pp_rank_3_mp_rank_00_optim_states.pt "
        "are missing (ranks 1, 3 of the 4 that wrote it)",
    ),
    "a rank's RNG state": (
        2,
        ["rng_state_1.pth"],
        False,
        "rng_state_1.pth is missing (rank 1 of the 2 that wrote it)",
    ),
    "a ZeRO-3 module shard": (
        2,
        ["global_step3/zero_pp_rank_1_mp_rank_00_model_states.pt"],
        True,
        "global_step3/zero_pp_rank_1_mp_rank_00_model_states.pt is missing (rank 1 of the 2 that wrote it)",
    ),
}


@pytest.mark.parametrize("case", MISSING_RANK_FILES)
def test_a_missing_file_of_one_rank_is_named_with_its_rank(tmp_path: Path, caplog, case: str) -> None:
    """One rank's shard (or RNG state) missing is named, with the rank, as the reason the checkpoint
    is skipped: the ranks that wrote it are counted from every rank's files, so a checkpoint of 2
    ranks lacking one shard is not taken for a checkpoint of 1 (refused as written by 1 rank, or
    resumed by 1 process where DeepSpeed would stop at it)."""
    ranks, removed, zero3, problem = MISSING_RANK_FILES[case]
    train = tmp_path / "train"
    trainer_checkpoint(train, 2, deepspeed=True, ranks=ranks)
    path = trainer_checkpoint(train, 3, deepspeed=True, ranks=ranks)
    if zero3:
        _zero3(path)
    for name in removed:
        (path / name).unlink()
    assert checkpoint_problem(path) == problem
    with caplog.at_level(logging.WARNING, logger="medusa_train.training.trainer"):
        assert last_complete_checkpoint(train) == str(train / "checkpoint-2")
    assert [r.getMessage() for r in caplog.records] == [f"ignoring checkpoint {path}: {problem}"]


@pytest.mark.parametrize("deepspeed", [False, True])
def test_flush_checkpoint_flushes_every_file_and_folder_of_the_checkpoint(
    tmp_path: Path, monkeypatch, deepspeed: bool
) -> None:
    train = tmp_path / "train"
    path = trainer_checkpoint(train, 6, deepspeed=deepspeed)
    trainer_checkpoint(train, 3)  # an older one: already flushed at its own save
    events = record_syncs(monkeypatch)
    flush_checkpoint(path)
    synced = {p for kind, p, _ in events if kind == "fsync"}
    everything = {p.resolve() for p in [path, *path.rglob("*")]}
    assert synced == everything | {train.resolve()}


def _train_saving_every_step(tmp_path: Path, monkeypatch, fsync_checkpoints: bool) -> tuple[Path, list]:
    """Two optimizer steps of a real MedusaTrainer (Medusa-1 heads on the tiny Llama), a checkpoint
    after each and one kept (``save_total_limit=1``): ``train/`` and every fsync and folder deletion
    in order (``("fsync", path, None)``, ``("rmtree", path, None)``)."""
    backbone = tiny_llama()
    torch.manual_seed(0)
    heads = MedusaHeads(32, VOCAB, 2, 1)
    heads.init_from_lm_head(backbone.get_output_embeddings().weight)
    g = torch.Generator().manual_seed(0)
    records = [{"input_ids": torch.randint(2, VOCAB, (9,), generator=g).tolist(), "loss_mask": [1] * 9}] * 2
    train = tmp_path / "train"
    args = cpu_training_args(
        train, per_device_train_batch_size=1, max_steps=2, save_steps=1, save_total_limit=1
    )
    trainer = MedusaTrainer(
        model=MedusaTrainingModel(heads, backbone, chunk_size=4),
        args=args,
        train_dataset=records,
        data_collator=PadCollator(0),
        fsync_checkpoints=fsync_checkpoints,
    )
    events = record_syncs(monkeypatch)
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs) -> None:
        events.append(("rmtree", Path(path).resolve(), None))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    trainer.train()
    return train.resolve(), events


def test_the_new_checkpoint_is_on_disk_before_the_rotation_deletes_the_older_one(
    tmp_path: Path, monkeypatch
) -> None:
    """With save_total_limit=1 the Trainer deletes the previous checkpoint as it saves a new one:
    every file and folder of the new one, and its name in train/, are fsynced before that deletion
    (a power loss in between leaves a checkpoint to resume from), and train/ after it."""
    train, events = _train_saving_every_step(tmp_path, monkeypatch, fsync_checkpoints=True)
    new, old = train / "checkpoint-2", train / "checkpoint-1"
    assert sorted(p.name for p in train.iterdir()) == ["checkpoint-2"]
    deletion = events.index(("rmtree", old, None))
    before = {path for kind, path, _ in events[:deletion] if kind == "fsync"}
    assert {new, *new.rglob("*"), train} <= before
    assert ("fsync", train, None) in events[deletion + 1 :]


@pytest.mark.parametrize("fsync_checkpoints", [True, False])
def test_fsync_checkpoints_false_saves_without_fsync(tmp_path: Path, monkeypatch, fsync_checkpoints) -> None:
    """training.fsync_checkpoints=false: the Trainer's save and rotation as they are, nothing
    fsynced; true (the default): every file and folder of each checkpoint saved."""
    train, events = _train_saving_every_step(tmp_path, monkeypatch, fsync_checkpoints)
    assert sorted(p.name for p in train.iterdir()) == ["checkpoint-2"]  # rotated either way
    synced = {path for kind, path, _ in events if kind == "fsync"}
    new = train / "checkpoint-2"
    if fsync_checkpoints:
        assert {new, *new.rglob("*"), train, train / "checkpoint-1" / "trainer_state.json"} <= synced
    else:
        assert synced == set()


@pytest.mark.parametrize("name", ["optimizer.pt", "trainer_state.json"])
def test_a_file_that_cannot_be_read_is_one_line_and_nothing_is_deleted(
    tmp_path: Path, monkeypatch, name
) -> None:
    """A read error that is not damage (EIO, permissions, a stale NFS handle) stops the resume in one
    line; the checkpoint, which may be whole, is not taken for a damaged one and deleted."""
    from medusa_train.errors import UserError

    trainer_checkpoint(tmp_path, 2)
    path = trainer_checkpoint(tmp_path, 4)
    real_open = Path.open

    def failing_open(self, *args, **kwargs):
        if self.name == name:
            raise OSError(5, "Input/output error", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", failing_open)
    real_builtin_open = open

    def failing_builtin_open(file, *args, **kwargs):
        if Path(file).name == name:
            raise OSError(5, "Input/output error", str(file))
        return real_builtin_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", failing_builtin_open)
    with pytest.raises(
        UserError, match=rf"cannot read checkpoint .*Input/output error.*{name}.*nothing was deleted"
    ):
        last_complete_checkpoint(tmp_path, remove_incomplete=True)
    assert path.is_dir()
