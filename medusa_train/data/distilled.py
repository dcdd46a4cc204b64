"""The self-distilled dataset on disk: written by ``stage=distill``, read by train, calibration and eval.

Layout of ``workdir/distill/``::

    progress.json          the settings of the run filling the folder (a resume must match them)
    shards/shard-NNNNN.arrow
                           one Arrow stream per finished shard (written to a temp name, then renamed)
    manifest.json          written last, once every shard is on disk: backbone identity, tokenizer,
                           generation settings, data, counts, tokens/s, world size, settings, and
                           every shard's file name, record count, size and SHA-256 (``shards``)

Columns of every record:
    input_ids  list[int]   the whole conversation rendered with the chat template, tokenised
    loss_mask  list[int]   1 exactly on tokens the backbone generated (assistant turns incl. their EOS)
    source_id  str         stable id of the source record ("<file>:<line>" or "embedded:<n>")

Each shard carries its own counts (records, tokens, turns, ...) in the Arrow schema metadata, so
the manifest sums them without reading any record and a resumed run counts the shards an earlier
invocation wrote. Only the shard files and ``manifest.json`` are read downstream; a folder without
a manifest is unfinished.

Integrity: a reader checks every shard the manifest lists against its recorded size and SHA-256
(:func:`verify_shards`) and refuses a missing or damaged one, naming the file and the command that
regenerates it; stage=distill deletes such a shard and generates it again like a missing one
(:func:`damaged_shards`). Settings are compared by content (:func:`comparable`): the places of the
backbone, tokenizer and data files are recorded but not compared, so a copied, moved or renamed
workdir (or one named by a relative instead of an absolute path) is the same workdir.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import datasets
import pyarrow as pa

from medusa_train.errors import DamagedArtefactError, UserError
from medusa_train.workdir import (
    MANIFEST,
    PROGRESS,
    SHARDS,
    atomic_write,
    atomic_write_json,
    file_sha256,
    read_json,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bumped when the columns or their meaning change (recorded in progress.json and the manifest)."""

_COUNTS_KEY = b"medusa_distill"
"""Schema metadata key of a shard's counts."""

REGENERATE = "run `python -m medusa_train stage=distill` with the same settings to regenerate it"
"""The repair a damaged distill artefact's message names."""

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
    """The ``progress.json`` of an earlier run, or None when there is none or it is damaged."""
    path = Path(distill_dir) / PROGRESS
    if not path.is_file():
        return None
    try:
        return read_json(path, repair=REGENERATE)
    except DamagedArtefactError:
        return None


def has_output(distill_dir: str | Path) -> bool:
    """Whether a run already wrote a shard or a manifest here."""
    distill_dir = Path(distill_dir)
    return any((distill_dir / SHARDS).glob("*.arrow")) or (distill_dir / MANIFEST).exists()


def start_run(distill_dir: str | Path, progress: dict) -> list[Path]:
    """Prepare ``distill_dir`` for (more) shards: temp files of a killed run removed, damaged shards
    removed (they are generated again like missing ones), the manifest removed (it is rewritten once
    every shard is on disk), ``progress`` recorded.

    Call it on one process only, before any shard is written (other ranks wait at a barrier).

    Returns:
        The damaged shards that were removed.
    """
    distill_dir = Path(distill_dir)
    shards = distill_dir / SHARDS
    shards.mkdir(parents=True, exist_ok=True)
    for stale in [*shards.glob(".*.tmp"), *distill_dir.glob(".*.tmp")]:  # partial files of a killed run
        stale.unlink()
    damaged = damaged_shards(distill_dir, progress["num_shards"])
    for path, _ in damaged:
        path.unlink()
    (distill_dir / MANIFEST).unlink(missing_ok=True)
    atomic_write_json(distill_dir / PROGRESS, progress)
    return [path for path, _ in damaged]


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

    atomic_write(path, write)  # fsynced, then the folder too: the rename survives a power loss


def read_shard_counts(path: Path) -> dict:
    """The counts :func:`write_shard` stored in a shard's schema (reads no record)."""
    with pa.memory_map(str(path)) as source:
        schema = pa.ipc.open_stream(source).schema
    return json.loads(schema.metadata[_COUNTS_KEY])


