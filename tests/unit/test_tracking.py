"""wandb runs end in the state the stage ended in: finished after its work, failed after a crash or Ctrl-C.

wandb only learns of an exception at interpreter exit; a run the stage closed on the way out was
already marked finished by then. A stand-in ``wandb`` module records how each run was closed.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from medusa_train.stages import distill
from medusa_train.tracking import Tracker
from tests.helpers.distill import run_distill, write_prompts
from tests.helpers.train_workdir import make_train_workdir, run_killed_at_step, train_cfg


class _Run:
    """What the stages use of a wandb run; ``closed`` holds the exit code of every ``finish``."""

    def __init__(self) -> None:
        self.summary: dict = {}
        self.closed: list[int | None] = []

    def log(self, *_, **__) -> None:
        pass

    def finish(self, exit_code: int | None = None) -> None:
        self.closed.append(exit_code)


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[_Run]:
    """Every run opened through a stand-in ``wandb`` module, in order."""
    opened: list[_Run] = []

    def init(**_) -> _Run:
        opened.append(_Run())
        return opened[-1]

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return opened


def test_a_tracker_closes_its_run_once_as_the_block_ended() -> None:
    ok, crashed = _Run(), _Run()
    with Tracker(ok) as tracker:
        tracker.log({"x": 1})
    with pytest.raises(KeyboardInterrupt), Tracker(crashed):
        raise KeyboardInterrupt
    tracker.finish()  # already closed: nothing more reaches wandb
    assert ok.closed == [0] and crashed.closed == [1]


def test_interrupted_training_marks_its_run_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: list[_Run]
) -> None:
    root = make_train_workdir(tmp_path, n_records=16)
    run_killed_at_step(train_cfg(root, "tracking.mode=offline"), monkeypatch, step=1)
    assert len(runs) == 1 and runs[0].closed == [1]


def test_failed_distill_marks_its_run_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: list[_Run], tiny_backbone_dir: Path
) -> None:
    def crashes(*_, **__):
        raise RuntimeError("a generation that crashed")

    monkeypatch.setattr(distill, "_distill_shards", crashes)
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=2)
    with pytest.raises(RuntimeError, match="crashed"):
        run_distill(tmp_path / "wd", tiny_backbone_dir, prompts, "tracking.mode=offline")
    assert len(runs) == 1 and runs[0].closed == [1]


def test_online_without_a_wandb_login_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb's own refusal (no API key: `wandb login` never ran) is a UserError naming the way out."""
    from medusa_train.config import compose_config
    from medusa_train.errors import UserError
    from medusa_train.tracking import start_tracking

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings: never logged in
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = compose_config([f"workdir={tmp_path / 'wd'}", "tracking=online"])
    with pytest.raises(UserError, match=r"tracking.mode=online: wandb could not start a run \(No API key"):
        start_tracking(cfg.tracking, cfg.workdir, "train")
