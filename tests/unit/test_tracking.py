"""wandb runs end in the state the stage ended in: finished after its work, failed after a crash or Ctrl-C.

wandb only learns of an exception at interpreter exit; a run the stage closed on the way out was
already marked finished by then. A stand-in ``wandb`` module records how each run was opened, what
it logged at which step, and how it was closed. A stage that resumes its work continues its run,
checked also on the files the real wandb writes offline.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from medusa_train.data.distilled import read_shard_counts
from medusa_train.errors import UserError
from medusa_train.stages import distill, train
from medusa_train.stages import eval as eval_stage
from medusa_train.tracking import Tracker
from tests.helpers.distill import run_distill, write_prompts
from tests.helpers.fake_openai import FakeOpenAI
from tests.helpers.tiny_workdir import make_workdir, tiny_cfg
from tests.helpers.train_workdir import make_train_workdir, run_killed_at_step, train_cfg
from tests.helpers.wandb_offline import read_offline_runs


class _Run:
    """What the stages use of a wandb run; ``init`` holds ``wandb.init``'s arguments, ``steps`` the step
    of every ``log``, ``axes`` the x axis of every ``define_metric`` (None: wandb's step), ``closed`` the
    exit code of every ``finish``."""

    def __init__(self, **init) -> None:
        self.init = init
        self.summary: dict = {}
        self.logged: list[dict] = []
        self.steps: list[int | None] = []
        self.axes: dict[str, str | None] = {}
        self.closed: list[int | None] = []

    def log(self, metrics: dict, step: int | None = None) -> None:
        self.logged.append(metrics)
        self.steps.append(step)

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.axes[name] = step_metric

    def finish(self, exit_code: int | None = None) -> None:
        self.closed.append(exit_code)


class _WandbError(Exception):
    """Stands in for ``wandb.errors.Error``, what ``wandb.init`` raises for a run it refuses."""


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[_Run]:
    """Every run opened through a stand-in ``wandb`` module, in order."""
    opened: list[_Run] = []

    def init(**kwargs) -> _Run:
        opened.append(_Run(**kwargs))
        return opened[-1]

    wandb = types.SimpleNamespace(init=init, Image=str, errors=types.SimpleNamespace(Error=_WandbError))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
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


QUICK_EVAL = [
    "stage=eval",
    "tracking.mode=offline",
    "eval.num_prompts=1",
    "eval.max_new_tokens=8",
    "eval.acceptance_extra=false",
    "eval.sweep_tree_sizes=[]",
    "eval.batch_sizes=[1]",
]


def test_eval_that_wandb_refuses_fails_before_the_backbone_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: list[_Run]
) -> None:
    """A run wandb will not start is the one-line error before the evaluation's work, not after it."""

    def refuses(**_) -> _Run:
        raise _WandbError("No API key configured. Use `wandb login` to log in.")

    def loads(*_, **__):
        raise AssertionError("the backbone loaded before wandb started the run")

    monkeypatch.setattr(sys.modules["wandb"], "init", refuses)
    monkeypatch.setattr(eval_stage, "load_backbone_for_heads", loads)
    with pytest.raises(UserError, match="tracking.mode=offline: wandb could not start a run"):
        eval_stage.run(tiny_cfg(make_workdir(tmp_path / "wd"), *QUICK_EVAL))


def test_eval_run_holds_its_figures_or_is_closed_as_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: list[_Run]
) -> None:
    """The run opens before the evaluation: a crash in it closes the run as failed; a completed one
    gets the report's figures, the alternatives, the batch table and the plots, then closes finished."""
    workdir = make_workdir(tmp_path / "wd")

    def crashes(*_, **__):
        raise RuntimeError("a decoder that crashed")

    with monkeypatch.context() as patch:
        patch.setattr(eval_stage, "TimedDecoders", crashes)
        with pytest.raises(RuntimeError, match="crashed"):
            eval_stage.run(tiny_cfg(workdir, *QUICK_EVAL))
    assert len(runs) == 1 and runs[0].closed == [1]
    report = eval_stage.run(tiny_cfg(workdir, *QUICK_EVAL))
    run = runs[1]
    assert run.closed == [0] and run.summary["tau"] == report["tau"]
    assert (
        run.summary["prompt_lookup/tokens_per_s"] == report["alternatives"]["prompt_lookup"]["tokens_per_s"]
    )
    assert [row for row in run.logged if any(k.startswith("batch/") for k in row)] == [
        {f"batch/{k}": v for k, v in row.items()} for row in report["batch_sizes"]
    ]
    assert {key for row in run.logged for key in row if key.startswith("eval/")} == {
        f"eval/{path.stem}" for path in (workdir / "eval" / "plots").glob("*.png")
    }


