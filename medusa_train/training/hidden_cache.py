"""A memory-mapped store of the frozen backbone's last hidden states (Medusa-1 only).

With a frozen backbone the heads' inputs never change, so the backbone forward can run once and
every epoch reads the features from disk. Only rows that train at least one head are stored, and,
for a soft head loss, the rows whose next-token distribution is some head's target (position
``t+k`` for head k at t: :func:`medusa_train.head_targets.soft_target_sources`).

Layout of ``workdir/train/hidden_cache/``::

    hidden.bin     (N_rows, d) raw array in the model dtype (bfloat16 stored as its uint16 bits)
    targets.npy    (N_rows, K) int32, -100 = not trained for that head
    sources.npy    soft head losses only: (N_rows, K) int32, the record-local row holding h_{t+k}, -100 = none
    offsets.npy    (R + 1,) int64: record r owns rows offsets[r]:offsets[r+1]
    progress.json  records whose rows are written so far (resume point while building)
    meta.json      written last: shapes, dtype, settings; its presence marks a complete cache

Row counts depend only on the loss masks, so offsets and targets are written first and the
hidden rows are filled in batch by batch; a killed build resumes from ``progress.json``. Every file
is on disk (fsynced) before ``progress.json`` or ``meta.json`` counts it, so a power loss costs at
most the batches after the last progress record. A cache whose files do not match its meta.json
(truncated, damaged, missing) counts as absent and is built again (:func:`cache_problem`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from medusa_train.errors import DamagedArtefactError
from medusa_train.head_targets import (
    IGNORE_INDEX,
    hidden_width,
    last_hidden_state,
    medusa_targets,
    soft_target_sources,
)
from medusa_train.training.trainer import PadCollator
from medusa_train.workdir import atomic_write, atomic_write_json, fsync_file, read_json

META = "meta.json"
CACHE_PROGRESS = "progress.json"
"""The cache's own build progress (not the distill folder's ``workdir.PROGRESS``)."""
_NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


def kept_rows(targets: torch.Tensor, soft: bool) -> torch.Tensor:
    """Which positions the cache stores: those that train a head, and (``soft``) those whose hidden
    state is a head's soft target.

    Args:
        targets: ``(B, T, K)`` from :func:`medusa_train.head_targets.medusa_targets`.

    Returns:
        ``(B, T)`` bool.
    """
    keep = (targets != IGNORE_INDEX).any(dim=-1)  # (B, T)
    if soft:
        src = soft_target_sources(targets)  # (B, T, K) flat indices into (B*T)
        is_source = torch.zeros(keep.numel(), dtype=torch.bool, device=keep.device)  # (B*T,)
        is_source[src[src != IGNORE_INDEX]] = True
        keep = keep | is_source.view_as(keep)
    return keep


def record_targets(
    input_ids: list[int], loss_mask: list[int], num_heads: int, soft: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """Targets ``(n, K)`` of one record's stored rows (see :func:`medusa_train.head_targets.medusa_targets`)
    and, with ``soft``, their soft-target rows ``(n, K)`` (record-local row indices, -100 = none)."""
    ids = torch.tensor([input_ids])
    mask = torch.tensor([loss_mask])
    tgt = medusa_targets(ids, mask, torch.ones_like(ids), num_heads)  # (1, T, K)
    keep = kept_rows(tgt, soft)[0]  # (T,)
    targets = tgt[0][keep].numpy().astype(np.int32)
    if not soft:
        return targets, None
    local = torch.cumsum(keep.long(), 0) - 1  # (T,) position -> stored row
    src = soft_target_sources(tgt)[0][keep]  # (n, K) positions (B == 1: flat index == t)
    sources = torch.where(src == IGNORE_INDEX, IGNORE_INDEX, local[src.clamp_min(0)])
    return targets, sources.numpy().astype(np.int32)


class HiddenCache:
    """Read access to a complete cache: ``len()`` records, ``[r]`` -> dict of hidden ``(n, d)``,
    targets ``(n, K)`` and, in a cache for a soft head loss, sources ``(n, K)`` (record-local rows)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        problem = cache_problem(self.dir)
        if problem:
            raise DamagedArtefactError(
                f"the hidden-state cache {self.dir} is {problem}: delete it and run stage=train again (it is rebuilt)"
            )
        self.meta = json.loads((self.dir / META).read_text())
        self.dtype = getattr(torch, self.meta["dtype"])
        n, d = self.meta["rows"], self.meta["hidden_size"]
        self.hidden = np.memmap(self.dir / "hidden.bin", dtype=_NP_DTYPES[self.dtype], mode="r", shape=(n, d))
        self.targets = np.load(self.dir / "targets.npy", mmap_mode="r")
        self.offsets = np.load(self.dir / "offsets.npy")
        self.sources = np.load(self.dir / "sources.npy", mmap_mode="r") if self.meta.get("soft") else None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, r: int) -> dict[str, torch.Tensor]:
        lo, hi = int(self.offsets[r]), int(self.offsets[r + 1])
        h = torch.from_numpy(np.array(self.hidden[lo:hi]))
        if self.dtype == torch.bfloat16:
            h = h.view(torch.bfloat16)
        out = {"hidden_states": h, "targets": torch.from_numpy(np.array(self.targets[lo:hi])).long()}
        if self.sources is not None:
            out["sources"] = torch.from_numpy(np.array(self.sources[lo:hi])).long()
        return out


