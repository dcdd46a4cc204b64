"""The self-distilled dataset on disk (written by ``stage=distill``, read by train/calibration/eval).

Layout of ``workdir/distill/``::

    manifest.json          backbone identity, tokenizer, generation settings, counts, tokens/s
    shards/*.arrow         Arrow files (one per finished shard; written to a temp name, then renamed)

Columns of every record:
    input_ids  list[int]   the whole conversation rendered with the chat template, tokenised
    loss_mask  list[int]   1 exactly on tokens the backbone generated (assistant turns incl. their EOS)
    source_id  str         stable id of the source record ("<file>:<line>" or "embedded:<n>")
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from medusa_train.errors import UserError

MANIFEST = "manifest.json"
SHARDS = "shards"


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
    import datasets

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
