"""The temp files of ``workdir.atomic_write`` carry their writer's pid and process token, and
``remove_stale`` (called by every stage at start) deletes those of processes that no longer run --
never a live one's, and also an earlier process's that had this one's pid (every run in a container
is pid 1). Renames reach the disk: the files first, then the folder that holds them. A symlink at a
published folder's place is kept, the folder published into its target.

The stage-level check (a write SIGKILLed mid-way, then the next ``stage=distill`` start) is
``tests/stages/test_reliability_artefacts.py::test_distill_start_deletes_a_killed_writes_temp_file``.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from medusa_train import workdir as workdir_mod
from medusa_train.errors import UserError
from medusa_train.workdir import (
    atomic_write,
    atomic_write_text,
    check_workdir,
    describe_diff,
    publish_dir,
    published_path,
    remove_stale,
    staging_dir,
)
from tests.helpers.syncs import flushed_after, flushed_before, record_syncs


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    pid = int(proc.stdout)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    return pid


TOKEN = workdir_mod._PROCESS_TOKEN
OTHER_TOKEN = f"{(int(TOKEN, 16) + 1) % 2**32:08x}"  # another process that had this pid


def test_atomic_write_names_its_temp_file_with_its_pid_and_process_token(tmp_path: Path) -> None:
    seen: list[str] = []

    def write(tmp: Path) -> None:
        seen.append(tmp.name)
        tmp.write_text("x")

    atomic_write(tmp_path / "run.json", write)
    assert len(seen) == 1 and workdir_mod.TEMP_FILE_NAME.match(seen[0])
    assert seen[0].startswith(f".run.json.{os.getpid()}-{TOKEN}.") and seen[0].endswith(".tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_remove_stale_deletes_only_dead_writers_temp_files(tmp_path: Path, dead_pid: int) -> None:
    final = tmp_path / "distill"
    (final / "shards").mkdir(parents=True)
    atomic_write_text(final / "progress.json", "{}")
    dead = [
        final / f".progress.json.{dead_pid}.abcd1234.tmp",
        final / "shards" / f".shard-00003.arrow.{dead_pid}.k1ll_3d0.tmp",  # under the folder too
        tmp_path / f".distill.{dead_pid}.abcd1234.tmp",  # beside it, named for it
        final / f".progress.json.{dead_pid}-{OTHER_TOKEN}.abcd1234.tmp",  # with its token
    ]
    live = [
        final / f".progress.json.{os.getpid()}-{TOKEN}.abcd1234.tmp",  # this process is writing it
        final / f".progress.json.{os.getppid()}.abcd1234.tmp",  # another live process
        final / f".progress.json.{os.getppid()}-{OTHER_TOKEN}.abcd1234.tmp",  # the same, with its token
        final / ".progress.json.abcd1234.tmp",  # no pid: whose it is cannot be told
        tmp_path / f".other.json.{dead_pid}.abcd1234.tmp",  # beside it, but another file's
    ]
    for path in dead + live:
        path.write_text("half")
    removed = remove_stale(final)
    assert sorted(removed) == sorted(dead)
    assert [p for p in dead if p.exists()] == [] and all(p.exists() for p in live)
    assert (final / "progress.json").read_text() == "{}"
    assert remove_stale(tmp_path / "other.json") == [tmp_path / f".other.json.{dead_pid}.abcd1234.tmp"]


def test_a_leftover_of_an_earlier_process_with_this_pid_is_stale(tmp_path: Path, monkeypatch) -> None:
    """In a container every run is pid 1: a temp file a killed earlier run left has this run's pid,
    and only the token tells it from one this process is writing."""
    monkeypatch.setattr(workdir_mod.os, "getpid", lambda: 1)
    final = tmp_path / "distill"
    final.mkdir()
    dead = [
        final / ".manifest.json.1.abcd1234.tmp",  # named without a token
        final / f".manifest.json.1-{OTHER_TOKEN}.abcd1234.tmp",  # another process start with pid 1
    ]
    mine = final / f".manifest.json.1-{TOKEN}.abcd1234.tmp"
    for path in [*dead, mine]:
        path.write_text("half")
    assert sorted(remove_stale(final)) == sorted(dead)
    assert mine.exists()
    atomic_write_text(final / "manifest.json", "{}")  # this process's own temp names carry pid 1 now
    assert sorted(p.name for p in final.iterdir()) == sorted(["manifest.json", mine.name])


def test_atomic_write_flushes_the_file_then_its_folder(tmp_path: Path, monkeypatch) -> None:
    """The rename is only on disk once the folder is fsynced: without it a power loss can leave the
    previous file, or none, though the write returned."""
    events = record_syncs(monkeypatch)
    path = tmp_path / "manifest.json"
    atomic_write_text(path, "{}")
    assert path.resolve() in flushed_before(events, path.resolve())  # its bytes, as a temp file
    assert flushed_after(events, path.resolve()) == {tmp_path.resolve()}


def test_fsync_dir_is_a_no_op_without_o_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delattr(workdir_mod.os, "O_DIRECTORY")
    events = record_syncs(monkeypatch)
    atomic_write_text(tmp_path / "a.json", "{}")
    assert flushed_after(events, (tmp_path / "a.json").resolve()) == set()


@pytest.mark.parametrize("refusal", ["open", "EINVAL", "ENOTSUP", "EOPNOTSUPP", "ENOSYS", "EBADF"])
def test_a_folder_that_cannot_be_synced_takes_writes_and_publishes(
    tmp_path: Path, monkeypatch, refusal
) -> None:
    """A file system that does not sync folders (network, FUSE: fsync of a folder fails with one of
    these codes), or a folder this user may write but not read (mode -wx: it cannot be opened): the
    write and the publish go through; a fault of the disk (EIO) is still raised."""
    real_open, real_fsync = os.open, os.fsync
    # whether opening a folder is refused, what its fsync fails with
    refused = {"open": refusal == "open", "fsync": getattr(errno, refusal, None)}

    def open_(path, flags, *args, **kwargs):
        if refused["open"] and flags & os.O_DIRECTORY:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    def fsync(fd: int) -> None:
        code = refused["fsync"]
        if code is not None and stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write_text(tmp_path / "manifest.json", "{}")
    final = tmp_path / "export"
    tmp = staging_dir(final)
    (tmp / "medusa").mkdir()
    (tmp / "medusa" / "config.json").write_text("{}")
    publish_dir(tmp, final)
    assert (tmp_path / "manifest.json").read_text() == "{}" and (final / "medusa" / "config.json").is_file()
    refused.update(open=False, fsync=errno.EIO)
    with pytest.raises(OSError, match="Input/output error"):
        atomic_write_text(tmp_path / "manifest.json", "{}")


def test_publish_dir_flushes_the_staged_tree_then_the_folder_it_lands_in(tmp_path: Path, monkeypatch) -> None:
    """Files a library wrote into the staging folder (``save_pretrained``, plots) are not fsynced by
    it: a power loss after the swap could publish a folder of empty files."""
    final = tmp_path / "export"
    final.mkdir()
    tmp = staging_dir(final)
    (tmp / "medusa").mkdir()
    (tmp / "medusa" / "config.json").write_text("{}")
    (tmp / "README.md").write_text("card")
    events = record_syncs(monkeypatch)
    publish_dir(tmp, final)
    staged = {tmp.resolve(), tmp.resolve() / "medusa", tmp.resolve() / "medusa" / "config.json"}
    assert staged | {tmp.resolve() / "README.md"} <= flushed_before(events, final.resolve())
    assert tmp_path.resolve() in flushed_after(events, final.resolve())


def test_remove_stale_flushes_the_folder_it_put_back(tmp_path: Path, monkeypatch) -> None:
    final = tmp_path / "heads"
    (tmp_path / f".heads.old-{os.getpid()}").mkdir()  # a kill between publish_dir's two renames
    events = record_syncs(monkeypatch)
    remove_stale(final)
    assert final.is_dir() and tmp_path.resolve() in flushed_after(events, final.resolve())


def test_umask_is_read_without_setting_it(monkeypatch) -> None:
    """Setting the umask to read it gives a file another thread creates in that instant the wrong mode."""
    status = Path("/proc/self/status")
    if not status.is_file() or "Umask:" not in status.read_text():
        pytest.skip("the system does not show the umask in /proc/self/status")
    before = os.umask(0o027)
    try:
        monkeypatch.setattr(workdir_mod.os, "umask", lambda mask: pytest.fail("the umask was set to read it"))
        assert workdir_mod._umask() == 0o027
    finally:
        monkeypatch.undo()
        os.umask(before)


def test_a_symlinked_published_folder_is_published_into_its_target(tmp_path: Path) -> None:
    """export/ made a symlink to another disk on purpose: publishing keeps the link and replaces the
    folder it points to, building the new one beside that folder (the rename stays on its disk)."""
    other_disk = tmp_path / "big"
    (other_disk / "export-run1").mkdir(parents=True)
    (other_disk / "export-run1" / "a.txt").write_text("old")
    wd = tmp_path / "wd"
    wd.mkdir()
    link = wd / "export"
    link.symlink_to(other_disk / "export-run1", target_is_directory=True)
    remove_stale(link)
    tmp = staging_dir(link)
    assert tmp.parent == other_disk.resolve()
    (tmp / "a.txt").write_text("new")
    publish_dir(tmp, link)
    assert link.is_symlink() and (other_disk / "export-run1" / "a.txt").read_text() == "new"
    assert published_path(link) == wd.resolve() / "export"
    assert sorted(p.name for p in wd.iterdir()) == ["export"]
    assert sorted(p.name for p in other_disk.iterdir()) == ["export-run1"]
    # Killed between publish_dir's two renames: the next run puts the old version back there.
    tmp = staging_dir(link)
    os.replace(other_disk / "export-run1", other_disk / f".export-run1.old-{os.getpid()}")
    remove_stale(link)
    assert (link / "a.txt").read_text() == "new" and link.is_symlink()
    assert sorted(p.name for p in other_disk.iterdir()) == ["export-run1"]


def test_a_symlink_into_a_missing_folder_is_refused_before_any_work(tmp_path: Path) -> None:
    """A link to a disk that is not mounted: creating its folders would write to the wrong disk."""
    link = tmp_path / "export"
    link.symlink_to(tmp_path / "unmounted" / "export", target_is_directory=True)
    with pytest.raises(UserError, match="is a symlink to .*, whose folder does not exist: mount that disk"):
        check_workdir(tmp_path, (link,))
    with pytest.raises(UserError, match="whose folder does not exist"):
        staging_dir(link)
    assert not (tmp_path / "unmounted").exists()


def test_a_symlink_to_a_folder_not_made_yet_gets_it_made(tmp_path: Path) -> None:
    """distill/ linked to a folder of another disk that does not exist yet: the check makes it, so the
    stage's own ``mkdir(exist_ok=True)`` there succeeds (at the dangling link it raised
    FileExistsError, after the backbone had loaded)."""
    (tmp_path / "big").mkdir()
    link = tmp_path / "workdir" / "distill"
    link.parent.mkdir()
    link.symlink_to(tmp_path / "big" / "distill", target_is_directory=True)
    check_workdir(link.parent, (link,))
    assert (tmp_path / "big" / "distill").is_dir() and link.is_symlink()
    (link / "shards").mkdir(parents=True, exist_ok=True)
    link.mkdir(parents=True, exist_ok=True)
    assert (tmp_path / "big" / "distill" / "shards").is_dir()


def test_a_symlink_loop_is_refused_in_one_line(tmp_path: Path) -> None:
    """A link that leads back to itself at a published folder's place (or above the workdir): one line
    saying what to do, from the check before any work and from each publishing step, not the
    RuntimeError that ``Path.resolve`` raises on it."""
    (tmp_path / "export").symlink_to("export")
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    for link in (tmp_path / "export", tmp_path / "a"):
        for call, args in (
            (check_workdir, (tmp_path, (link,))),
            (staging_dir, (link,)),
            (remove_stale, (link,)),
        ):
            with pytest.raises(
                UserError, match=f"^{re.escape(str(link))} leads through a symlink loop .*: point the link"
            ):
                call(*args)
    with pytest.raises(UserError, match="leads through a symlink loop"):
        check_workdir(tmp_path / "a" / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "export"]


def test_refused_distill_names_the_users_own_change_before_derived_entries() -> None:
    """The settings a user changed come first, with their values; hashes and counts after, by name."""
    from medusa_train.stages.distill import _difference

    old = {
        "data": {"max_records": 120, "prompts_hash": "a" * 16, "records_hash": "b" * 16, "records_read": 120},
        "distill": {"max_new_tokens": 64, "temperature": 0.0},
        "backbone_fingerprint": "f",
    }
    new = {
        "data": {"max_records": 600, "prompts_hash": "c" * 16, "records_hash": "d" * 16, "records_read": 600},
        "distill": {"max_new_tokens": 128, "temperature": 0.0},
        "backbone_fingerprint": "f",
    }
    text = _difference(old, new)
    assert text.startswith("data.max_records (120 -> 600), distill.max_new_tokens (64 -> 128); derived")
    assert text.endswith("data.prompts_hash, data.records_hash, data.records_read")
    # Only derived entries differ (the same settings over another data file): all of them, with values.
    only_derived = describe_diff(
        {"data": {"records_hash": "x"}}, {"data": {"records_hash": "y"}}, settable=lambda name: False
    )
    assert only_derived == "data.records_hash (x -> y)"
