"""Reads back what an offline wandb run wrote (``<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb``).

wandb's own reader left its Python package with the Go core, so this decodes the file itself: a
7-byte header (``:W&B``, magic, version), then the LevelDB log format (32 KiB blocks of records, each
a 7-byte header: CRC-32C, little-endian length, type FULL/FIRST/MIDDLE/LAST) carrying one
``wandb_internal_pb2.Record`` per logical record.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    """One offline run folder: its id, the history rows (``_step`` included), the x axis of every metric
    defined (``define_metric``'s ``step_metric``, "" for none; a glob as ``prefix/*``) and the exit code."""

    id: str
    history: list[dict] = field(default_factory=list)
    axes: dict[str, str] = field(default_factory=dict)
    exit_code: int | None = None


def _records(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", "not a wandb run file"
    out, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
        else:  # a zeroed tail: the writer preallocated or was killed
            break
    return out


def _started(folder: Path) -> tuple[str, int]:
    """An offline run folder's order: its second, then wandb's suffix for one more part in that second."""
    parts = folder.name.removeprefix("offline-run-").split("-")
    return parts[0], int(parts[2]) if len(parts) > 2 else 0


def read_offline_runs(workdir: Path) -> list[OfflineRun]:
    """Every offline run under ``workdir/wandb``, oldest first (as ``wandb sync`` uploads them).

    wandb's service writes a run's file on its own: ``finish()`` can return before the file holds the
    run's records (a run file read then once held no axes, though they reached it a moment later). So
    wandb's process-wide setup is torn down first, which waits for the service to finish writing.
    """
    import wandb
    from wandb.proto import wandb_internal_pb2 as pb

    wandb.teardown()
    runs = []
    # offline-run-<second>-<id>; a second part started within the same second gets "-1", "-2", ...
    for folder in sorted((workdir / "wandb").glob("offline-run-*"), key=_started):
        (path,) = folder.glob("run-*.wandb")
        run = OfflineRun(id=path.stem.removeprefix("run-"))
        for raw in _records(path.read_bytes()):
            record = pb.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                run.history.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
            elif kind == "metric":
                run.axes[record.metric.name or record.metric.glob_name] = record.metric.step_metric
            elif kind == "exit":
                run.exit_code = record.exit.exit_code
        runs.append(run)
    return runs