def is_complete(directory: str | Path, settings: dict) -> bool:
    """True when a finished, whole cache built with exactly ``settings`` exists."""
    directory = Path(directory)
    if not (directory / META).is_file() or cache_problem(directory):
        return False
    return json.loads((directory / META).read_text()).get("settings") == settings


def cache_problem(directory: Path) -> str | None:
    """Why the finished cache in ``directory`` cannot be read, or None (sizes checked against meta.json)."""
    try:
        meta = read_json(
            directory / META, repair="", keys=("rows", "hidden_size", "num_heads", "records", "dtype")
        )
        dtype = _NP_DTYPES[getattr(torch, str(meta["dtype"]))]
        rows, d, k, n = (int(meta[x]) for x in ("rows", "hidden_size", "num_heads", "records"))
        targets = np.load(directory / "targets.npy", mmap_mode="r")
        offsets = np.load(directory / "offsets.npy", mmap_mode="r")
        sources = np.load(directory / "sources.npy", mmap_mode="r") if meta.get("soft") else targets
    except (DamagedArtefactError, AttributeError, KeyError, TypeError, ValueError, OSError, EOFError) as err:
        return f"damaged ({str(err).splitlines()[0][:100] if str(err) else type(err).__name__})"
    hidden = directory / "hidden.bin"
    want = max(rows, 1) * d * np.dtype(dtype).itemsize
    if not hidden.is_file() or hidden.stat().st_size != want:
        return f"damaged (hidden.bin has {hidden.stat().st_size if hidden.is_file() else 0} bytes, {want} expected)"
    if (
        targets.shape != (rows, k)
        or sources.shape != (rows, k)
        or offsets.shape != (n + 1,)
        or (n and int(offsets[-1]) != rows)
    ):
        return "damaged (targets.npy/sources.npy/offsets.npy do not match meta.json)"
    return None