def shard_problem(path: Path, entry: dict | None = None) -> str | None:
    """Why the shard at ``path`` cannot be used, or None when it is whole.

    Args:
        path: the shard file.
        entry: its manifest entry (``bytes``, ``sha256``, ``records``); without one (no manifest yet)
            the stream is read to its end and its rows counted against the counts in its schema.
    """
    if not path.is_file():
        return "missing"
    if entry is not None and {"bytes", "sha256"} <= entry.keys():
        if path.stat().st_size != entry["bytes"]:
            return f"damaged ({path.stat().st_size} bytes, the manifest says {entry['bytes']})"
        if file_sha256(path) != entry["sha256"]:
            return "damaged (its checksum differs from the manifest's)"
        return None
    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            rows = sum(batch.num_rows for batch in reader)
            meta = reader.schema.metadata or {}
        expected = json.loads(meta[_COUNTS_KEY])["records"] if _COUNTS_KEY in meta else rows
    except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError, KeyError, TypeError) as err:
        return f"damaged (not a readable Arrow stream: {str(err).splitlines()[0][:80] if str(err) else type(err).__name__})"
    if rows != expected:
        return f"damaged ({rows} records, its header says {expected})"
    return None


def damaged_shards(distill_dir: str | Path, num_shards: int) -> list[tuple[Path, str]]:
    """Shards ``0 .. num_shards - 1`` on disk that are damaged, with the reason (missing ones are not
    listed: they are simply still to do). Checked against the manifest when there is a readable one."""
    entries = _manifest_entries(distill_dir)
    out = []
    for index in range(num_shards):
        path = shard_path(distill_dir, index)
        if not path.is_file():
            continue
        problem = shard_problem(path, entries.get(path.name))
        if problem:
            out.append((path, problem))
    return out


def shard_entries(distill_dir: str | Path, num_shards: int) -> list[dict]:
    """The manifest's ``shards`` list: file, records, bytes and SHA-256 of every shard (rank 0, once
    every shard is on disk)."""
    out = []
    for index in range(num_shards):
        path = shard_path(distill_dir, index)
        out.append(
            {
                "file": path.name,
                "records": read_shard_counts(path)["records"],
                "bytes": path.stat().st_size,
                "sha256": file_sha256(path),
            }
        )
    return out


def _manifest_entries(distill_dir: str | Path) -> dict[str, dict]:
    path = Path(distill_dir) / MANIFEST
    if not path.is_file():
        return {}
    try:
        manifest = read_json(path, repair=REGENERATE)
    except DamagedArtefactError:
        return {}
    shards = manifest.get("shards")
    return (
        {e["file"]: e for e in shards if isinstance(e, dict) and "file" in e}
        if isinstance(shards, list)
        else {}
    )


