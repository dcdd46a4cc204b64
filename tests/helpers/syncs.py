"""Record what reaches the disk: every ``os.fsync`` (by the path its descriptor names) and every
``os.replace``, in order, so a test can say which files and folders were flushed before a rename.

Linux only (a descriptor's path is read from /proc/self/fd): tests using it skip elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

Event = tuple[str, Path, Path | None]
"""``("fsync", path, None)`` or ``("replace", dst, src)``; paths resolved (symlinks followed)."""


def record_syncs(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """Patch ``os.fsync`` and ``os.replace`` to append their :data:`Event` (after the real call) to
    the returned list; a folder's fsync names the folder."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to name a descriptor's file")
    events: list[Event] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")), None))

    def replace(src, dst, **kwargs) -> None:
        real_replace(src, dst, **kwargs)
        events.append(("replace", Path(dst).resolve(), Path(src).resolve()))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def flushed_before(events: list[Event], dst: Path) -> set[Path]:
    """The paths whose bytes were fsynced when the first rename onto ``dst`` happened, a file fsynced
    under a temp name counting under the name it was renamed to (``dst`` included)."""
    synced: set[Path] = set()
    for kind, path, src in events:
        if kind == "fsync" or src in synced:
            synced.add(path)
        if (kind, path) == ("replace", dst):
            return synced
    raise AssertionError(f"no rename onto {dst} in {events}")


def flushed_after(events: list[Event], dst: Path) -> set[Path]:
    """The paths fsynced after the first rename onto ``dst``."""
    start = next(i for i, (kind, path, _) in enumerate(events) if (kind, path) == ("replace", dst))
    return {path for kind, path, _ in events[start + 1 :] if kind == "fsync"}