def test_eval_plots_its_sweep_and_batch_sizes_against_tree_and_batch_size(
    tmp_path: Path, runs: list[_Run]
) -> None:
    """The sweep's and the batch table's rows are logged without a step (wandb numbers them 0, 1, ...):
    each family is plotted against its own x, which every one of its rows holds."""
    report = eval_stage.run(
        tiny_cfg(
            make_workdir(tmp_path / "wd"),
            *[o for o in QUICK_EVAL if not o.startswith(("eval.num_prompts", "eval.sweep", "eval.batch"))],
            "eval.num_prompts=2",
            "eval.sweep_tree_sizes=[1,4]",
            "eval.batch_sizes=[1,2]",
        )
    )
    (run,) = runs
    assert run.axes == {
        "sweep/tree_size": None,
        "sweep/*": "sweep/tree_size",
        "batch/batch_size": None,
        "batch/*": "batch/batch_size",
    }
    sweep_rows = [row for row in run.logged if any(k.startswith("sweep/") for k in row)]
    batch_rows = [row for row in run.logged if any(k.startswith("batch/") for k in row)]
    assert [(row["sweep/tree_size"], row["sweep/tau"]) for row in sweep_rows] == [
        (row["tree_size"], row["tau"]) for row in report["sweep"]
    ]
    assert [(row["batch/batch_size"], row["batch/tau"]) for row in batch_rows] == [
        (row["batch_size"], row["tau"]) for row in report["batch_sizes"]
    ]
    assert [row["tree_size"] for row in report["sweep"]] == [1, 4, 5] and len(report["batch_sizes"]) == 2


def test_a_disabled_tracker_defines_no_axis() -> None:
    Tracker(None).define_axis("sweep", "tree_size")  # no run: nothing to reach


def test_the_axes_reach_wandbs_offline_run(tmp_path: Path, offline_wandb: None) -> None:
    """The real wandb takes the axes: its run file holds the x of every ``sweep/`` metric."""
    from medusa_train.config import compose_config
    from medusa_train.tracking import start_tracking

    cfg = compose_config([f"workdir={tmp_path / 'wd'}"])
    with start_tracking(cfg.tracking, cfg.workdir, "eval") as tracker:
        tracker.define_axis("sweep", "tree_size")
        for size in (4, 16):
            tracker.log({"sweep/tau": size / 8, "sweep/tree_size": size})
    (run,) = read_offline_runs(tmp_path / "wd")
    assert run.axes == {"sweep/tree_size": "", "sweep/*": "sweep/tree_size"}
    assert [(row["sweep/tree_size"], row["_step"]) for row in run.history] == [(4, 0), (16, 1)]


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The real wandb, offline, with its settings and caches in ``tmp_path`` (nothing reaches a network).

    wandb keeps one process-wide setup (its service, the settings it read from the environment then,
    the log lines of an init that failed, replayed at the next one): it is torn down before and after,
    so the test sees this environment whatever ran before it in the same pytest worker (an axes test
    once found no axes in its run file after other tests had used wandb in its worker)."""
    import wandb

    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(key, str(tmp_path / "wandb-home" / key.lower()))
    wandb.teardown()
    yield
    wandb.teardown()


def test_killed_and_resumed_training_continues_its_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline_wandb: None
) -> None:
    """A run killed at step 5 and resumed from checkpoint-3 is the same wandb run (the id `wandb sync`
    appends its offline parts under), its steps increasing across the parts: step 4, which the killed
    part logged, is not logged again, and the resumed part goes on to the end."""
    root = make_train_workdir(tmp_path / "wd", n_records=48)
    cfg = train_cfg(root, "tracking.mode=offline")
    run_killed_at_step(cfg, monkeypatch, step=5)
    train.run(cfg)
    killed, resumed = read_offline_runs(root)
    assert killed.id == resumed.id and (killed.exit_code, resumed.exit_code) == (1, 0)
    steps = [row["_step"] for part in (killed, resumed) for row in part.history]
    assert steps == [2, 4, 6], steps
    assert all(row["_step"] == 6 for row in resumed.history if "train/train_runtime" in row)


def test_training_that_fails_before_its_first_step_closes_its_run_as_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: list[_Run]
) -> None:
    """The run is closed whatever raises once it is open: here the Trainer's construction."""

    def refuses(*_, **__):
        raise RuntimeError("a Trainer that cannot be built")

    monkeypatch.setattr(train, "MedusaTrainer", refuses)
    with pytest.raises(RuntimeError, match="cannot be built"):
        train.run(train_cfg(make_train_workdir(tmp_path, n_records=16), "tracking.mode=offline"))
    assert len(runs) == 1 and runs[0].closed == [1]


