"""The process group's end of life: a launched rank leaves it before exiting, nothing else is touched;
then the rank's process ends with its stage's exit code, after its exit work."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as tdist

from medusa_train import __main__ as cli
from medusa_train import dist
from medusa_train.config import compose_config

REPO = Path(__file__).resolve().parents[2]


def _one_process_group(monkeypatch: pytest.MonkeyPatch, launched: bool) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        if launched:
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)
    tdist.init_process_group("gloo", rank=0, world_size=1)


def test_a_launched_rank_leaves_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    _one_process_group(monkeypatch, launched=True)
    dist.leave()
    assert not tdist.is_initialized()
    dist.leave()  # nothing left: a no-op


def test_a_group_this_process_was_not_launched_with_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _one_process_group(monkeypatch, launched=False)
    try:
        dist.leave()
        assert tdist.is_initialized()  # a library user's own group
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_the_cli_leaves_the_group_when_the_stage_ends(monkeypatch: pytest.MonkeyPatch, outcome: str) -> None:
    """A failing rank leaves too, so its exit code is the stage's error, not an abort at exit."""

    def stage(cfg):
        assert tdist.is_initialized()
        if outcome == "raises":
            raise RuntimeError("stage failed")
        return {"done": True}

    _one_process_group(monkeypatch, launched=True)
    monkeypatch.setattr(cli, "get_stage", lambda name: stage)
    if outcome == "raises":
        with pytest.raises(RuntimeError, match="stage failed"):
            cli.run_stage(compose_config(["stage=eval"]))
    else:
        assert cli.run_stage(compose_config(["stage=eval"])) == {"done": True}
    assert not tdist.is_initialized()


def test_ctrl_c_does_not_wait_to_leave_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted, a rank exits at once: leaving could wait on a collective still in flight."""

    def interrupted_stage(cfg):
        raise KeyboardInterrupt

    _one_process_group(monkeypatch, launched=True)
    monkeypatch.setattr(cli, "get_stage", lambda name: interrupted_stage)
    try:
        with pytest.raises(KeyboardInterrupt):
            cli.run_stage(compose_config(["stage=eval"]))
        assert tdist.is_initialized()
    finally:
        tdist.destroy_process_group()


# -- the end of a launched rank's process ----------------------------------------------------------
_LAUNCHED_RANK = """
import atexit, os, socket, sys, threading, time
from pathlib import Path
out, outcome = Path(sys.argv[1]), sys.argv[2]
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as tdist
tdist.init_process_group("gloo")
import torch._dynamo  # after the group: it keeps the group's threads alive past destroy_process_group
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
ddp(torch.ones(2, 4)).sum().backward()
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late_writer():
    time.sleep(0.5)
    (out / "thread").write_text("ran")
threading.Thread(target=late_writer).start()  # not a daemon: the process waits for it
from medusa_train import __main__ as cli
def stage(cfg):
    print("published", end="")  # no newline, no flush: only a flush at exit shows it
    if outcome == "user-error":
        raise cli.UserError("workdir has no heads: run stage=train first")
    if outcome == "bug":
        raise ZeroDivisionError("a bug")
    if outcome == "interrupt":
        raise KeyboardInterrupt
    return {}
cli.get_stage = lambda name: stage
cli.check_inputs = lambda cfg: None  # the stage above needs no heads
sys.argv = ["medusa_train", "stage=eval", f"workdir={out}"]
cli.entry()
"""


@pytest.mark.parametrize(
    ("outcome", "code", "says"),
    [
        ("returns", 0, None),
        ("user-error", 2, "error: workdir has no heads: run stage=train first"),
        ("bug", 1, "ZeroDivisionError: a bug"),
        ("interrupt", 130, "interrupted: run the same command again to resume"),
    ],
)
def test_a_launched_rank_exits_with_its_stage_code_after_its_exit_work(
    tmp_path: Path, outcome: str, code: int, says: str | None
) -> None:
    """A launched rank ends without the interpreter's finalization (dist.end_process), after doing
    what it would have done: its exit code is the stage's, its non-daemon threads finished, its
    atexit handlers ran, what it printed is flushed."""
    proc = subprocess.run(
        [sys.executable, "-c", _LAUNCHED_RANK, str(tmp_path), outcome],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    assert proc.stdout.endswith("published")
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "ran"
    if says:
        assert says in proc.stderr
    if outcome == "bug":
        assert "Traceback" in proc.stderr


def test_a_process_without_a_launcher_exits_as_usual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not launched: entry() is sys.exit(main()) (tests and library users call main() directly)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(cli, "main", lambda: 2)
    monkeypatch.setattr(dist, "end_process", lambda code: pytest.fail("end_process outside a launch"))
    with pytest.raises(SystemExit) as stop:
        cli.entry()
    assert stop.value.code == 2
