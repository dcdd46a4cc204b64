"""The fault sweep: bad inputs and faults against a small real workdir, each through the CLI.

Builds a ``debug=fast`` workdir once (``python -m medusa_train stage=all debug=fast``), then runs every
case on a fresh copy of it as a subprocess CLI call (``python -c <prelude> <overrides>``; the prelude
injects the fault: a SIGKILL/SIGINT at a chosen rename, a full disk, a read-only workdir) and
classifies the outcome:

- ``ok``: exit 0 (it worked, or repaired what was damaged) and the case's check of the result holds;
- ``refused``: exit 2 with exactly one ``error:`` line on stderr and no traceback;
- ``TRACEBACK``: a traceback (exit 1), or any other exit/output;
- ``SILENT-WRONG``: exit 0 but the case's check found a wrong or stale result;
- ``LEFTOVER``: a temporary folder or file of a killed or failed run is still there after the rerun;
- ``UNEXPECTED``: refused where the case must work, or worked where it must be refused;
- ``TIMEOUT``: still running after ``CASE_TIMEOUT`` seconds (work without a bound).

Kill cases run the command once with the kill, then the same command again; the second run is the
one classified. The target: no TRACEBACK, no SILENT-WRONG, no LEFTOVER, no UNEXPECTED.

The ``server`` cases distill through ``distill.engine=server`` against stand-in OpenAI-compatible
servers the sweep starts as processes on 127.0.0.1 (``tests/helpers/fake_openai.py``, standard library:
replies that depend only on the conversation, faults on demand) and kills after the case. A case that
must work is checked against a clean run through one healthy stand-in: the same shards, byte for byte.

Usage::

    nice -n 5 python scripts/fault_sweep.py [--root /tmp/fault-sweep] [--only NAME_SUBSTRING] [--keep]

Disk faults are simulated as the tests do (the sweep may run as root, whom chmod does not stop):
a full disk is ``os.fsync`` raising ENOSPC (every artefact is fsynced before its rename), a read-only
workdir is every create/write under it raising EROFS.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_ARGS = ["debug=fast", "tracking=disabled"]

# Injected before the CLI's main(): the fault named by $SWEEP_FAULT (JSON).
PRELUDE = r"""
import builtins, errno, io, json, os, signal, sys, tempfile
from pathlib import Path
fault = json.loads(os.environ.get("SWEEP_FAULT") or "{}")
kind = fault.get("kind")
if fault.get("signal") == "SIGINT":  # as in a terminal (a background job starts with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
if kind == "signal_at_replace":  # SIGKILL/SIGINT at the n-th rename onto a path ending in `where`
    real_replace, seen = os.replace, [0]
    def replace(src, dst, *a, **k):
        if os.fspath(dst).endswith(fault["where"]):
            seen[0] += 1
            if seen[0] == fault.get("nth", 1):
                os.kill(os.getpid(), getattr(signal, fault["signal"]))
        return real_replace(src, dst, *a, **k)
    os.replace = replace
elif kind == "signal_at_open":  # ... at the n-th open for writing of a path ending in `where`
    real_open, seen = builtins.open, [0]
    def bopen(file, mode="r", *a, **k):
        if isinstance(file, (str, os.PathLike)) and "w" in mode and os.fspath(file).endswith(fault["where"]):
            seen[0] += 1
            if seen[0] == fault.get("nth", 1):
                os.kill(os.getpid(), getattr(signal, fault["signal"]))
        return real_open(file, mode, *a, **k)
    builtins.open = io.open = bopen
elif kind == "full_disk":  # fsync of a file whose path contains `where` fails with ENOSPC
    real_fsync = os.fsync
    def fsync(fd):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if fault.get("where", "") in name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)
    os.fsync = fsync
