"""The self-distilled dataset on disk: written by ``stage=distill``, read by train, calibration and eval.

Layout of ``workdir/distill/``::

    progress.json          the settings of the run filling the folder (a resume must match them)
    shards/shard-NNNNN.arrow
                           one Arrow stream per finished shard (written to a temp name, then renamed)
    manifest.json          written last, once every shard is on disk: backbone identity, tokenizer,
                           generation settings, data, counts, tokens/s, world size, settings

Columns of every record:
    input_ids  list[int]   the whole conversation rendered with the chat template, tokenised
    loss_mask  list[int]   1 exactly on tokens the backbone generated (assistant turns incl. their EOS)
    source_id  str         stable id of the source record ("<file>:<line>" or "embedded:<n>")

Each shard carries its own counts (records, tokens, turns, ...) in the Arrow schema metadata, so
the manifest sums them without reading any record and a resumed run counts the shards an earlier
invocation wrote. Only the shard files and ``manifest.json`` are read downstream; a folder without
a manifest is unfinished.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import datasets
import pyarrow as pa

from medusa_train.errors import UserError
from medusa_train.workdir import MANIFEST, PROGRESS, SHARDS, atomic_write, atomic_write_json

FORMAT_VERSION = 1
"""Bumped when the columns or their meaning change (recorded in progress.json and the manifest)."""

_COUNTS_KEY = b"medusa_distill"
"""Schema metadata key of a shard's counts."""

_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "source_id": datasets.Value("string"),
    }
)


# -- writing ----------------------------------------------------------------------------------------
def shard_path(distill_dir: str | Path, index: int) -> Path:
    """Where shard ``index`` lives (whether or not it is written yet)."""
    return Path(distill_dir) / SHARDS / f"shard-{index:05d}.arrow"


def read_progress(distill_dir: str | Path) -> dict | None:
    """The ``progress.json`` of an earlier run, or None when there is none or it does not parse."""
    path = Path(distill_dir) / PROGRESS
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def has_output(distill_dir: str | Path) -> bool:
    """Whether a run already wrote a shard or a manifest here."""
    distill_dir = Path(distill_dir)
    return any((distill_dir / SHARDS).glob("*.arrow")) or (distill_dir / MANIFEST).exists()


def start_run(distill_dir: str | Path, progress: dict) -> None:
    """Prepare ``distill_dir`` for (more) shards: temp files of a killed run removed, the manifest
    removed (it is rewritten once every shard is on disk), ``progress`` recorded.

    Call it on one process only, before any shard is written (other ranks wait at a barrier).
    """
    distill_dir = Path(distill_dir)
    shards = distill_dir / SHARDS
    shards.mkdir(parents=True, exist_ok=True)
    for stale in [*shards.glob(".*.tmp"), *distill_dir.glob(".*.tmp")]:  # partial files of a killed run
        stale.unlink()
    (distill_dir / MANIFEST).unlink(missing_ok=True)
    atomic_write_json(distill_dir / PROGRESS, progress)


def shard_counts(records) -> dict:
    """Counts of a shard's records (:class:`medusa_train.data.regenerate.DistilledRecord`)."""
    return {
        "records": len(records),
        "tokens_generated": sum(sum(r.loss_mask) for r in records),
        "tokens_total": sum(len(r.input_ids) for r in records),
        "turns": sum(r.turns for r in records),
        "turns_dropped": sum(r.turns_dropped for r in records),
        "turns_cut_at_max_new_tokens": sum(r.cut for r in records),
    }


def write_shard(path: Path, records, extra_counts: dict | None = None) -> None:
    """Write one shard as a datasets-readable Arrow stream: temp file, fsync, atomic rename.

    Args:
        path: the shard's final place (:func:`shard_path`).
        records: :class:`medusa_train.data.regenerate.DistilledRecord` objects, in source order.
        extra_counts: more counts of this shard (an engine's), summed into the manifest like the others.
    """
    schema = _FEATURES.arrow_schema
    counts = json.dumps({**shard_counts(records), **(extra_counts or {})}).encode()
    schema = schema.with_metadata({**(schema.metadata or {}), _COUNTS_KEY: counts})
    table = pa.table(
        {
            "input_ids": [r.input_ids for r in records],
            "loss_mask": [r.loss_mask for r in records],
            "source_id": [r.source_id for r in records],
        },
        schema=schema,
    )

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f, pa.ipc.new_stream(f, schema) as writer:
            writer.write_table(table)

    atomic_write(path, write)
    dir_fd = os.open(path.parent, os.O_RDONLY)  # the rename itself survives a power loss
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_shard_counts(path: Path) -> dict:
    """The counts :func:`write_shard` stored in a shard's schema (reads no record)."""
    with pa.memory_map(str(path)) as source:
        schema = pa.ipc.open_stream(source).schema
    return json.loads(schema.metadata[_COUNTS_KEY])


def total_counts(distill_dir: str | Path, num_shards: int) -> dict:
    """The counts of shards ``0 .. num_shards - 1`` summed; fails if one is missing."""
    counts: dict = {}
    for index in range(num_shards):
        path = shard_path(distill_dir, index)
        if not path.is_file():
            raise UserError(
                f"shard {path.name} is missing after every rank finished: run the same command again"
            )
        for key, value in read_shard_counts(path).items():
            counts[key] = counts.get(key, 0) + value
    return counts


def write_manifest(distill_dir: str | Path, manifest: dict) -> None:
    """Publish ``manifest.json`` (atomically): from now on the folder is complete."""
    atomic_write_json(Path(distill_dir) / MANIFEST, manifest)


def complete_manifest(distill_dir: str | Path, quick_settings: dict) -> dict | None:
    """The manifest if ``distill_dir`` is complete and was made with ``quick_settings``, else None."""
    path = Path(distill_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if manifest.get("quick_settings") != quick_settings:
        return None
    if all(shard_path(distill_dir, i).is_file() for i in range(manifest["num_shards"])):
        return manifest
    return None


# -- reading ----------------------------------------------------------------------------------------
def read_manifest(distill_dir: str | Path) -> dict:
    path = Path(distill_dir) / MANIFEST
    if not path.is_file():
        raise UserError(
            f"no distilled data at {distill_dir} (missing {MANIFEST}): run `python -m medusa_train stage=distill` first"
        )
    return json.loads(path.read_text())


def shard_files(distill_dir: str | Path) -> list[Path]:
    return sorted((Path(distill_dir) / SHARDS).glob("*.arrow"))


def load_distilled(distill_dir: str | Path):
    """All finished shards as one ``datasets.Dataset`` (memory-mapped), in source order."""
    read_manifest(distill_dir)
    files = shard_files(distill_dir)
    if not files:
        raise UserError(
            f"{distill_dir} holds no finished shard: run `python -m medusa_train stage=distill` again"
        )
    parts = [datasets.Dataset.from_file(str(f)) for f in files]
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if len(ds) == 0:
        raise UserError(
            f"the distilled dataset at {distill_dir} is empty: check the data source and run stage=distill"
        )
    return ds


def is_heldout(source_id: str, fraction: float) -> bool:
    """Deterministic held-out membership from a hash of the record's id (stable across runs and ranks)."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(source_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_heldout(ds, fraction: float):
    """``(train, heldout)`` split of a distilled dataset by :func:`is_heldout` on ``source_id``."""
    flags = [is_heldout(s, fraction) for s in ds["source_id"]]
    train_idx = [i for i, f in enumerate(flags) if not f]
    held_idx = [i for i, f in enumerate(flags) if f]
    return ds.select(train_idx), ds.select(held_idx)