def test_training_started_again_from_scratch_is_a_new_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: list[_Run]
) -> None:
    """Only a resumed checkpoint continues a run: after training.overwrite=true (or a kill before the first
    checkpoint) training starts at step 1 in a run of its own, every logged step kept."""
    root = make_train_workdir(tmp_path, n_records=48)
    train.run(train_cfg(root, "tracking.mode=offline"))
    train.run(train_cfg(root, "tracking.mode=offline", "training.overwrite=true", "training.lr=2e-2"))
    first, again = runs
    assert first.init["id"] != again.init["id"] and again.init["resume"] is None
    assert first.steps == again.steps and [s for s in again.steps if s is not None][:2] == [2, 4]


def test_killed_and_resumed_distill_continues_its_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: list[_Run], tiny_backbone_dir: Path
) -> None:
    """Distill resumes from its shards on disk: the same run, its step (shards done) going on counting."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=10)
    real_write = distill.write_shard

    def fails_at_the_third(path, rows):
        if path.name.endswith("00002.arrow"):
            raise RuntimeError("injected failure")
        real_write(path, rows)

    monkeypatch.setattr(distill, "write_shard", fails_at_the_third)
    with pytest.raises(RuntimeError, match="injected"):
        run_distill(tmp_path / "wd", tiny_backbone_dir, prompts, "tracking.mode=offline")
    monkeypatch.setattr(distill, "write_shard", real_write)
    run_distill(tmp_path / "wd", tiny_backbone_dir, prompts, "tracking.mode=offline")
    killed, resumed = runs
    assert resumed.init["id"] == killed.init["id"] and resumed.init["resume"] == "allow"
    assert (killed.steps, resumed.steps) == ([1, 2], [3, 4])
    assert (killed.closed, resumed.closed) == ([1], [0])
    # The counts go on from the killed attempt's shards: the totals on disk after each shard
    shards = sorted((tmp_path / "wd" / "distill" / "shards").glob("shard-*.arrow"))
    on_disk = list(itertools.accumulate(read_shard_counts(path)["tokens_generated"] for path in shards))
    logged = killed.logged + resumed.logged
    assert [row["distill/tokens_generated"] for row in logged] == on_disk
    assert [row["distill/records"] for row in logged] == [3, 6, 9, 10] and len(shards) == 4


def test_distill_logs_the_records_it_writes_apart_from_those_it_drops(
    tmp_path: Path, runs: list[_Run], tiny_backbone_dir: Path
) -> None:
    """Through a server, a record whose first reply is not token-exact is written as nothing: its
    shard's ``distill/records`` (the records written, as in the manifest and the run's summary) leaves
    it out and ``distill/records_dropped_not_token_exact`` counts it; together they are the source
    records handled (``distill/records`` counted those)."""
    words = "the cat dog sat on a mat tell me a story about why the day is big".split()
    rows = [{"prompt": [" ".join(words[i : i + 3])]} for i in range(10)]
    for i in (1, 7):  # their replies come with a reasoning part: dropped (split_by_server)
        rows[i]["prompt"] = ["xyzzy " + " ".join(words)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    server = FakeOpenAI(str(tiny_backbone_dir), apart="xyzzy")
    try:
        figures = run_distill(
            tmp_path / "wd", tiny_backbone_dir, prompts, "tracking.mode=offline", "distill.engine=server",
            f"distill.server.urls=[{server.url}]",
        )  # fmt: skip
    finally:
        server.close()
    (run,) = runs
    shards = sorted((tmp_path / "wd" / "distill" / "shards").glob("shard-*.arrow"))
    written = list(itertools.accumulate(read_shard_counts(path)["records"] for path in shards))
    assert [row["distill/records"] for row in run.logged] == written == [2, 5, 7, 8]
    assert [row["distill/records_dropped_not_token_exact"] for row in run.logged] == [1, 1, 2, 2]
    assert (figures["records"], figures["records_dropped_not_token_exact"]) == (8, 2)
    assert run.summary["distill/records"] == 8 and run.summary["distill/records_dropped_not_token_exact"] == 2


def test_tracking_without_wandb_installed_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from medusa_train.config import compose_config
    from medusa_train.tracking import start_tracking

    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` finds when it is not installed
    cfg = compose_config([f"workdir={tmp_path / 'wd'}"])
    with pytest.raises(
        UserError, match=r"tracking.mode=offline: wandb cannot be imported .*tracking=disabled"
    ):
        start_tracking(cfg.tracking, cfg.workdir, "train")