elif kind == "read_only":  # nothing can be created or written under `root`
    root = os.path.realpath(fault["root"])
    def under(path):
        try:
            p = os.path.realpath(os.fspath(path))
        except TypeError:
            return False
        return p == root or p.startswith(root + os.sep)
    def erofs(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
    real_mkdir, real_open, real_osopen = os.mkdir, builtins.open, os.open
    real_mkstemp, real_mkdtemp = tempfile.mkstemp, tempfile.mkdtemp
    real_replace, real_rename, real_unlink, real_rmdir = os.replace, os.rename, os.unlink, os.rmdir
    def mkdir(path, *a, **k):
        if under(path): erofs(path)
        return real_mkdir(path, *a, **k)
    def osopen(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and under(path): erofs(path)
        return real_osopen(path, flags, *a, **k)
    def bopen(file, mode="r", *a, **k):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and under(file):
            erofs(file)
        return real_open(file, mode, *a, **k)
    def mkstemp(*a, dir=None, **k):
        if dir is not None and under(dir): erofs(dir)
        return real_mkstemp(*a, dir=dir, **k)
    def mkdtemp(*a, dir=None, **k):
        if dir is not None and under(dir): erofs(dir)
        return real_mkdtemp(*a, dir=dir, **k)
    def two(real):
        def f(src, dst, *a, **k):
            if under(src) or under(dst): erofs(dst)
            return real(src, dst, *a, **k)
        return f
    def one(real):
        def f(path, *a, **k):
            if under(path): erofs(path)
            return real(path, *a, **k)
        return f
    os.mkdir, os.open, builtins.open, io.open = mkdir, osopen, bopen, bopen
    tempfile.mkstemp, tempfile.mkdtemp = mkstemp, mkdtemp
    os.replace, os.rename, os.unlink, os.remove, os.rmdir = (
        two(real_replace), two(real_rename), one(real_unlink), one(real_unlink), one(real_rmdir))
from medusa_train.__main__ import main
sys.exit(main(sys.argv[1:]))
"""

# Temp names: publish_dir's ``.<name>.tmp-<pid>``/``.<name>.old-<pid>``, atomic_write's ``.<name>.*.tmp``.
LEFTOVER = re.compile(r"^\..+\.(tmp|old)-\d+$|^\..+\.tmp$|\.incomplete$")


@dataclass
class Run:
    """One CLI call's outcome."""

    rc: int
    err: str
    out: str
    seconds: float

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("error: ")]

    def kind(self) -> str:
        if "Traceback" in self.err or "Traceback" in self.out:
            return "traceback"
        if self.rc == 0:
            return "ok"
        if self.rc == 2 and len(self.error_lines) == 1:
            return "refused"
        return f"exit {self.rc}"


@dataclass
class Case:
    """A fault: ``setup(wd) -> argv`` on a fresh copy, optional fault/kill, a result check."""

    name: str
    group: str
    expect: str  # "ok" | "refuse"
    setup: Callable[[Path], list[str]]
    fault: dict | None = None  # injected into the (first) run
    rerun: bool = False  # run the same command again without the fault; classify that run
    check: Callable[[Path, Run], str | None] | None = None  # a message when the result is wrong
    fresh: bool = True  # False: runs in a copy placed elsewhere by setup (cwd given by setup)
    cwd: Callable[[Path], Path] | None = None
    results: dict = field(default_factory=dict)
    between: Callable[[Path], None] | None = None  # before the rerun (e.g. restart a killed server)
    env: dict = field(default_factory=dict)  # more environment variables for the CLI calls


# -- helpers -----------------------------------------------------------------------------------------
def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def tree_digest(folder: Path) -> str:
    """Digest of every file's relative path and content under ``folder`` (None-safe)."""
    if not folder.exists():
        return "absent"
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()[:16]


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def leftovers(root: Path) -> list[str]:
    """Temporary files/folders of a killed or failed run under (and beside) ``root``."""
    found = []
    for base in (root, root.parent):
        if not base.exists():
            continue
        items = base.rglob("*") if base == root else base.iterdir()
        found += [str(p) for p in items if LEFTOVER.search(p.name)]
    return sorted(set(found))


def stage(name: str, wd: Path, *extra: str) -> list[str]:
    return [f"stage={name}", f"workdir={wd}", *BASE_ARGS, *extra]


CASE_TIMEOUT = 240
"""Seconds a case's CLI call may run: every case's work on the debug=fast workdir takes well under a
minute, so a call still running then has started unbounded work (``TIMEOUT``)."""


def run_cli(
    argv: list[str],
    cwd: Path,
    fault: dict | None = None,
    timeout: int = CASE_TIMEOUT,
    extra_env: dict | None = None,
) -> Run:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "SWEEP_FAULT": json.dumps(fault or {}),
        **(extra_env or {}),
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    t0 = time.time()
    try:
        p = subprocess.run(
            [sys.executable, "-c", PRELUDE, *argv],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return Run(p.returncode, p.stderr, p.stdout, time.time() - t0)
    except subprocess.TimeoutExpired:
        return Run(-999, f"still running after {timeout} s: unbounded work?", "", time.time() - t0)


def _json(path: Path):
    return json.loads(path.read_text())


# -- checks ----------------------------------------------------------------------------------------------
def unchanged(folder: str, before: dict) -> Callable[[Path, Run], str | None]:
    """The folder (relative to the workdir) is as it was before the run (nothing half-written)."""

    def check(wd: Path, run: Run) -> str | None:
        now = tree_digest(wd / folder)
        return None if now == before.get(folder) else f"{folder}/ changed by a refused/failed run"

    return check


def eval_consistent(wd: Path, run: Run) -> str | None:
    """report.json and generations.jsonl from one run; plots only of that run."""
    report = _json(wd / "eval" / "report.json")
    gens = (wd / "eval" / "generations.jsonl").read_text().splitlines()
    if (
        report.get("num_prompts")
        and len({json.loads(g).get("prompt_index") for g in gens}) != report["num_prompts"]
    ):
        return "generations.jsonl and report.json disagree on the prompts"
    if not report.get("sweep") and (wd / "eval" / "plots" / "tree_size.png").exists():
        return "plots/tree_size.png of an earlier run beside a report without a sweep"
    return None


def distill_matches_manifest(wd: Path, run: Run) -> str | None:
    manifest = _json(wd / "distill" / "manifest.json")
    shards = manifest.get("shards") or []
    on_disk = sorted(p.name for p in (wd / "distill" / "shards").glob("*.arrow"))
    if sorted(str(s.get("file")) for s in shards) != on_disk:
        return f"shards on disk {on_disk} are not the manifest's"
    for s in shards:
        name = s.get("file") or s.get("name") or s.get("path")
        digest = s.get("sha256")
        if name and digest:
            path = wd / "distill" / "shards" / Path(name).name
            if not path.is_file():
                return f"shard {name} of the manifest missing"
            if hashlib.sha256(path.read_bytes()).hexdigest() != digest and not digest.startswith(
                hashlib.sha256(path.read_bytes()).hexdigest()[: len(digest)]
            ):
                return f"shard {name} differs from the manifest's checksum"
    return None


def export_complete(wd: Path, run: Run) -> str | None:
    exp = wd / "export"
    for f in (
        "README.md",
        "medusa/config.json",
        "medusa/medusa_lm_head.safetensors",
        "vllm/model.safetensors",
    ):
        if not (exp / f).is_file():
            return f"export/{f} missing"
    mode = exp.stat().st_mode & 0o777
    if mode & 0o055 != 0o055 and os.umask(0o022) == 0o022:  # created folders get normal permissions
        return f"export/ created mode {oct(mode)}"
    return None


def card_not_ours(own_tau: float) -> Callable[[Path, Run], str | None]:
    def check(wd: Path, run: Run) -> str | None:
        card = (wd / "export" / "README.md").read_text()
        if f"**{own_tau:.2f}**" in card:
            return f"model card of other heads states this workdir's tau {own_tau:.2f}"
        if "## Data" in card and "num_prompts" in card.split("## Data")[1].split("##")[0]:
            return "model card of other heads describes this workdir's distilled data"
        return None

    return check


def all_of(*checks: Callable[[Path, Run], str | None]) -> Callable[[Path, Run], str | None]:
    def check(wd: Path, run: Run) -> str | None:
        for c in checks:
            msg = c(wd, run)
            if msg:
                return msg
        return None

    return check


# -- stand-in OpenAI-compatible servers (the server cases) ---------------------------------------------
SERVERS: dict[int, subprocess.Popen] = {}
"""The stand-in servers of the running case by port; run_case kills them when the case ends."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int | None = None, *args: str) -> str:
    """A ``tests/helpers/fake_openai.py`` process on 127.0.0.1 serving model ``fake``; its base URL."""
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.fake_openai", "--port", str(port), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    SERVERS[port] = proc
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/models", timeout=2).close()
            return url
        except urllib.error.HTTPError:  # it answers (e.g. 401: it wants a key)
            return url
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    raise RuntimeError(f"the stand-in server on port {port} did not start")


def stop_servers() -> None:
    for proc in SERVERS.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    SERVERS.clear()


def server_argv(wd: Path, urls: list[str], *extra: str) -> list[str]:
    """A new distill (distill/ removed first) through ``urls``, with a short retry budget."""
    shutil.rmtree(wd / "distill", ignore_errors=True)
    return stage(
        "distill",
        wd,
        "distill.engine=server",
        f"distill.server.urls=[{','.join(urls)}]",
        "distill.server.model=fake",
        "distill.server.concurrency=2",
        "distill.server.max_retries=2",
        "distill.server.backoff_s=0.05",
        "distill.server.backoff_max_s=0.2",
        "distill.server.timeout_s=20",
        *extra,
    )


class ServerReference:
    """The shards of a clean server distill (one healthy stand-in), made once per sweep when first needed."""

    def __init__(self, base: Path, scratch: Path) -> None:
        self.base, self.scratch, self.digest = base, scratch, None

    def shards(self) -> str:
        if self.digest is None:
            wd = self.scratch / "server-reference" / "wd"
            shutil.rmtree(wd.parent, ignore_errors=True)
            shutil.copytree(self.base, wd, symlinks=True)
            try:
                r = run_cli(server_argv(wd, [start_server()]), REPO)
            finally:
                stop_servers()
            if r.rc != 0:
                raise RuntimeError(f"the reference server distill failed: {r.err[-500:]}")
            self.digest = tree_digest(wd / "distill" / "shards")
            shutil.rmtree(wd.parent, ignore_errors=True)
        return self.digest

    def check(self, wd: Path, run: Run) -> str | None:
        """The shards equal the clean run's (every record once, the same tokens) and the manifest's."""
        msg = distill_matches_manifest(wd, run)
        if msg:
            return msg
        if tree_digest(wd / "distill" / "shards") != self.shards():
            return "the records differ from a clean run through one healthy server"
        return None


def resumed(wd: Path, run: Run) -> str | None:
    """The rerun kept the first run's shards (it did not start over)."""
    return None if "distill: resuming" in run.err else "the rerun did not resume from the first run's shards"


def went_down(url_index: int) -> Callable[[Path, Run], str | None]:
    """The manifest counts the ``url_index``-th endpoint as gone down once."""

    def check(wd: Path, run: Run) -> str | None:
        counts = _json(wd / "distill" / "manifest.json")["engine"].get("endpoint_counts") or []
        if len(counts) <= url_index or counts[url_index].get("went_down") != 1:
            return f"the manifest's endpoint_counts do not show endpoint {url_index} going down: {counts}"
        return None

    return check


# -- the cases ------------------------------------------------------------------------------------------
# One function per group of cases, each returning its Case records; ``cases`` lists them in sweep order.
# A case's ``setup(wd)`` damages the fresh copy ``wd`` of the base workdir and returns the CLI arguments.
Setup = Callable[[Path], list[str]]


class _Cases(list):
    """A list of cases with ``add``, the short form of ``append(Case(...))``."""

    def add(self, name: str, group: str, expect: str, setup: Setup, **kw) -> None:
        self.append(Case(name, group, expect, setup, **kw))


def truncated(rel: str, st: str, *extra: str, keep: float = 0.5) -> Setup:
    """Setup: truncate ``wd/rel`` to ``keep`` of its size, then run stage ``st``."""

    def setup(wd: Path) -> list[str]:
        truncate(wd / rel, keep)
        return stage(st, wd, *extra)

    return setup


def written(rel: str, text: str | bytes, st: str, *extra: str) -> Setup:
    """Setup: replace ``wd/rel`` by ``text``, then run stage ``st``."""

    def setup(wd: Path) -> list[str]:
        p = wd / rel
        p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)
        return stage(st, wd, *extra)

    return setup


def second_shard(wd: Path) -> Path:
    return sorted((wd / "distill" / "shards").iterdir())[1]


def new_distill(wd: Path) -> list[str]:
    """Distill from scratch (same settings: distill.overwrite=true alone would skip complete data)."""
    shutil.rmtree(wd / "distill")
    return stage("distill", wd)


# (override, stage, more overrides): a size or count out of range never starts work.
CONFIG_OUT_OF_RANGE = [
    ("training.max_seq_len=-5", "train", ["training.overwrite=true"]),
    ("training.calibration_max_records=-1", "train", []),
    ("training.max_steps=0", "train", ["training.overwrite=true"]),
    ("training.per_device_batch_size=0", "train", ["training.overwrite=true"]),
    ("training.lr=-1", "train", ["training.overwrite=true"]),
    ("data.max_records=0", "distill", ["distill.overwrite=true"]),
    ("data.max_records=-3", "distill", ["distill.overwrite=true"]),
    ("data.num_prompts=0", "distill", ["distill.overwrite=true"]),
    ("data.num_prompts=-1", "distill", ["distill.overwrite=true"]),
    ("pretrain.num_conversations=0", "pretrain", ["pretrain.overwrite=true"]),
    ("distill.batch_size=0", "distill", ["distill.overwrite=true"]),
    ("distill.max_new_tokens=-1", "distill", ["distill.overwrite=true"]),
    ("eval.num_prompts=-1", "eval", []),
    ("eval.max_new_tokens=0", "eval", []),
    ("tree.max_nodes=0", "train", []),
    ("data.eval_fraction=1.5", "train", []),
]
CHAIN_DEEPER_THAN_HEADS = [[0] * n for n in range(1, 10)]  # debug=fast trains fewer heads
# (case, eval's overrides): settings eval refuses before any work.
EVAL_REFUSES = [
    ("tree.choices ints, not paths", ["tree=custom", "tree.choices=[1,2]"]),
    ("tree.choices top-k rank 999", ["tree=custom", "tree.choices=[[999]]"]),
    ("tree.choices without a path's parent", ["tree=custom", "tree.choices=[[0,0,0,0,0,0,0,0,0]]"]),
    (
        "tree.choices chain deeper than the heads",
        ["tree=custom", "tree.choices=" + json.dumps(CHAIN_DEEPER_THAN_HEADS).replace(" ", "")],
    ),
    ("model.device=tpu", ["model.device=tpu"]),
    ("model.device=cuda on a CPU machine", ["model.device=cuda"]),
    ("unknown key", ["eval.no_such_key=1"]),
]


def config_cases() -> list[Case]:
    """Config values out of range or impossible: refused before any work."""
    out = _Cases()
    for name, st, value in CONFIG_OUT_OF_RANGE:
        out.add(
            name, "config", "refuse", lambda wd, st=st, name=name, value=value: stage(st, wd, name, *value)
        )
    for name, overrides in EVAL_REFUSES:
        out.add(name, "config", "refuse", lambda wd, overrides=overrides: stage("eval", wd, *overrides))
    out.add("unknown stage", "config", "refuse", lambda wd: ["stage=deploy", f"workdir={wd}", *BASE_ARGS])
    out.add(
        "model.name_or_path missing folder",
        "config",
        "refuse",
        lambda wd: stage("eval", wd, "model=hf", f"model.name_or_path={wd}/nope"),
    )
    out.add(
        "WORLD_SIZE not a number, train",
        "config",
        "refuse",
        lambda wd: stage("train", wd),
        env={"WORLD_SIZE": "abc"},
    )
    out.add(
        "WORLD_SIZE=2 left without a launcher, train",
        "config",
        "refuse",
        lambda wd: stage("train", wd, "training.overwrite=true"),
        env={"WORLD_SIZE": "2"},
    )
    return out


def jsonl_distill(lines: list[str], strict: bool = False) -> Setup:
    """Setup: ``lines`` as the prompts file of a new distill (``data=jsonl``)."""

    def setup(wd: Path) -> list[str]:
        path = wd / "prompts.jsonl"
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8", errors="surrogatepass")
        extra = ["data.strict=true"] if strict else []
        return stage(
            "distill",
            wd,
            "data=jsonl",
            f"data.path={path}",
            "distill.overwrite=true",
            "data.num_prompts=4",
            *extra,
        )

    return setup


def sharegpt_bad_roles(wd: Path) -> list[str]:
    path = wd / "sg.json"
    path.write_text(json.dumps([{"conversations": [{"from": "alien", "value": "hi"}]}]))
    return stage("distill", wd, "data=sharegpt", f"data.path={path}", "distill.overwrite=true")


def data_cases() -> list[Case]:
    """Data files: bad lines are skipped (or refused with data.strict), nothing usable is refused."""
    out = _Cases()
    good = [json.dumps({"prompt": f"tell me about cats number {i}"}) for i in range(6)]
    deep = "[" * 100000 + "]" * 100000
    out.add("jsonl: a deeply nested line", "data", "ok", jsonl_distill(good + [deep]))
    out.add("jsonl: a lone-surrogate line", "data", "ok", jsonl_distill(good + ['{"prompt": "a \\ud800 b"}']))
    out.add(
        "jsonl: a huge integer line", "data", "ok", jsonl_distill(good + ['{"prompt": ' + "9" * 5000 + "}"])
    )
    out.add("jsonl: a binary line", "data", "ok", jsonl_distill(good + ["\x00\x01\x02garbage"]))
    out.add("jsonl: a bad line, strict", "data", "refuse", jsonl_distill(good + ["{not json"], strict=True))
    out.add("jsonl: every line bad", "data", "refuse", jsonl_distill(["{not json", "[1,2"]))
    out.add("jsonl: empty file", "data", "refuse", jsonl_distill([]))
    out.add(
        "jsonl: missing file",
        "data",
        "refuse",
        lambda wd: stage("distill", wd, "data=jsonl", f"data.path={wd}/none.jsonl", "distill.overwrite=true"),
    )
    out.add(
        "jsonl: a folder as data.path",
        "data",
        "refuse",
        lambda wd: stage("distill", wd, "data=jsonl", f"data.path={wd}", "distill.overwrite=true"),
    )
    out.add("sharegpt: only unknown roles", "data", "refuse", sharegpt_bad_roles)
    return out


def copied(wd: Path) -> list[str]:
    dst = wd.parent / (wd.name + "-copy")
    shutil.copytree(wd, dst, copy_function=shutil.copyfile)
    return stage("all", dst)


def moved(wd: Path) -> list[str]:
    dst = wd.parent / (wd.name + "-moved")
    shutil.move(wd, dst)
    return stage("all", dst)


def heads_untouched(base_heads: str) -> Callable[[Path, Run], str | None]:
    """Check: stage=all skipped the finished work and the heads are still ``base_heads`` (their sha)."""

    def check(wd: Path, run: Run) -> str | None:
        if "skipping" not in run.err and "complete" not in run.err:
            return "stage=all did not skip the finished work"
        if sha(wd / "heads" / "medusa_lm_head.safetensors") != base_heads:
            return "heads retrained"
        return None

    return check


def workdir_place_cases(base: Path) -> list[Case]:
    """A copied, moved or relatively named workdir is the same workdir: stage=all skips its work."""
    out = _Cases()
    untouched = heads_untouched(sha(base / "heads" / "medusa_lm_head.safetensors"))
    out.add("copied workdir, stage=all", "workdir", "ok", copied, check=untouched)
    out.add("moved workdir, stage=all", "workdir", "ok", moved, check=untouched)
    out.add(
        "relative workdir name, stage=all",
        "workdir",
        "ok",
        lambda wd: stage("all", Path(wd.name)),
        cwd=lambda wd: wd.parent,
        check=untouched,
    )
    return out


def damaged_run_state(wd: Path) -> list[str]:
    """Setup: the heads removed and the last checkpoint's trainer_state.json truncated: train resumes."""
    shutil.rmtree(wd / "heads")
    truncate(wd / "train" / "checkpoint-6" / "trainer_state.json")
    return stage("train", wd)


def damaged_optimizer_state(keep: float) -> Setup:
    """Setup: the heads removed and the last checkpoint's optimizer.pt cut to ``keep`` of its size
    (0: emptied, as a power loss leaves a file the Trainer wrote without fsync): train resumes from
    the checkpoint before it."""

    def setup(wd: Path) -> list[str]:
        shutil.rmtree(wd / "heads")
        truncate(wd / "train" / "checkpoint-6" / "optimizer.pt", keep)
        return stage("train", wd)

    return setup


def damaged_hidden_cache(wd: Path) -> list[str]:
    shutil.rmtree(wd / "heads")
    for f in (wd / "train" / "hidden_cache").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            truncate(f)
    return stage("train", wd)


def damaged_init_heads(wd: Path) -> list[str]:
    other = wd.parent / "init"
    shutil.copytree(wd / "heads", other)
    truncate(other / "medusa_lm_head.safetensors")
    return stage("train", wd, f"training.init_heads={other}", "training.overwrite=true")


def damaged_compare(wd: Path) -> list[str]:
    other = wd.parent / "other"
    shutil.copytree(wd / "heads", other)
    truncate(other / "medusa_lm_head.safetensors")
    return stage("eval", wd, f"eval.compare=[{other}]")


def heads_mismatch(wd: Path) -> list[str]:
    cfg = _json(wd / "heads" / "config.json")
    cfg["medusa_num_heads"] = cfg["medusa_num_heads"] + 2
    (wd / "heads" / "config.json").write_text(json.dumps(cfg))
    return stage("export", wd)


def pickled_heads(wd: Path) -> list[str]:
    import torch

    torch.save({"x": torch.zeros(2)}, wd / "heads" / "medusa_lm_head.safetensors")
    return stage("export", wd)


def damaged_file_cases() -> list[Case]:
    """A file of the workdir truncated, deleted or replaced: the stage that writes it repairs it
    (group ``workdir``), a stage that reads it refuses with one line (group ``artefact``) or, where the
    file is a resumable run's state, resumes."""
    out = _Cases()
    add = out.add
    add(
        "truncated progress.json, distill",
        "workdir",
        "ok",
        truncated("distill/progress.json", "distill"),
        check=distill_matches_manifest,
    )
    add(
        "truncated shard, distill",
        "workdir",
        "ok",
        lambda wd: (truncate(second_shard(wd)), stage("distill", wd))[1],
        check=distill_matches_manifest,
    )
    add(
        "truncated shard, train",
        "artefact",
        "refuse",
        lambda wd: (truncate(second_shard(wd)), stage("train", wd, "training.overwrite=true"))[1],
    )
    add(
        "deleted shard, train",
        "artefact",
        "refuse",
        lambda wd: (second_shard(wd).unlink(), stage("train", wd, "training.overwrite=true"))[1],
    )
    add(
        "deleted shard, distill",
        "workdir",
        "ok",
        lambda wd: (second_shard(wd).unlink(), stage("distill", wd))[1],
        check=distill_matches_manifest,
    )
    add(
        "truncated manifest.json, train",
        "artefact",
        "refuse",
        truncated("distill/manifest.json", "train", "training.overwrite=true"),
    )
    add(
        "manifest.json a list, train",
        "artefact",
        "refuse",
        written("distill/manifest.json", "[1, 2]", "train", "training.overwrite=true"),
    )
    add(
        "truncated run.json, train",
        "artefact",
        "refuse",
        lambda wd: (shutil.rmtree(wd / "heads"), truncate(wd / "train" / "run.json"), stage("train", wd))[2],
    )
    add("truncated trainer_state.json, train resumes", "artefact", "ok", damaged_run_state)
    add("truncated optimizer.pt, train resumes", "artefact", "ok", damaged_optimizer_state(0.5))
    add("empty optimizer.pt, train resumes", "artefact", "ok", damaged_optimizer_state(0.0))
    add("truncated hidden-state cache, train", "artefact", "ok", damaged_hidden_cache)
    add("truncated calibration.json, eval", "artefact", "refuse", truncated("heads/calibration.json", "eval"))
    add(
        "calibration.json a string, eval",
        "artefact",
        "refuse",
        written("heads/calibration.json", '"x"', "eval"),
    )
    add(
        "truncated medusa_choices.json, eval",
        "artefact",
        "refuse",
        truncated("heads/medusa_choices.json", "eval"),
    )
    add("truncated heads config.json, export", "artefact", "refuse", truncated("heads/config.json", "export"))
    add("heads config.json a list, eval", "artefact", "refuse", written("heads/config.json", "[]", "eval"))
    add(
        "truncated heads safetensors, export",
        "artefact",
        "refuse",
        truncated("heads/medusa_lm_head.safetensors", "export"),
    )
    add(
        "truncated heads safetensors, eval",
        "artefact",
        "refuse",
        truncated("heads/medusa_lm_head.safetensors", "eval"),
    )
    add("truncated training.init_heads, train", "artefact", "refuse", damaged_init_heads)
    add("truncated eval.compare heads, eval", "artefact", "refuse", damaged_compare)
    add("heads config vs weights mismatch, export", "artefact", "refuse", heads_mismatch)
    add("a pickle as heads safetensors, export", "artefact", "refuse", pickled_heads)
    add(
        "truncated pretrain weights, distill",
        "artefact",
        "refuse",
        truncated("pretrain/model.safetensors", "distill", "distill.overwrite=true"),
    )
    add(
        "garbage pretrain config.json, eval",
        "artefact",
        "refuse",
        written("pretrain/config.json", "{ garbage", "eval"),
    )
    add(
        "truncated export safetensors, eval of export",
        "artefact",
        "refuse",
        lambda wd: (
            truncate(wd / "export" / "medusa" / "medusa_lm_head.safetensors"),
            stage("eval", wd, f"eval.heads_dir={wd}/export/medusa"),
        )[1],
    )
    add(
        "truncated eval/report.json, export",
        "artefact",
        "ok",
        truncated("eval/report.json", "export"),
        check=export_complete,
    )
    return out


def damaged_lora(damage: str) -> Setup:
    """Setup: train Medusa-2 with LoRA on the copy, then damage the adapter's weights or config."""

    def setup(wd: Path) -> list[str]:
        m2 = [
            "training=medusa2",
            "training.backbone_tuning=lora",
            "training.overwrite=true",
            "training.max_steps=2",
            "training.save_steps=2",
        ]
        r = run_cli(stage("train", wd, *m2), REPO)
        if r.rc != 0:
            raise RuntimeError(f"medusa2 training for the case failed: {r.err[-1500:]}")
        adapter = wd / "heads" / "backbone"
        if damage == "weights":
            truncate(adapter / "adapter_model.safetensors")
        else:
            (adapter / "adapter_config.json").write_text("garbage{")
        return stage("export", wd)

    return setup


def lora_cases() -> list[Case]:
    """Medusa-2's LoRA adapter, damaged (trained once on the copy first): export refuses."""
    out = _Cases()
    out.add("truncated LoRA adapter weights, export", "artefact", "refuse", damaged_lora("weights"))
    out.add("garbage adapter_config.json, export", "artefact", "refuse", damaged_lora("config"))
    return out


def other_heads(wd: Path) -> list[str]:
    """Setup: export heads from elsewhere (this workdir's heads, changed, without training settings)."""
    other = wd.parent / "other-heads"
    shutil.copytree(wd / "heads", other)
    from safetensors.torch import load_file, save_file

    state = load_file(str(other / "medusa_lm_head.safetensors"))
    state = {k: v + 0.01 for k, v in state.items()}
    save_file(state, str(other / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    cfg = _json(other / "config.json")
    cfg.pop("training", None)
    (other / "config.json").write_text(json.dumps(cfg))
    return stage("export", wd, f"export.heads_dir={other}")


def wrong_result_cases(base: Path) -> list[Case]:
    """Results that could be silently wrong: a model card of heads from elsewhere, plots of an older run."""
    out = _Cases()
    own_tau = _json(base / "eval" / "report.json")["tau"]
    out.add(
        "export.heads_dir of other heads: card",
        "wrong",
        "ok",
        other_heads,
        check=all_of(export_complete, card_not_ours(own_tau)),
    )
    out.add(
        "eval without the tree sweep: plots",
        "wrong",
        "ok",
        lambda wd: stage("eval", wd, "eval.sweep_tree_sizes=[]"),
        check=eval_consistent,
    )
    return out


# (case, command, kill at a "replace" or an "open" of, path ending, nth such call, check of the rerun)
SIGKILLS = [
    ("SIGKILL in export's publish", lambda wd: stage("export", wd), "replace", "/export", 1, export_complete),
    ("SIGKILL in eval's publish", lambda wd: stage("eval", wd), "replace", "/eval", 1, eval_consistent),
    (
        "SIGKILL in heads' publish",
        lambda wd: stage("train", wd, "training.overwrite=true"),
        "replace",
        "/heads",
        1,
        None,
    ),
    (
        "SIGKILL in recalibrated heads' publish",
        lambda wd: stage("train", wd, "tree.max_nodes=6"),
        "replace",
        "/heads",
        1,
        None,
    ),
    (
        "SIGKILL in pretrain's publish",
        lambda wd: stage("pretrain", wd, "pretrain.overwrite=true"),
        "replace",
        "/pretrain",
        1,
        None,
    ),
    (
        "SIGKILL at a shard of a new distill",
        new_distill,
        "replace",
        "shard-00001.arrow",
        1,
        distill_matches_manifest,
    ),
    (
        "SIGKILL at a new distill's manifest",
        new_distill,
        "replace",
        "manifest.json",
        1,
        distill_matches_manifest,
    ),
    (
        "SIGKILL inside a train checkpoint",
        lambda wd: stage("train", wd, "training.overwrite=true"),
        "open",
        "checkpoint-3/trainer_state.json",
        1,
        None,
    ),
    ("SIGKILL at eval's report", lambda wd: stage("eval", wd), "replace", "report.json", 1, eval_consistent),
    (
        "SIGKILL at export's model card",
        lambda wd: stage("export", wd),
        "replace",
        "README.md",
        1,
        export_complete,
    ),
]
# (case, command, interrupt at a "replace" or an "open" of, path ending)
SIGINTS = [
    ("SIGINT at a shard of a new distill", new_distill, "replace", "shard-00001.arrow"),
    (
        "SIGINT inside a train checkpoint",
        lambda wd: stage("train", wd, "training.overwrite=true"),
        "open",
        "checkpoint-3/trainer_state.json",
    ),
    ("SIGINT in export's publish", lambda wd: stage("export", wd), "replace", "/export"),
]


def kill_cases() -> list[Case]:
    """Kills at chosen moments, then the same command again (the rerun is classified)."""
    out = _Cases()
    for name, argv, how, where, nth, check in SIGKILLS:
        fault = {"kind": f"signal_at_{how}", "signal": "SIGKILL", "where": where, "nth": nth}
        out.add(name, "kill", "ok", argv, fault=fault, rerun=True, check=check)
    for name, argv, how, where in SIGINTS:
        fault = {"kind": f"signal_at_{how}", "signal": "SIGINT", "where": where, "nth": 1}
        out.add(name, "kill", "ok", argv, fault=fault, rerun=True)
    return out


# (stage, its overrides, the folder a refused run must leave as it was)
DISK_FAULT_STAGES = [
    ("export", [], "export"),
    ("eval", [], "eval"),
    ("new distill", [], None),  # distill/ removed first: nothing to keep, nothing may be left half
    ("train", ["training.overwrite=true"], "heads"),
]


def file_workdir(wd: Path) -> list[str]:
    f = wd.parent / "a-file"
    f.write_text("x")
    return stage("eval", f)


def environment_cases() -> list[Case]:
    """The machine's faults: a read-only workdir, a full disk, a file where the workdir goes."""
    out = _Cases()
    for st, extra, keep in DISK_FAULT_STAGES:

        def command(wd, st=st, extra=extra):
            return new_distill(wd) if st == "new distill" else stage(st, wd, *extra)

        out.add(
            f"read-only workdir, {st}",
            "environment",
            "refuse",
            command,
            fault={"kind": "read_only", "root": "<wd>"},
            check=None,
            results={"keep": keep},
        )
        out.add(
            f"full disk, {st}",
            "environment",
            "refuse",
            command,
            fault={"kind": "full_disk", "where": ""},
            results={"keep": keep},
        )
    out.add("workdir is a file", "environment", "refuse", file_workdir)
    out.add(
        "workdir inside a file",
        "environment",
        "refuse",
        lambda wd: (wd.parent.joinpath("f2").write_text("x"), stage("eval", wd.parent / "f2" / "wd"))[1],
    )
    return out


def dead_url() -> str:
    """A URL nothing listens on."""
    return f"http://127.0.0.1:{free_port()}/v1"


def server_cases(base: Path, scratch: Path) -> list[Case]:
    """distill.engine=server against stand-in servers (started by the setup, killed when the case ends)."""
    out = _Cases()
    add = out.add
    reference = ServerReference(base, scratch)
    add("server: unreachable URL", "server", "refuse", lambda wd: server_argv(wd, [dead_url()]))
    add(
        "server: URL without /v1",
        "server",
        "refuse",
        lambda wd: server_argv(wd, [start_server()[: -len("/v1")] + "/v2"]),
    )
    add(
        "server: wrong model name",
        "server",
        "refuse",
        lambda wd: server_argv(wd, [start_server()], "distill.server.model=nope"),
    )
    add(
        "server: bad API key (401)",
        "server",
        "refuse",
        lambda wd: server_argv(
            wd, [start_server(None, "--key", "the-right-key")], "distill.server.api_key_env=SWEEP_SERVER_KEY"
        ),
        env={"SWEEP_SERVER_KEY": "a-wrong-key"},
    )
    add(
        "server: API key variable not set",
        "server",
        "refuse",
        lambda wd: server_argv(wd, [start_server()], "distill.server.api_key_env=SWEEP_UNSET_KEY_VARIABLE"),
    )
    add(
        "server: malformed JSON answers",
        "server",
        "refuse",
        lambda wd: server_argv(wd, [start_server(None, "--garbage")]),
    )
    add(
        "server: 429 storm, then answers",
        "server",
        "ok",
        lambda wd: server_argv(
            wd, [start_server(None, "--fail-from", "5", "--fail-first", "6")], "distill.server.max_retries=8"
        ),
        check=reference.check,
    )
    add(
        "server: one of two endpoints dead",
        "server",
        "ok",
        lambda wd: server_argv(wd, [dead_url(), start_server()]),
        check=all_of(reference.check, went_down(0)),
    )
    add(
        "server: one of two endpoints killed mid-run",
        "server",
        "ok",
        lambda wd: server_argv(wd, [start_server(None, "--exit-after", "10"), start_server()]),
        check=all_of(reference.check, went_down(0)),
    )
    ports: dict[str, int] = {}

    def killed_mid_run(wd: Path) -> list[str]:
        ports["killed"] = free_port()
        return server_argv(wd, [start_server(ports["killed"], "--exit-after", "14")])

    add(
        "server: killed mid-run, then the same command resumes",
        "server",
        "ok",
        killed_mid_run,
        rerun=True,
        between=lambda wd: start_server(ports["killed"]) and None,
        check=all_of(reference.check, resumed),
    )
    return out


def cases(base: Path, scratch: Path) -> list[Case]:
    """Every case, in sweep order (``base``: the built workdir, read by the cases checked against it)."""
    return [
        *config_cases(),
        *data_cases(),
        *workdir_place_cases(base),
        *damaged_file_cases(),
        *lora_cases(),
        *wrong_result_cases(base),
        *kill_cases(),
        *environment_cases(),
        *server_cases(base, scratch),
    ]


# -- the sweep --------------------------------------------------------------------------------------------
def classify(case: Case, wd: Path, first: Run, final: Run, before: dict) -> tuple[str, str]:
    """``(outcome, note)`` of a case."""
    kind = final.kind()
    note = ""
    if final.rc == -999:
        return "TIMEOUT", final.err
    if kind == "traceback":
        tail = [line for line in final.err.splitlines() if line.strip()][-1:] or [""]
        return "TRACEBACK", tail[0][:150]
    if kind.startswith("exit"):
        return "TRACEBACK", f"{kind}: {(final.err.strip().splitlines() or [''])[-1][:150]}"
    left = leftovers(wd)
    if kind == "refused":
        note = final.error_lines[0][7:160]
        keep = case.results.get("keep")
        if keep and tree_digest(wd / keep) != before.get(keep):
            return "SILENT-WRONG", f"{keep}/ half-written by a refused run; " + note
        if left:
            return "LEFTOVER", ", ".join(Path(p).name for p in left[:3])
        return ("refused" if case.expect == "refuse" else "UNEXPECTED"), note
    # ok
    if case.check is not None:
        try:
            msg = case.check(wd, final)
        except (OSError, ValueError, KeyError) as err:  # the result is not even there to check
            msg = f"result unreadable: {type(err).__name__}: {err}"[:150]
        if msg:
            return "SILENT-WRONG", msg
    if left:
        return "LEFTOVER", ", ".join(Path(p).name for p in left[:3])
    if case.expect == "refuse":
        return "UNEXPECTED", "worked where a refusal was expected"
    return "ok", "repaired / worked" if first is not final else "worked"


def run_case(case: Case, base: Path, scratch: Path) -> tuple[str, str, float]:
    root = scratch / re.sub(r"[^a-z0-9]+", "-", case.name.lower()).strip("-")
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    wd = root / "wd"
    shutil.copytree(base, wd, symlinks=True)
    before = {k: tree_digest(wd / k) for k in ("export", "eval", "distill", "heads")}
    try:
        argv = case.setup(wd)
    except Exception as err:  # noqa: BLE001 - a case that cannot be set up is reported, not fatal
        stop_servers()
        return "SETUP-FAILED", f"{type(err).__name__}: {err}"[:150], 0.0
    if not wd.exists():  # moved
        wd = next(p for p in root.iterdir() if p.is_dir() and p.name.startswith("wd-"))
    wd_final = wd
    for p in root.iterdir():
        if p.name.endswith("-copy"):
            wd_final = p
    cwd = case.cwd(wd) if case.cwd else REPO
    fault = json.loads(json.dumps(case.fault).replace("<wd>", str(wd))) if case.fault else None
    try:
        first = run_cli(argv, cwd, fault, extra_env=case.env)
        seconds = first.seconds
        final = first
        if case.rerun:
            if first.rc == 0:
                return "UNEXPECTED", "the kill did not happen (no such moment)", seconds
            if "Traceback" in first.err and first.rc != -9:
                return (
                    "TRACEBACK",
                    "the interrupted run: " + first.err.strip().splitlines()[-1][:140],
                    seconds,
                )
            if case.between is not None and first.kind() != "refused":  # a server fault: one line, exit 2
                return (
                    "TRACEBACK",
                    f"the interrupted run: {first.kind()}: {first.err.strip()[-140:]}",
                    seconds,
                )
            if case.between is not None:
                case.between(wd)
            final = run_cli(argv, cwd, None, extra_env=case.env)
            seconds += final.seconds
    finally:
        stop_servers()
    outcome, note = classify(case, wd_final, first, final, before)
    if case.rerun and first.rc == 2 and outcome == "ok":
        note = "first run: " + first.error_lines[0][7:120] + "; rerun resumed"
    return outcome, note, seconds


def build_base(base: Path) -> None:
    if (base / "eval" / "report.json").is_file():
        return
    if base.exists():
        shutil.rmtree(base)
    r = run_cli(stage("all", base), REPO, timeout=1800)
    if r.rc != 0:
        raise SystemExit(f"building the base workdir failed:\n{r.err[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/fault-sweep"))
    ap.add_argument("--only", default="", help="run only cases whose name contains this")
    ap.add_argument("--keep", action="store_true", help="keep each case's folder")
    ap.add_argument(
        "--fresh", action="store_true", help="run every case again (else reuse root/results.jsonl)"
    )
    args = ap.parse_args(argv)
    base, scratch = args.root / "base", args.root / "cases"
    t0 = time.time()
    build_base(base)
    print(f"base workdir {base} ({time.time() - t0:.0f} s)", flush=True)
    rows = []
    done_file = args.root / "results.jsonl"  # a restarted sweep reuses the cases already run
    done = {}
    if done_file.is_file() and not args.fresh:
        done = {r["name"]: r for r in map(json.loads, done_file.read_text().splitlines())}
    for case in cases(base, scratch):
        if args.only and args.only not in case.name:
            continue
        if case.name in done:
            r = done[case.name]
            rows.append((case.group, case.name, case.expect, r["outcome"], r["note"], r["seconds"]))
            continue
        outcome, note, seconds = run_case(case, base, scratch)
        with done_file.open("a") as fh:
            fh.write(
                json.dumps({"name": case.name, "outcome": outcome, "note": note, "seconds": seconds}) + "\n"
            )
        rows.append((case.group, case.name, case.expect, outcome, note, seconds))
        print(f"{outcome:13s} {case.group:11s} {case.name:45s} {seconds:5.0f}s  {note}", flush=True)
        if not args.keep:
            shutil.rmtree(
                scratch / re.sub(r"[^a-z0-9]+", "-", case.name.lower()).strip("-"), ignore_errors=True
            )
    counts = Counter(r[3] for r in rows)
    print()
    print("| group | case | expected | outcome | note |")
    print("|---|---|---|---|---|")
    for group, name, expect, outcome, note, _ in rows:
        print(f"| {group} | {name} | {expect} | {outcome} | {note.replace('|', '/')} |")
    print()
    bad = sum(v for k, v in counts.items() if k.isupper())
    print(
        f"summary: {len(rows)} cases: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        + f"; {bad} off target ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} cores, {time.time() - t0:.0f} s)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
