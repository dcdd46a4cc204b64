"""The run directory: artefact names, atomic writes and publishing, and the skip/resume settings of a stage.

Every stage reads its inputs from and writes its outputs to fixed places of ``cfg.workdir``, so
stages chain without the user passing paths:

```
workdir/
  pretrain/   the embedded tiny LM (model=tiny only): HF model dir + tokenizer + train_report.json
  distill/    manifest.json  progress.json  shards/*.arrow
  train/      trainer checkpoints (resumable) + run.json; hidden_cache/ (training.cache_hidden_states)
  heads/      config.json  medusa_lm_head.safetensors  calibration.json  medusa_choices.json
              (+ backbone/ after training=medusa2: the trained backbone, or its LoRA adapter)
  export/     medusa/  vllm/  medusa_choices.json  calibration.json  custom_generate/  README.md
              (+ backbone/ after medusa2, LoRA merged)
  eval/       report.json  report.md  generations.jsonl  plots/*.png  (+ previous/: the run before)
```

This module is a leaf (standard library + :mod:`medusa_train.errors` only): the heads, the data
readers and the stages all import their file names and atomic writes from here.

Publishing: a stage builds an output folder under a temporary name beside its final place
(:func:`staging_dir`) and swaps it in with renames (:func:`publish_dir`), so a reader never sees a
half-written folder; leftovers of a killed run are removed by the next one (:func:`remove_stale`).

Skip and resume: a stage stores its *settings* with its output, a JSON-able dict that
:func:`settings_of` builds from config dataclasses and the stage's inputs, and skips or resumes
when the stored settings equal the current ones (:func:`settings_diff` / :func:`describe_diff` name
what differs otherwise). Every dataclass field counts unless it is declared with
``config.run_only`` (its field metadata ``run_only``: a field that steers how a run goes, not what
it produces, e.g. ``overwrite``), so a field added later is compared without anyone listing it.
Words: *settings* is that dict; a *key* is a short hex digest naming what an artefact holds
(``data.distilled.data_key``); a *fingerprint* is a digest of files or tensors (a backbone's, the
heads').
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from medusa_train.errors import (
    STAGING_NAME,
    TEMP_FILE_NAME,
    DamagedArtefactError,
    UserError,
    environment_fault,
)

# -- folders of the workdir (one per stage) ----------------------------------------------------------
PRETRAIN = "pretrain"
DISTILL = "distill"
TRAIN = "train"
HEADS = "heads"
EXPORT = "export"
EVAL = "eval"
TRAINED_BACKBONE = "backbone"
"""Medusa-2: the folder beside the heads (and in the export) holding the trained backbone."""

# -- file names -----------------------------------------------------------------------------------
PRETRAIN_REPORT = "train_report.json"
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
SHARDS = "shards"
RUN_INFO = "run.json"
HIDDEN_CACHE = "hidden_cache"
HEADS_CONFIG = "config.json"
HEADS_WEIGHTS = "medusa_lm_head.safetensors"
CALIBRATION = "calibration.json"
CHOICES = "medusa_choices.json"
MODEL_CARD = "README.md"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
GENERATIONS = "generations.jsonl"
PLOTS = "plots"
PREVIOUS = "previous"
"""Inside ``eval/``: the report of the run before the latest (stage=eval replaces it on each run)."""


@dataclass(frozen=True)
class Workdir:
    """The fixed folders of a run directory (see the module docstring)."""

    root: Path

    @property
    def pretrain(self) -> Path:
        return self.root / PRETRAIN

    @property
    def distill(self) -> Path:
        return self.root / DISTILL

    @property
    def train(self) -> Path:
        return self.root / TRAIN

    @property
    def heads(self) -> Path:
        return self.root / HEADS

    @property
    def export(self) -> Path:
        return self.root / EXPORT

    @property
    def eval(self) -> Path:
        return self.root / EVAL


def check_workdir(root: str | os.PathLike, outputs: tuple[str | os.PathLike, ...] = ()) -> None:
    """Refuse, before any work, a workdir the run's stages cannot write to: a file where it or a folder
    above it must be, or (its nearest existing folder when it does not exist yet) a folder this user
    may not write or one on a read-only disk. The same for each of ``outputs``, the folders the run's
    stages write (``distill/``, ``heads/``, the embedded backbone's place), and every folder under an
    existing one (a read-only ``distill/shards``), through a symlink at their place to where it
    points (:func:`publish_dir`). Found only at a stage's first write, the fault came after its work
    (a whole pretraining or evaluation) or as a traceback. A symlink at an output's place whose target
    does not exist yet (its folder does) gets its target made, empty.

    Raises:
        UserError: the one line of :func:`~medusa_train.errors.environment_fault` for that fault, or
            :func:`publish_place`'s for a symlink pointing into a folder that does not exist, or
            :func:`refuse_symlink_loop`'s for a path through a symlink loop.
    """
    refuse_symlink_loop(Path(root).absolute())
    fault = _unwritable(Path(root).absolute(), walk=False)
    for folder in outputs:
        place = publish_place(Path(folder).absolute())
        fault = fault or _unwritable(place, walk=True)
        if fault is None and place != Path(folder).absolute() and not place.exists():
            # A symlink into a folder not made yet: made now, as publish_dir makes it (a stage's
            # mkdir(exist_ok=True) at a dangling link raises FileExistsError, after its work began).
            place.mkdir()
    if fault is None:
        return
    code, where = fault
    message = environment_fault(OSError(code, os.strerror(code), str(where)), root)
    assert message is not None  # every code _unwritable gives is one environment_fault words
    raise UserError(message)


def _unwritable(path: Path, walk: bool) -> tuple[int, Path] | None:
    """``(errno, folder)`` of the first folder a write to ``path`` would fail in (its nearest existing
    one; with ``walk``, every folder under it too when it exists), or None when all are writable."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return errno.ENOTDIR, existing
    folders = [existing]
    if walk and existing == path:
        folders += [Path(top) / name for top, names, _ in os.walk(path) for name in names]
    for folder in folders:
        if not os.access(folder, os.W_OK | os.X_OK):
            return (errno.EROFS if os.statvfs(folder).f_flag & os.ST_RDONLY else errno.EACCES), folder
    return None


def require(path: Path, what: str, stage: str) -> Path:
    """Fail with a message naming the stage to run first when ``path`` does not exist.

    Leftovers of a run killed while publishing ``path`` are resolved first (:func:`remove_stale`:
    a folder a kill left aside is put back).
    """
    remove_stale(path)
    if not path.exists():
        raise UserError(
            f"{what} not found at {path}: run `python -m medusa_train stage={stage}` first (same workdir=)"
        )
    return path


def read_json(
    path: str | os.PathLike, *, expect: type | tuple[type, ...] = dict, repair: str, keys=()
) -> Any:
    """Parse the JSON file ``path`` written by an earlier stage, checking its shape.

    Args:
        path: the file.
        expect: the type(s) the top-level value must have (an object by default).
        repair: what the user runs to write the file again (ends the error message).
        keys: entries an object must hold.

    Raises:
        DamagedArtefactError: missing, unreadable, truncated or not of the expected shape; one line
            naming the file and ``repair``.
    """
    path = Path(path)
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise DamagedArtefactError(f"{path} is missing: {repair}") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, bad UTF-8, nesting too deep
        reason = (
            f"{err.msg} at line {err.lineno}" if isinstance(err, json.JSONDecodeError) else type(err).__name__
        )
        raise DamagedArtefactError(f"{path} is damaged (not valid JSON: {reason}): {repair}") from None
    except OSError as err:
        raise DamagedArtefactError(f"{path} cannot be read ({err.strerror or err}): {repair}") from None
    if not isinstance(value, expect):
        want = " or ".join(
            _a(_JSON_NAMES.get(t, t.__name__)) for t in (expect if isinstance(expect, tuple) else (expect,))
        )
        got = _a("JSON " + _JSON_NAMES.get(type(value), type(value).__name__))
        raise DamagedArtefactError(f"{path} is damaged ({got} where {want} is expected): {repair}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise DamagedArtefactError(f"{path} is damaged (lacks {', '.join(map(repr, missing))}): {repair}")
    return value


_JSON_NAMES = {
    dict: "object",
    list: "list",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _a(noun: str) -> str:
    """``noun`` with its article: "a JSON list", "an object"; none for null ("JSON null", "null")."""
    if noun.endswith("null"):
        return noun
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- atomic files -----------------------------------------------------------------------------------
def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)``, fsync, then rename onto ``path`` (same folder: the rename is atomic).

    The temp file is ``.<name>.<pid>-<process token>.<8 random chars>.tmp`` beside ``path``: a
    failed write deletes it; one a killed process left behind is deleted by :func:`remove_stale` once
    that process no longer runs (the token tells an earlier process that had this one's pid, as every
    run in a container has pid 1). The file gets ordinary permissions (0644 less the umask), not
    mkstemp's 0600. The folder is fsynced after the rename, so the new file survives a power loss.
    """
    path = Path(path)
    prefix = f".{path.name}.{os.getpid()}-{_PROCESS_TOKEN}."
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, path)
        fsync_dir(path.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()
    return path


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush ``folder``'s entries to disk: a rename or a new file in it survives a power loss once this
    returns (fsyncing a file does not write its name). A no-op where folders cannot be opened (no
    ``os.O_DIRECTORY``: Windows; a folder this user may write but not read, mode ``-wx``) or the file
    system does not sync them (:data:`_NO_FOLDER_SYNC`); any other failure (EIO, ENOSPC) is raised."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _NO_FOLDER_SYNC:
            raise
    finally:
        os.close(fd)


_NO_FOLDER_SYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF})
"""What ``fsync`` of a folder fails with on a file system that does not sync folders (network, FUSE
and virtual file systems; EBADF where a folder opened read-only cannot be synced)."""


def fsync_file(path: str | os.PathLike) -> None:
    """Flush ``path``'s bytes to disk (written through another handle: ``np.save``, a memory map)."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    return atomic_write(path, lambda p: p.write_text(text))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON (with a final newline) to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def _umask() -> int:
    """The process's umask, read without changing it where the system shows it (Linux: the ``Umask:``
    line of /proc/self/status); elsewhere set and restored, which gives a file another thread creates
    in that instant the wrong mode."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


_PROCESS_TOKEN = secrets.token_hex(4)
"""Names this process in its temp files with its pid: a leftover of an earlier process that had the
same pid (every run in a container is pid 1) is told from this one's."""


def remove_dead_temp_files(folder: Path) -> list[Path]:
    """Delete the :func:`atomic_write` temp files under ``folder`` (recursively) of processes that no
    longer run: a write killed before its rename. A live process's (this one's included) are kept.
    """
    removed: list[Path] = []
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            if _dead_temp_file(name):
                entry = Path(dirpath) / name
                entry.unlink(missing_ok=True)
                removed.append(entry)
    return removed


def _dead_temp_file(name: str, of: str | None = None) -> bool:
    """Whether ``name`` is an :func:`atomic_write` temp file (for the file ``of``, when given) whose
    writer no longer runs."""
    match = TEMP_FILE_NAME.match(name)
    if match is None or (of is not None and match["name"] != of):
        return False
    pid = int(match["pid"])
    if pid == os.getpid():  # this process's, or an earlier one's that had its pid (and has ended)
        return match["token"] != _PROCESS_TOKEN
    return not _alive(pid)


# -- atomic folders ---------------------------------------------------------------------------------
def staging_dir(final: Path) -> Path:
    """An empty folder beside ``final`` to build its next version in (``.<name>.tmp-<pid>``); beside
    the folder a symlink at ``final`` points to, on that disk (:func:`publish_dir`)."""
    final = publish_place(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def published_path(final: Path) -> Path:
    """The absolute path a folder :func:`publish_dir` puts at ``final`` is known by, the same however
    ``final`` is spelt: its parent resolved (the working directory, symlinks, ``..``), its own name
    kept (a symlink there stays: :func:`publish_dir` publishes into its target). Files that record
    where they live (the export's ``generate.py`` and card) name this path, so one workdir always
    writes the same bytes.
    """
    return final.parent.resolve() / final.name


def publish_dir(tmp: Path, final: Path) -> Path:
    """Replace ``final`` by ``tmp`` with renames only: a reader sees the old folder or the new one.

    ``tmp`` (from :func:`staging_dir`) is flushed to disk first, every file and folder in it, and the
    folder holding ``final`` after the swap: the published folder survives a power loss whole. An
    existing ``final`` is renamed aside (``.<name>.old-<pid>``) first and deleted after the swap;
    a kill between the two renames leaves ``final`` missing and both versions on disk, which
    :func:`remove_stale` resolves on the next run by putting the old version back. The published
    folder gets ordinary permissions (0777 less the umask).

    A symlink at ``final`` (an export on another disk, made on purpose) is kept: the folder it points
    to is the one replaced, and the staging and old folders sit beside that one.
    """
    final = publish_place(final)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if old.exists():
        shutil.rmtree(old)
    os.chmod(tmp, 0o777 & ~_umask())
    fsync_tree(tmp)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    return final


def publish_place(final: Path) -> Path:
    """The folder :func:`publish_dir` replaces for ``final``: the target of a symlink at ``final``,
    else ``final`` itself.

    Raises:
        UserError: ``final`` is a symlink into a folder that does not exist (a disk not mounted), or
            one of a loop (:func:`refuse_symlink_loop`).
    """
    if not final.is_symlink():
        return final
    refuse_symlink_loop(final)
    target = final.resolve()
    if not target.parent.is_dir():
        raise UserError(
            f"{final} is a symlink to {target}, whose folder does not exist: mount that disk or remove "
            "the link, then run the same command again"
        )
    return target


def refuse_symlink_loop(path: Path) -> None:
    """Refuse ``path`` when reaching it passes a symlink loop (a link that leads back to itself): no
    folder can be made or written there, and ``Path.resolve`` raises a bare RuntimeError on it.

    Raises:
        UserError: one line naming ``path`` and what to do.
    """
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UserError(
                f"{path} leads through a symlink loop (a link that points back to itself): point the "
                "link at a folder or remove it, then run the same command again"
            ) from None


def fsync_tree(folder: str | os.PathLike) -> None:
    """fsync every file and folder under ``folder``, ``folder`` included (files written by libraries
    that do not). A file or folder deleted while this walks (by another process) is passed over;
    symlinks are not followed."""
    for top, _, names in os.walk(folder):
        for name in names:
            entry = os.path.join(top, name)
            if not os.path.islink(entry):
                with contextlib.suppress(FileNotFoundError):
                    fsync_file(entry)
        with contextlib.suppress(FileNotFoundError):
            fsync_dir(top)


def remove_stale(final: Path) -> list[Path]:
    """Delete the staging/old folders and temp files a killed run left beside and inside ``final``.

    A run killed between :func:`publish_dir`'s two renames left ``final`` missing and its previous
    version aside: that version is put back (the new one may be incomplete and is deleted); a
    symlink at ``final`` is looked through, as :func:`publish_dir` does. The
    :func:`atomic_write` temp files of killed writes beside ``final`` (named for it) and anywhere
    under it are deleted (:func:`remove_dead_temp_files`). Only leftovers of processes that no
    longer run are touched (a concurrent run's are kept). Stages call it on their folders at start.

    Raises:
        UserError: ``final`` is a symlink of a loop (:func:`refuse_symlink_loop`).
    """
    if final.is_symlink():
        refuse_symlink_loop(final)
        final = final.resolve()
    parent = final.parent
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    stale = []
    for entry in parent.iterdir():
        match = STAGING_NAME.match(entry.name)
        if match and match["name"] == final.name and not _alive(int(match["pid"])):
            stale.append(entry)
        elif _dead_temp_file(entry.name, of=final.name) and entry.is_file():
            stale.append(entry)
    olds = [e for e in stale if e.is_dir() and ".old-" in e.name]
    if olds and not final.exists():  # killed between publish_dir's two renames: the old version goes back
        newest = max(olds, key=lambda e: e.stat().st_mtime_ns)
        os.replace(newest, final)
        fsync_dir(parent)
        stale.remove(newest)
    for entry in stale:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    if final.is_dir() and not final.is_symlink():
        removed += remove_dead_temp_files(final)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers from an earlier call in this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """Hard-link (copy where links are refused) every file of ``src`` into ``dst``, except the
    top-level ``skip`` names: a folder published again with a few files changed shares the unchanged
    (large) ones."""

    def link(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    shutil.copytree(
        src,
        dst,
        ignore=lambda folder, names: [n for n in names if Path(folder) == src and n in skip],
        copy_function=link,
        dirs_exist_ok=True,
    )


# -- skip/resume settings ---------------------------------------------------------------------------
RUN_ONLY = "run_only"
"""Field metadata of a config field left out of :func:`settings_of` (set by ``config.run_only``)."""


def settings_of(**parts: Any) -> dict:
    """The settings a stage's output depends on, as a JSON-able dict (compared to skip or resume).

    Args:
        **parts: config dataclasses (every field except those declared ``run_only``) or any
            JSON-able values (a stage's input identities: a fingerprint, a manifest digest).

    Returns:
        ``{part name: {field: value}}`` for dataclasses, ``{part name: value}`` otherwise, normalised
        through JSON (tuples become lists, paths strings), so settings read back from disk compare
        equal.
    """
    settings: dict[str, Any] = {}
    for name, value in parts.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {
                f.name: getattr(value, f.name)
                for f in dataclasses.fields(value)
                if not f.metadata.get(RUN_ONLY, False)
            }
        settings[name] = value
    return json.loads(json.dumps(settings, sort_keys=True, default=_jsonable))


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def settings_diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted names of the entries that differ between two settings; never empty when ``old != new``."""
    if old == new:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            out += settings_diff(old.get(k), new.get(k), f"{prefix}{k}.")
        return out or [prefix.rstrip(".") or "<settings>"]
    return [prefix.rstrip(".") or "<settings>"]


def describe_diff(old: Any, new: Any, limit: int = 4, settable: Callable[[str], bool] | None = None) -> str:
    """The entries that differ between two settings as ``name (old -> new), ...``; never empty.

    Values are shown short (a long one is cut), so a user can rerun with the old value to keep the
    data made with it. ``settable``: which dotted names are settings a user sets (config keys); those
    come first, with their values, and the rest (hashes, counts and identities derived from them and
    from the inputs) after them, by name only: the user's own change is never pushed out by them.
    """
    names = settings_diff(old, new) or ["<settings>"]
    derived: list[str] = []
    if settable is not None:
        derived = [n for n in names if not settable(n)]
        names = [n for n in names if settable(n)]
    parts = []
    for name in names[:limit]:
        a, b = _lookup(old, name), _lookup(new, name)
        parts.append(f"{name} ({_short(a)} -> {_short(b)})")
    more = f", and {len(names) - limit} more" if len(names) > limit else ""
    if not parts:
        return describe_diff(old, new, limit)
    text = ", ".join(parts) + more
    if derived:
        shown = ", ".join(derived[:limit]) + (
            f" and {len(derived) - limit} more" if len(derived) > limit else ""
        )
        text += f"; derived from settings and inputs: {shown}"
    return text


def _lookup(key: Any, dotted: str) -> Any:
    if dotted == "<settings>":
        return key
    for part in dotted.split("."):
        if not isinstance(key, dict):
            return None
        key = key.get(part)
    return key


def _short(value: Any, width: int = 40) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= width else text[: width - 3] + "..."