def verify_shards(distill_dir: str | Path, manifest: dict) -> list[tuple[Path, str]]:
    """Every shard ``manifest`` lists that is missing or damaged, with the reason (empty: all whole).

    A manifest with a ``shards`` list is checked file by file (size and SHA-256); an older one
    without it by ``num_shards`` and reading each stream to its end.
    """
    distill_dir = Path(distill_dir)
    entries = manifest.get("shards")
    if isinstance(entries, list):
        checks = [(distill_dir / SHARDS / str(e.get("file")), e) for e in entries if isinstance(e, dict)]
        if len(checks) != len(entries):
            return [(distill_dir / MANIFEST, "damaged (a shard entry is not an object)")]
    elif isinstance(manifest.get("num_shards"), int):
        checks = [(shard_path(distill_dir, i), None) for i in range(manifest["num_shards"])]
    else:  # written by hand or by an old version: whatever shards are there must at least read
        checks = [(path, None) for path in shard_files(distill_dir)]
    problems = []
    for path, entry in checks:
        problem = shard_problem(path, entry)
        if problem:
            problems.append((path, problem))
    return problems


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
    """The manifest if ``distill_dir`` is complete, whole and was made with ``quick_settings``
    (compared by :func:`comparable`), else None."""
    path = Path(distill_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = read_json(path, repair=REGENERATE, keys=("quick_settings", "num_shards", "counts"))
    except DamagedArtefactError as err:
        log.warning("%s", err)
        return None
    if comparable(manifest["quick_settings"]) != comparable(quick_settings):
        return None
    return manifest if not verify_shards(distill_dir, manifest) else None


_PATHS = ("data.path", "tokenizer.name_or_path", "backbone_source.files")


def comparable(settings: dict | None) -> dict | None:
    """``settings`` as compared between runs: the content without the places of things.

    The data file's path, the tokenizer's ``name_or_path`` and the local backbone's file listing are
    dropped (the records' hash, the tokenizer's vocabulary/template and the backbone's fingerprint
    say what they hold); the backbone's ``name_or_path`` is dropped when a content fingerprint of its
    local files stands in for it (a Hub id without local files is compared by name).
    """
    if not isinstance(settings, dict):
        return settings
    out = json.loads(json.dumps(settings))
    for dotted in _PATHS:
        group, _, name = dotted.partition(".")
        if isinstance(out.get(group), dict):
            out[group].pop(name, None)
    source = out.get("backbone_source")
    if isinstance(source, dict) and source.get("fingerprint"):
        source.pop("name_or_path", None)
    return out


def data_key(manifest: dict) -> str:
    """What distilled data is, as 16 hex digits: its settings (:func:`comparable`), counts and backbone
    (by fingerprint when it has one), not where or when it was written.

    Trained heads record it (``config.json["training"]["distill"]``); export's model card describes
    the workdir's distilled data only when the heads carry this key of its manifest.
    """
    backbone = manifest.get("backbone")
    if isinstance(backbone, dict) and backbone.get("fingerprint"):  # a moved backbone is the same one
        backbone = {k: v for k, v in backbone.items() if k != "name_or_path"}
    content = {
        "settings": comparable(manifest.get("settings")),
        "counts": manifest.get("counts"),
        "backbone": backbone,
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:16]


# -- reading ----------------------------------------------------------------------------------------
def read_manifest(distill_dir: str | Path) -> dict:
    """The manifest of a finished distill folder (a JSON object).

    Raises:
        UserError: no manifest (the folder is unfinished or absent).
        DamagedArtefactError: the manifest does not parse or is not an object.
    """
    path = Path(distill_dir) / MANIFEST
    if not path.is_file():
        raise UserError(
            f"no distilled data at {distill_dir} (missing {MANIFEST}): run `python -m medusa_train stage=distill` first"
        )
    manifest = read_json(path, repair=REGENERATE, keys=("backbone",))
    backbone = manifest["backbone"]
    if not isinstance(backbone, dict) or not backbone.get("fingerprint"):
        raise DamagedArtefactError(f"{path} is damaged (no backbone fingerprint): {REGENERATE}")
    return manifest


def check_made_by(
    manifest: dict,
    identity: dict,
    distill_dir: str | Path,
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    other_code_fingerprint: str | None = None,
) -> None:
    """Refuse distilled data made by another backbone than the one loaded (``identity``: its
    ``backbone.backbone_identity``), compared by weights fingerprint, not by name or place.

    ``trust_remote_code``: this run's ``model.trust_remote_code``; ``other_code_fingerprint``: the
    backbone's fingerprint with it the other way (``backbone.other_code_fingerprint``; None where the
    setting changes nothing). The data of a run that set it otherwise is refused as that: the same
    files, whose remote code counted in one fingerprint and not in the other.

    Raises:
        UserError: the fingerprints differ.
    """
    made_by = manifest.get("backbone", {})
    if made_by.get("fingerprint") == identity["fingerprint"]:
        return
    if other_code_fingerprint is not None and made_by.get("fingerprint") == other_code_fingerprint:
        distilled_with = str(not trust_remote_code).lower()
        raise UserError(
            f"{distill_dir} was distilled from {name_or_path} with model.trust_remote_code={distilled_with} and "
            f"this run sets model.trust_remote_code={str(trust_remote_code).lower()} (the remote code its "
            f"config.json's auto_map names counts only with it): set model.trust_remote_code={distilled_with} "
            "as that run did, or run stage=distill with distill.overwrite=true to distill again"
        )
    raise UserError(
        f"{distill_dir} was distilled from another backbone ({made_by.get('name_or_path')}, fingerprint "
        f"{made_by.get('fingerprint')}) than {name_or_path} (fingerprint {identity['fingerprint']}): "
        "run stage=distill with this model (distill.overwrite=true) or use the matching model"
    )


def shard_files(distill_dir: str | Path) -> list[Path]:
    return sorted((Path(distill_dir) / SHARDS).glob("*.arrow"))


def load_distilled(distill_dir: str | Path):
    """Every shard the manifest lists as one ``datasets.Dataset`` (memory-mapped), in source order.

    Raises:
        DamagedArtefactError: a listed shard is missing or damaged (one line naming it).
    """
    manifest = read_manifest(distill_dir)
    problems = verify_shards(distill_dir, manifest)
    if problems:
        path, problem = problems[0]
        more = f" (and {len(problems) - 1} more shards)" if len(problems) > 1 else ""
        raise DamagedArtefactError(f"{path} is {problem}{more}: {REGENERATE}")
    entries = manifest.get("shards")
    if isinstance(entries, list):
        files = [Path(distill_dir) / SHARDS / e["file"] for e in entries]
    elif isinstance(manifest.get("num_shards"), int):
        files = [shard_path(distill_dir, i) for i in range(manifest["num_shards"])]
    else:
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
