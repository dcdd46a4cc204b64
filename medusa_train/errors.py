"""Errors a user can fix. The CLI prints them as one line on stderr and exits with code 2.

:func:`environment_fault` turns the faults of the machine a run writes to (a read-only or full disk,
a folder without write permission, a file where a folder must go) into such a line too: the stages
write every artefact to a temp name and rename it into place, so a write that fails leaves the
previous artefact (or none), never a half-written one, and the same command resumes once the fault
is fixed. A torch checkpoint write that fails without an errno (``torch.save`` on a full disk) counts
as a full disk when the workdir's disk is (nearly) full, and as a write failure of unknown cause
otherwise; any other error stays a traceback (a bug).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path


class UserError(Exception):
    """Bad input or a missing prerequisite; the message says what to do."""


class ConfigError(UserError):
    """A configuration value is misspelt, has the wrong type, or contradicts another one."""


class DamagedArtefactError(UserError):
    """A file a stage reads (written by an earlier stage) is missing, truncated or of the wrong shape;
    the message names the file and the command that writes it again."""


class HeadsFormatError(ValueError):
    """A heads directory or a safetensors file is missing, damaged, incomplete or does not match the
    expected shapes (the stages turn it into a :class:`UserError` that says what to do; library callers
    get it as a ``ValueError``)."""


_FAULTS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a file stands where a folder is needed",
}
# The disk faults as libraries word them when they raise no OSError (safetensors' Rust I/O errors,
# Arrow): strerror's text and Rust's "(os error N)". Permission faults count only as a real OSError.
_FAULT_TEXTS = {
    code: (f"(os error {code})", os.strerror(code)) for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
}
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# torch.save's zip writer (the HF Trainer's optimizer.pt, rng_state.pth in a checkpoint) reports a
# failed write without its errno: "[enforce fail at inline_container.cc:N] . unexpected pos N vs M"
# raised while handling "basic_ios::clear: iostream error" (torch 2.13 saving to a path on a full
# disk), or "PytorchStreamWriter failed writing file data/0: file write failed" (its other writer).
_TORCH_WRITE_FAILED = re.compile(
    r"PytorchStreamWriter failed writing file|file write failed|inline_container\.cc.*unexpected pos"
    r"|basic_ios::clear: iostream error"
)
_NEARLY_FULL = 256 << 20
"""Free bytes on the workdir's disk below which such a write failure is taken for a full disk."""
# The temp names the stages write under: workdir.staging_dir's ".<name>.tmp-<pid>" (and
# publish_dir's ".<name>.old-<pid>") and atomic_write's ".<name>.<pid>-<token>.<8 chars>.tmp" (the
# writing process's random token, then mkstemp's random part; a name without the token is taken for
# a process that is not this one). Defined here, the leaf module, so that workdir (which writes them
# and cleans them up) and the messages below share one spelling: a message names the artefact a
# temp name was becoming instead.
STAGING_NAME = re.compile(r"^\.(?P<name>.+)\.(tmp|old)-(?P<pid>\d+)$")
TEMP_FILE_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)(-(?P<token>[0-9a-f]{8}))?\.\w{8}\.tmp$")
_TEMP_NAMES = (STAGING_NAME, TEMP_FILE_NAME)


def _artefact_path(path: Path) -> Path:
    """``path`` with each temp component replaced by the name of the artefact it is being built as."""
    parts = []
    for part in path.parts:
        match = next((m for m in (p.match(part) for p in _TEMP_NAMES) if m), None)
        parts.append(match.group("name") if match else part)
    return Path(*parts)


def _fault_in(err: BaseException) -> tuple[int, str | None] | None:
    """``(errno, file name or None)`` of the first environment fault in ``err``'s chain, if any."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _FAULTS:
            return cause.errno, cause.filename
        text = str(cause)
        for code, needles in _FAULT_TEXTS.items():
            if any(n in text for n in needles):
                return code, getattr(cause, "filename", None)
        cause = cause.__cause__ or cause.__context__
    return None


def _torch_write_failure(err: BaseException) -> str | None:
    """The text of the first torch writer failure (no errno, see ``_TORCH_WRITE_FAILED``) in the chain."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, RuntimeError) and _TORCH_WRITE_FAILED.search(str(cause)):
            return str(cause).strip()
        cause = cause.__cause__ or cause.__context__
    return None


def _existing(path: Path) -> Path | None:
    return next((p for p in (path, *path.absolute().parents) if p.exists()), None)


def _human(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{num_bytes} B"


def environment_fault(err: BaseException, workdir: str | Path) -> str | None:
    """One line for an environment fault (full or read-only disk, no permission) raised by a stage.

    Args:
        err: what a stage raised (the fault may be its cause, or only named in its text when a
            library rewraps it).
        workdir: the run's workdir, named when the fault does not say which file it hit. A torch
            writer failure, which carries no errno, is a full disk when that disk has less than
            256 MiB free (else a write failure of unknown cause, still one line).

    Returns:
        The message (what happened, where, what to do), or None when ``err`` is no such fault.
    """
    found = _fault_in(err)
    if found is None:
        failed = _torch_write_failure(err)
        disk = _existing(Path(workdir))
        if failed is None or disk is None:
            return None
        free = shutil.disk_usage(disk).free
        if free >= _NEARLY_FULL:  # the disk has room: a quota, an I/O error? torch does not say
            return (
                f"writing under {workdir} failed ({failed}; {_human(free)} free there): check that disk "
                "(quota, errors), then run the same command again (finished work is kept)"
            )
        found = errno.ENOSPC, None
    code, filename = found
    name = _artefact_path(Path(os.fsdecode(filename))) if filename else None
    if name is not None and not name.is_absolute() and len(name.parts) == 1:
        # A bare entry name (shutil.rmtree's, a walk by folder descriptor) is relative to a folder it
        # does not name, somewhere under the workdir, not to the current directory.
        where, message = Path(workdir), f"{_FAULTS[code]}: {name} under {workdir}"
    else:
        where = name if name is not None else Path(workdir)
        message = f"{_FAULTS[code]}: {where}"
    folder = where if where.is_dir() or where != name else where.parent
    if code in _DISK_FULL:
        existing = _existing(folder)
        if existing is not None:
            message += f" ({_human(shutil.disk_usage(existing).free)} free there)"
        return (
            f"{message}: free space on that disk or pass workdir=<a folder on another disk>, then run the "
            "same command again (finished work is kept)"
        )
    if code == errno.ENOTDIR:
        return f"{message}: pass workdir=<a folder> (a part of that path is a file)"
    if code == errno.EROFS:
        return f"{message}: pass workdir=<a folder on a writable disk>, then run the same command again"
    return (
        f"{message}: give this user access to {folder} (or pass workdir=<a folder you can write>), then "
        "run the same command again (finished work is kept)"
    )