@torch.no_grad()
def build_hidden_cache(
    backbone: torch.nn.Module,
    records: list[dict],
    directory: str | Path,
    num_heads: int,
    settings: dict,
    batch_size: int = 8,
    soft: bool = False,
) -> HiddenCache:
    """Run the frozen backbone once over ``records`` and store the trained rows' hidden states.

    Args:
        backbone: the frozen causal LM (eval mode).
        records: dicts with ``input_ids`` and ``loss_mask`` (already truncated), in training order.
        directory: the cache folder (created; a cache with other settings is rebuilt).
        num_heads: K.
        settings: anything that changes the content (backbone fingerprint, max_seq_len, K, dataset size);
            stored in meta.json and compared on reuse/resume.
        batch_size: records per backbone forward.
        soft: also store the rows a soft head loss reads its targets from, and ``sources.npy``.

    Returns:
        The opened :class:`HiddenCache`.
    """
    directory = Path(directory)
    if is_complete(directory, settings):
        return HiddenCache(directory)
    progress_path = directory / CACHE_PROGRESS
    weight = backbone.get_output_embeddings().weight
    dtype, d = weight.dtype, hidden_width(backbone)  # d: the last hidden state's, which the heads read
    device = weight.device
    try:  # resumable: same settings, and the files a killed build left are whole
        resumable = read_json(progress_path, repair="").get("settings") == settings
        rows = int(np.load(directory / "offsets.npy")[-1])
        want = max(rows, 1) * d * np.dtype(_NP_DTYPES[dtype]).itemsize
        resumable = resumable and (directory / "hidden.bin").stat().st_size == want
    except (DamagedArtefactError, OSError, ValueError, EOFError, IndexError):  # none yet, or damaged
        resumable = False
    if not resumable and directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)

    if not resumable:
        per_record = [record_targets(r["input_ids"], r["loss_mask"], num_heads, soft) for r in records]
        offsets = np.zeros(len(records) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(t) for t, _ in per_record])
        empty = np.zeros((0, num_heads), np.int32)
        targets = np.concatenate([t for t, _ in per_record]) if per_record else empty
        _save(directory / "targets.npy", targets.reshape(-1, num_heads))
        if soft:
            sources = np.concatenate([s for _, s in per_record]) if per_record else empty
            _save(directory / "sources.npy", sources.reshape(-1, num_heads))
        _save(directory / "offsets.npy", offsets)
        np.memmap(
            directory / "hidden.bin", dtype=_NP_DTYPES[dtype], mode="w+", shape=(max(int(offsets[-1]), 1), d)
        ).flush()
        atomic_write_json(progress_path, {"settings": settings, "records_done": 0})
    offsets = np.load(directory / "offsets.npy")
    rows_total = int(offsets[-1])
    hidden = np.memmap(
        directory / "hidden.bin", dtype=_NP_DTYPES[dtype], mode="r+", shape=(max(rows_total, 1), d)
    )
    done = json.loads(progress_path.read_text())["records_done"]
    collate = PadCollator(0)
    for start in range(done, len(records), batch_size):
        batch = records[start : start + batch_size]
        padded = collate(batch)  # right padding
        ids, am, lm = (padded[k].to(device) for k in ("input_ids", "attention_mask", "loss_mask"))
        h = last_hidden_state(backbone, ids, am)  # (b, t, d)
        tgt = medusa_targets(ids, lm, am, num_heads)  # (b, t, K)
        rows = h[kept_rows(tgt, soft)]  # (n_rows, d), records in order
        lo, hi = int(offsets[start]), int(offsets[start + len(batch)])
        assert rows.shape[0] == hi - lo, "row selection disagrees with the precomputed offsets"
        arr = rows.to(dtype).cpu()
        hidden[lo:hi] = (arr.view(torch.uint16) if dtype == torch.bfloat16 else arr).numpy()
        hidden.flush()
        atomic_write_json(progress_path, {"settings": settings, "records_done": start + len(batch)})
    del hidden
    fsync_file(directory / "hidden.bin")  # flushed batch by batch; its size is on disk too before meta.json
    atomic_write_json(
        directory / META,
        {
            "settings": settings,
            "rows": rows_total,
            "hidden_size": d,
            "num_heads": num_heads,
            "records": len(records),
            "dtype": str(dtype).removeprefix("torch."),
            "soft": soft,
        },
    )
    return HiddenCache(directory)


def _save(path: Path, array: np.ndarray) -> None:
    """``np.save`` of ``array`` at ``path``, atomically and fsynced (the folder too)."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:  # a file object: given a path, np.save adds ".npy" to the temp name
            np.save(fh, array)

    atomic_write(path, write)
