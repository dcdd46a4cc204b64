"""A user's mistake or a fault of the machine ends in ONE error line and exit code 2.

Each test runs the CLI in-process (``medusa_train.__main__.main``) on the tiny workdir (random Llama +
random heads, ``tests.helpers.tiny_workdir``) and checks the return code, that stderr holds one
``error:`` line and no traceback, and that nothing half-written is left behind: malformed trees,
a device this machine does not have, hostile data lines, a pickle where safetensors are expected,
a read-only workdir and a full disk during distill, export and eval.

The disk faults are simulated (the tests may run as root, whom ``chmod`` does not stop, and a full
file system cannot be made without mounting one): a read-only workdir by ``mkdir``/``mkstemp``
raising ``EROFS`` under it (a real ``chmod 0555`` when not root), a full disk by ``os.fsync``
raising ``ENOSPC`` -- every artefact is fsynced before it is renamed into place, and that is where
a full disk shows up for writes the page cache took.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from medusa_train import launch
from medusa_train.__main__ import main
from medusa_train.errors import UserError, environment_fault
from tests.helpers.distill import REPO, run_cli
from tests.helpers.tiny_workdir import make_workdir, tiny_overrides
from tests.helpers.train_workdir import make_train_workdir, train_overrides


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_workdir(tmp_path_factory.mktemp("cli_errors"))


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one ``error:`` line on stderr (log lines and progress bars aside, which may leave the cursor
    mid-line); fails on a traceback or a second error."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error: ") == 1, err
    return ("error: " + err.split("error: ", 1)[1]).split("\n", 1)[0]


def _tree(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder`` (empty when it does not exist)."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _leftovers(workdir: Path) -> list[str]:
    return sorted(str(p.relative_to(workdir)) for p in workdir.rglob(".*") if ".tmp" in p.name)


# -- malformed trees ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("choices", "needle"),
    [
        ("[1,2,3]", "tree path 1 is not a non-empty list"),  # ints instead of paths
        ("[[0],[]]", "tree path [] is not"),  # an empty path
        ("[[0],[0,0,0]]", "add [0, 0] to the tree"),  # a missing prefix
    ],
)
def test_malformed_tree_fails_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], choices: str, needle: str
) -> None:
    assert main([f"workdir={tmp_path}", "stage=eval", "tree=custom", f"tree.choices={choices}"]) == 2
    line = _error_line(capsys)
    assert "tree.choices" in line and needle in line, line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("stage", ["export", "eval"])
def test_tree_rank_beyond_the_heads_vocabulary(
    workdir: Path, capsys: pytest.CaptureFixture[str], stage: str
) -> None:
    before = _tree(workdir / stage)
    assert main(tiny_overrides(workdir, f"stage={stage}", "tree=custom", "tree.choices=[[0],[100000]]")) == 2
    line = _error_line(capsys)
    assert "tree path [100000] asks for rank 100000" in line and "candidates" in line, line
    assert _tree(workdir / stage) == before and not _leftovers(workdir)


# -- devices --------------------------------------------------------------------------------------
def test_device_this_machine_does_not_have(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(tiny_overrides(workdir, "stage=eval", "model.device=tpu")) == 2
    assert "model.device='tpu' is not one of" in _error_line(capsys)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, whatever runs this
    assert main(tiny_overrides(workdir, "stage=eval", "model.device=cuda")) == 2
    assert "model.device=cuda but" in _error_line(capsys)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU, asked for the eighth
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(tiny_overrides(workdir, "stage=eval", "model.device=cuda:7")) == 2
    assert "model.device=cuda:7 but this machine has 1 GPU(s)" in _error_line(capsys)
    assert not (workdir / "eval").exists()


# -- hostile data ---------------------------------------------------------------------------------
def test_hostile_data_lines_are_skipped_or_named_in_strict_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n"  # RecursionError in json
        '{"prompt": "\\ud800 lone surrogate"}\n'  # valid JSON, not encodable text
        '{"prompt": ' + "1" * 5000 + "}\n"  # an integer too long to convert
    )
    base = [
        f"workdir={tmp_path / 'run'}",
        "stage=distill",
        "data=jsonl",
        f"data.path={data}",
        "tracking=disabled",
    ]
    assert main(base) == 2
    line = _error_line(capsys)
    assert "no usable record" in line and "nested too deeply" in line and "lone surrogate" in line, line
    assert main([*base, "data.strict=true"]) == 2
    assert "record prompts.jsonl:1: JSON nested too deeply" in _error_line(capsys)
    assert not (tmp_path / "run" / "distill").exists()


# -- a pickle where safetensors are expected ------------------------------------------------------
class _Payload:
    """A pickle that, if unpickled without restrictions, creates ``marker`` (it must not)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickle_heads_are_refused_in_one_line(
    workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    heads = tmp_path / "heads"
    heads.mkdir()
    shutil.copy(workdir / "heads" / "config.json", heads)
    marker = tmp_path / "code-ran"
    (heads / "medusa_lm_head.pt").write_bytes(pickle.dumps({"0.0.linear.weight": _Payload(marker)}))
    out = tmp_path / "out"
    assert main(tiny_overrides(workdir, f"workdir={out}", "stage=export", f"export.heads_dir={heads}")) == 2
    line = _error_line(capsys)
    assert "refused" in line and "medusa_lm_head.pt" in line, line
    assert not marker.exists() and not (out / "export").exists()


# -- the disk -------------------------------------------------------------------------------------
def _read_only(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Make ``root`` read-only: for real when chmod binds this user, else creation under it fails."""
    if os.geteuid() != 0:
        root.chmod(0o555)
        return

    def refuse(path: os.PathLike | str) -> None:
        if Path(path).absolute().is_relative_to(root.absolute()):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    real_mkdir, real_mkstemp = Path.mkdir, tempfile.mkstemp

    def mkdir(self: Path, *args, **kwargs) -> None:
        if not self.exists():
            refuse(self)
        return real_mkdir(self, *args, **kwargs)

    def mkstemp(*args, **kwargs):
        refuse(kwargs.get("dir") or (args[2] if len(args) > 2 else tempfile.gettempdir()))
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def test_read_only_workdir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_workdir(tmp_path / "run")
    before = _tree(root)
    _read_only(monkeypatch, root)
    try:
        assert main(tiny_overrides(root, "stage=export")) == 2
    finally:
        root.chmod(0o755)
    line = _error_line(capsys)
    assert ("read-only" in line or "permission denied" in line) and str(root) in line, line
    assert _tree(root) == before and not _leftovers(root)


def test_workdir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "a question?"}) + "\n")
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    argv = [
        f"workdir={afile}",
        "stage=distill",
        "debug=fast",
        "tracking=disabled",
        "data=jsonl",
        f"data.path={data}",
    ]
    assert (
        main([*argv, "model=hf", f"model.name_or_path={make_workdir(tmp_path / 'run') / 'base_model'}"]) == 2
    )
    assert f"a file stands where a folder is needed: {afile}: pass workdir=<a folder>" in _error_line(capsys)
    assert afile.read_text() == "not a folder"


def _no_stage(name: str):
    raise AssertionError(f"stage={name} started: the workdir should have been refused first")


@pytest.mark.parametrize("below", ["", "sub/run"])
@pytest.mark.parametrize("stage", ["pretrain", "all", "eval"])
def test_workdir_under_a_file_is_refused_before_any_stage(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
    below: str,
) -> None:
    """stage=pretrain and stage=all (the demo) met the file at their first mkdir, after pretraining, with a
    FileExistsError traceback; the stages that read first said to run an earlier stage."""
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    monkeypatch.setattr("medusa_train.__main__.get_stage", _no_stage)
    workdir = afile / below if below else afile
    assert main([f"workdir={workdir}", f"stage={stage}", "debug=fast", "tracking=disabled"]) == 2
    assert f"a file stands where a folder is needed: {afile}: pass workdir=<a folder>" in _error_line(capsys)
    assert afile.read_text() == "not a folder"


@pytest.mark.parametrize(
    ("fault", "says"), [("permission", "permission denied"), ("read-only", "the file system is read-only")]
)
@pytest.mark.parametrize("below", ["", "sub"])
def test_workdir_without_write_access_is_refused_before_any_stage(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    says: str,
    below: str,
) -> None:
    """A workdir (or, not made yet, the folder it goes in) this user cannot write, or on a read-only
    disk, is refused before any stage starts: the fault showed at the stage's first write, after a
    whole pretraining or evaluation."""
    root = tmp_path / "run"
    root.mkdir()
    inside = lambda path: Path(path).absolute().is_relative_to(root.absolute())  # noqa: E731
    real_access, real_statvfs = os.access, os.statvfs
    if fault == "permission" and os.geteuid() != 0:
        root.chmod(0o555)
    else:  # root writes anywhere a disk allows: the check's view of the folder is simulated
        monkeypatch.setattr(
            os, "access", lambda path, mode, **kw: not inside(path) and real_access(path, mode, **kw)
        )
    if fault == "read-only":
        monkeypatch.setattr(
            os,
            "statvfs",
            lambda path: SimpleNamespace(f_flag=os.ST_RDONLY) if inside(path) else real_statvfs(path),
        )
    monkeypatch.setattr("medusa_train.__main__.get_stage", _no_stage)
    try:
        assert main([f"workdir={root / below}", "stage=pretrain", "debug=fast", "tracking=disabled"]) == 2
    finally:
        root.chmod(0o755)
    line = _error_line(capsys)
    assert line.startswith(f"error: {says}") and f"{root}: " in line and "pass workdir=" in line, line
    assert not any(root.iterdir())


def _deny_access(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """The workdir check's view of ``folder``: not writable (root writes anywhere a disk allows)."""
    denied, real_access = folder.absolute(), os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda path, mode, **kw: Path(path).absolute() != denied and real_access(path, mode, **kw),
    )


@pytest.mark.parametrize(
    ("stage", "folder"), [("distill", "distill/shards"), ("train", "heads"), ("all", "export/medusa")]
)
def test_a_stage_folder_without_write_access_is_refused_before_any_stage(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
    folder: str,
) -> None:
    """A folder of the workdir a stage writes (or one under it) that this user cannot write was found
    at the stage's first write there, after its work (a whole distillation or training)."""
    root = tmp_path / "run"
    (root / folder).mkdir(parents=True)
    _deny_access(monkeypatch, root / folder)
    monkeypatch.setattr("medusa_train.__main__.get_stage", _no_stage)
    assert main([f"workdir={root}", f"stage={stage}", "debug=fast", "tracking=disabled"]) == 2
    line, where = _error_line(capsys), (root / folder).absolute()
    assert line.startswith(f"error: permission denied: {where}: give this user access to {where}"), line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder whatever its mode")
def test_a_read_only_stage_folder_is_refused_before_any_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = tmp_path / "run" / "distill" / "shards"
    shards.mkdir(parents=True)
    shards.chmod(0o555)
    monkeypatch.setattr("medusa_train.__main__.get_stage", _no_stage)
    try:
        assert main([f"workdir={tmp_path / 'run'}", "stage=distill", "debug=fast", "tracking=disabled"]) == 2
    finally:
        shards.chmod(0o755)
    assert _error_line(capsys).startswith(f"error: permission denied: {shards.absolute()}: ")


@pytest.mark.parametrize("link", ["distill", "."])
def test_a_symlink_loop_is_one_line_before_any_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, link: str
) -> None:
    """A symlink loop at a stage's folder, or at the workdir itself: one line, not a traceback."""
    (tmp_path / "run").mkdir()
    looped = tmp_path / "run" / "distill" if link == "distill" else tmp_path / "loop"
    looped.symlink_to(looped.name)
    root = tmp_path / "run" if link == "distill" else looped
    monkeypatch.setattr("medusa_train.__main__.get_stage", _no_stage)
    assert main([f"workdir={root}", "stage=distill", "debug=fast", "tracking=disabled"]) == 2
    assert _error_line(capsys).startswith(f"error: {looped} leads through a symlink loop")


@pytest.mark.parametrize(("stage", "folder"), [("distill", "export"), ("eval", "export")])
def test_a_folder_the_stage_does_not_write_is_not_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str, folder: str
) -> None:
    """eval rewrites the export's model card, but a card it cannot write is a warning, not a failure."""
    root = tmp_path / "run"
    (root / folder).mkdir(parents=True)
    _deny_access(monkeypatch, root / folder)
    ran: list[str] = []
    monkeypatch.setattr("medusa_train.__main__.get_stage", lambda name: lambda cfg: ran.append(name) or {})
    monkeypatch.setattr("medusa_train.__main__.check_inputs", lambda cfg: None)  # no stage runs
    assert main([f"workdir={root}", f"stage={stage}", "debug=fast", "tracking=disabled"]) == 0
    assert ran == [stage]


@pytest.mark.parametrize(
    ("stage", "folder", "finished"),
    [("distill", "distill", "manifest.json"), ("pretrain", "pretrain", "train_report.json")],
)
def test_a_read_only_finished_output_is_reused_and_refused_with_overwrite(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
    folder: str,
    finished: str,
) -> None:
    """Distilled data (or the embedded model) made read-only once finished, a team's shared copy: a run
    with its settings reuses it without writing there, so the check before any work lets it through
    (in stage=all too); with the stage's overwrite, which replaces it, it is refused."""
    root = tmp_path / "run"
    (root / folder / "shards").mkdir(parents=True)
    (root / folder / finished).write_text("{}")
    _deny_access(monkeypatch, root / folder / "shards")
    ran: list[str] = []
    monkeypatch.setattr("medusa_train.__main__.get_stage", lambda name: lambda cfg: ran.append(name) or {})
    monkeypatch.setattr("medusa_train.__main__.check_inputs", lambda cfg: None)  # no stage runs
    args = [f"workdir={root}", "debug=fast", "tracking=disabled"]
    assert main([*args, f"stage={stage}"]) == 0 and ran == [stage]
    assert main([*args, f"stage={stage}", f"{stage}.overwrite=true"]) == 2
    where = (root / folder / "shards").absolute()
    assert _error_line(capsys).startswith(f"error: permission denied: {where}: ")
    ran.clear()
    assert main([*args, "stage=all"]) == 0 and ran == ["pretrain", "distill", "train", "export", "eval"]


def test_world_size_without_a_launcher_is_one_line_before_any_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """WORLD_SIZE=2 left in the environment of a plain `python -m medusa_train`: the rendezvous failed
    at the stage's first collective, after the backbone loaded, with a traceback."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    for name in ("RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("medusa_train.__main__.get_stage", _no_stage)
    monkeypatch.setattr("medusa_train.__main__.check_inputs", lambda cfg: None)  # no stage runs
    assert main([f"workdir={tmp_path}", "stage=train", "debug=fast", "tracking=disabled"]) == 2
    line = _error_line(capsys)
    assert "WORLD_SIZE=2 is set but not RANK, MASTER_PORT: start the ranks with torchrun" in line, line
    assert "unset WORLD_SIZE" in line and not any(tmp_path.iterdir())


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _launch_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    """Exactly ``values`` of what a launcher sets (the others unset)."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


RENDEZVOUS = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE=abc is not an integer: start the ranks with torchrun"),
        ({"RANK": "-1"}, "RANK=-1 is negative: start the ranks with torchrun"),
        (
            {"RANK": "2", "WORLD_SIZE": "2", **RENDEZVOUS},
            "RANK=2 is not below WORLD_SIZE=2 (ranks count from 0)",
        ),
        ({"RANK": "3"}, "RANK=3 is set without WORLD_SIZE (one process: rank 0)"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK=x is not an integer: start the ranks with torchrun"),
        ({"LOCAL_RANK": ""}, "LOCAL_RANK='' is empty: start the ranks with torchrun"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is below 1: start the ranks with torchrun"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "abc"},
            "MASTER_PORT=abc is no port",
        ),
    ],
)
def test_a_malformed_launch_variable_is_one_line_before_any_stage(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    says: str,
) -> None:
    """Such a value was a ValueError traceback (WORLD_SIZE=abc, RANK=abc), or reached the stage: a
    rank beyond the launch, LOCAL_RANK=x read only where a GPU is chosen."""
    _launch_env(monkeypatch, **env)
    monkeypatch.setattr("medusa_train.__main__.get_stage", _no_stage)
    assert main([f"workdir={tmp_path}", "stage=distill", "debug=fast", "tracking=disabled"]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"error: {says}"), line
    assert ", or unset " in line and not any(tmp_path.iterdir())


def test_the_launch_is_told_before_a_missing_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """WORLD_SIZE=2 left from another job: its line, not the input the stage would lack (which the
    user would fix, to be told about WORLD_SIZE next)."""
    _launch_env(monkeypatch, WORLD_SIZE="2")
    monkeypatch.setattr("medusa_train.__main__.get_stage", _no_stage)
    assert main([f"workdir={tmp_path}", "stage=train", "debug=fast", "tracking=disabled"]) == 2
    line = _error_line(capsys)
    assert line.startswith("error: WORLD_SIZE=2 is set but not RANK, MASTER_ADDR, MASTER_PORT"), line
    assert not any(tmp_path.iterdir())


def test_a_malformed_launch_through_the_entry_point_is_one_line(tmp_path: Path) -> None:
    """``python -m medusa_train`` with WORLD_SIZE set goes through dist.end_process (a launched
    rank's exit): that path says the one line and exits 2 too."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env |= {"PYTHONPATH": str(REPO), "WORLD_SIZE": "abc"}
    proc = run_cli([f"workdir={tmp_path}", "stage=distill", "tracking=disabled"], env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: WORLD_SIZE=abc is not an integer"), proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())


def test_the_launch_readers_raise_its_line_when_called_as_a_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the CLI's check, rank(), world_size() and local_rank() raise a UserError with the same
    line for their own malformed variable, not a ValueError; unset, they are one process's."""
    _launch_env(monkeypatch)
    assert (launch.rank(), launch.world_size(), launch.local_rank()) == (0, 1, 0)
    assert launch.is_main() and not launch.launched() and launch.launch_problem() is None
    for name, reader in (
        ("RANK", launch.rank),
        ("WORLD_SIZE", launch.world_size),
        ("LOCAL_RANK", launch.local_rank),
    ):
        monkeypatch.setenv(name, "-2")
        with pytest.raises(UserError) as raised:
            reader()
        assert str(raised.value) == launch.launch_problem() and str(raised.value).startswith(f"{name}=-2 ")
        monkeypatch.delenv(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    ("setting", "line"),
    [
        (["eval.attention=cuda"], "error: eval.attention=cuda: attention=cuda cannot run here: "),
        (
            ["deepspeed=zero3", "deepspeed.offload_param=true"],
            "error: deepspeed.offload_optimizer/offload_param",
        ),
        (["model.device=cuda"], "error: model.device=cuda but "),
    ],
    ids=["attention", "offload", "device"],
)
def test_stage_all_refuses_what_training_cannot_run_before_its_first_stage(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    setting: list[str],
    line: str,
) -> None:
    """A setting stage=train refuses at its step 1 (the tree attention on this device, DeepSpeed's
    offload on a CPU): with stage=all it was told after pretraining and distillation."""
    monkeypatch.setattr("medusa_train.__main__.get_stage", _no_stage)
    args = [f"workdir={tmp_path / 'run'}", "stage=all", "debug=fast", "tracking=disabled", *setting]
    assert main(args) == 2
    assert _error_line(capsys).startswith(line)
    assert not (tmp_path / "run").exists()


def _full_disk(monkeypatch: pytest.MonkeyPatch, only: str = "") -> None:
    """Every fsync fails with ENOSPC (only for files whose name contains ``only``, where /proc says)."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = only
        if only not in name:
            return real_fsync(fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)


def test_full_disk_during_export_and_eval_keeps_the_previous_artefacts(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast_eval = [
        "eval.num_prompts=1",
        "eval.max_new_tokens=4",
        "eval.acceptance_extra=false",
        "eval.sweep_tree_sizes=[]",
    ]
    for stage in ("export", "eval"):  # a good run first: the failed one must leave it as it was
        assert main(tiny_overrides(workdir, f"stage={stage}", *fast_eval)) == 0
    before = {stage: _tree(workdir / stage) for stage in ("export", "eval")}
    assert all(before.values())
    capsys.readouterr()
    with monkeypatch.context() as patch:
        _full_disk(patch)
        for stage in ("export", "eval"):
            assert main(tiny_overrides(workdir, f"stage={stage}", *fast_eval)) == 2
            line = _error_line(capsys)
            assert (
                line.startswith(f"error: no space left on the device: {workdir}") and "free there" in line
            ), line
    assert {stage: _tree(workdir / stage) for stage in ("export", "eval")} == before
    assert not _leftovers(workdir)


def test_full_disk_during_distill_publishes_no_shard(
    tmp_path: Path,
    tiny_backbone_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}?"}) + "\n" for i in range(3)))
    run = tmp_path / "run"
    argv = [
        f"workdir={run}",
        "stage=distill",
        "tracking=disabled",
        "model=hf",
        f"model.name_or_path={tiny_backbone_dir}",
        "model.device=cpu",
        "data=jsonl",
        f"data.path={data}",
        "distill.max_new_tokens=4",
        "distill.shard_size=1",
    ]
    _full_disk(monkeypatch, only="shard-")  # progress.json fits, the first shard does not
    assert main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith(f"error: no space left on the device: {run}"), line
    distill_dir = run / "distill"
    assert (distill_dir / "progress.json").is_file()
    assert not list(distill_dir.rglob("*.arrow")) and not (distill_dir / "manifest.json").exists()
    assert not _leftovers(run)


# What torch.save raises when the disk fills while it writes a checkpoint file to a path (torch 2.13,
# seen on a full 512 KiB tmpfs: HF Trainer's optimizer.pt), and its other writer's wording. No errno.
TORCH_FULL_DISK = [
    (
        "[enforce fail at inline_container.cc:672] . unexpected pos 8896 vs 8784",
        "basic_ios::clear: iostream error",
    ),
    (
        "[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/0: file write failed",
        None,
    ),
]


@pytest.fixture(scope="module")
def train_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_train_workdir(tmp_path_factory.mktemp("train_full_disk") / "wd")


def _torch_save_fails(monkeypatch: pytest.MonkeyPatch, message: str, context: str | None) -> None:
    """``torch.save`` of a checkpoint's optimizer.pt writes a few bytes and raises ``message`` (while
    handling ``context``), as torch does on a full disk; every other save works."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if not str(f).endswith("optimizer.pt"):
            return real_save(obj, f, *args, **kwargs)
        Path(f).write_bytes(b"PK\x03\x04")
        if context is None:
            raise RuntimeError(message)
        try:
            raise RuntimeError(context)
        except RuntimeError:
            raise RuntimeError(message)  # noqa: B904 -- chained implicitly, as torch's C++ error is

    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize(("message", "context"), TORCH_FULL_DISK, ids=["unexpected-pos", "stream-writer"])
def test_full_disk_while_the_trainer_saves_a_checkpoint_is_one_line(
    train_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    message: str,
    context: str | None,
) -> None:
    """Torch's save error carries no errno; with the workdir's disk full it is the disk-full
    line (exit 2), the heads are not published, and the same command resumes once there is room."""
    wd = Path(shutil.copytree(train_workdir, tmp_path / "wd"))
    argv = ["stage=train", *train_overrides(wd)]
    real_usage = shutil.disk_usage
    with monkeypatch.context() as patch:
        _torch_save_fails(patch, message, context)
        patch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=0))  # what a full disk says
        assert main(argv) == 2
        line = _error_line(capsys)
    assert line == (
        f"error: no space left on the device: {wd} (0 B free there): free space on that disk or pass "
        "workdir=<a folder on another disk>, then run the same command again (finished work is kept)"
    )
    assert not (wd / "heads").exists() and not _leftovers(wd)
    assert main(argv) == 0 and (wd / "heads" / "medusa_lm_head.safetensors").is_file()


def test_torch_write_failure_with_room_left_or_another_runtime_error(
    train_workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch write failure on a disk with room (a quota, an I/O error) is still one line, saying so;
    any other RuntimeError from the same place stays a traceback (a bug)."""
    wd = Path(shutil.copytree(train_workdir, tmp_path / "wd"))
    argv = ["stage=train", *train_overrides(wd)]
    real_usage = shutil.disk_usage
    with monkeypatch.context() as patch:
        _torch_save_fails(patch, *TORCH_FULL_DISK[0])
        patch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=512 << 30))
        assert main(argv) == 2
        line = _error_line(capsys)
    assert line == (
        f"error: writing under {wd} failed ({TORCH_FULL_DISK[0][0]}; 512.0 GiB free there): check that disk "
        "(quota, errors), then run the same command again (finished work is kept)"
    )
    with monkeypatch.context() as patch:
        _torch_save_fails(patch, "expected a Tensor but got NoneType", None)
        with pytest.raises(RuntimeError, match="expected a Tensor"):
            main(argv)
    assert environment_fault(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), wd) is None


def test_environment_fault_names_the_artefact_not_the_temp_file(tmp_path: Path) -> None:
    """A fault inside a staging folder or an atomic write's temp file names the artefact it was becoming;
    libraries that reword the OS error (safetensors' Rust I/O, Arrow) are recognised by its text; other
    errors are not taken for faults (they stay tracebacks: bugs)."""
    temp = tmp_path / ".export.tmp-4242" / "medusa" / ".medusa_lm_head.safetensors.4242.a1b2c3d4.tmp"
    full = environment_fault(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(temp)), tmp_path)
    assert full.startswith(
        f"no space left on the device: {tmp_path}/export/medusa/medusa_lm_head.safetensors ("
    )
    assert "free there" in full
    wrapped = RuntimeError(
        "Error while serializing: IoError(Os { code: 28, kind: StorageFull }) (os error 28)"
    )
    assert environment_fault(wrapped, tmp_path).startswith(f"no space left on the device: {tmp_path} (")
    try:  # a cause further down the chain counts too
        try:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        except OSError as err:
            raise ValueError("save failed") from err
    except ValueError as chained:
        assert environment_fault(chained, tmp_path).startswith(f"the file system is read-only: {tmp_path}:")
    assert environment_fault(RuntimeError("Permission denied by the hub"), tmp_path) is None
    assert environment_fault(KeyError("x"), tmp_path) is None


def test_environment_fault_of_a_bare_file_name_names_the_workdir(tmp_path: Path) -> None:
    """shutil.rmtree (training.overwrite=true discarding workdir/train) reports a file by its bare name,
    relative to a folder it walks: the line named that name as if in the current directory and asked
    for access to "."."""
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "run.json")
    line = environment_fault(denied, tmp_path)
    assert line.startswith(
        f"permission denied: run.json under {tmp_path}: give this user access to {tmp_path} ("
    )
    full = environment_fault(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "optimizer.pt"), tmp_path)
    assert (
        full.startswith(f"no space left on the device: optimizer.pt under {tmp_path} (")
        and "free there" in full
    )


# -- messages that name the user's own mistake ----------------------------------------------------
@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("distill.max_new_token=5", "did you mean distill.max_new_tokens=5?"),
        ("distil.max_new_tokens=5", "did you mean distill.max_new_tokens=5?"),
        ("+distill.max_new_token=5", "did you mean distill.max_new_tokens=5?"),  # OmegaConf would drop it
        ("+workdri=elsewhere", "did you mean workdir=elsewhere?"),  # dropped too: the run used runs/default
        ("trainin=medusa2", "did you mean training=medusa2?"),
        (
            "data=txt",
            "did you mean data=text? (data is one of alpaca, embedded, hub, jsonl, mtbench, sharegpt, text)",
        ),
        ("tree=medusa64", "did you mean tree=medusa63?"),
        ("train", "'train': not a key=value argument: did you mean stage=train?"),
        ("medusa2", "'medusa2': not a key=value argument: did you mean training=medusa2?"),
        (
            "--stage=train",
            "'--stage=train': arguments are key=value, without dashes: did you mean stage=train?",
        ),
        ("--training.lr=1e-3", "did you mean training.lr=1e-3?"),
        ("eval.batch_sizes=3", "give a list: eval.batch_sizes=[3]"),  # a scalar for a list
        ("eval.batch_sizes=1,4", "give a list: eval.batch_sizes=[1,4]"),  # a multirun sweep to Hydra
        ("eval.compare=~/a,~/b", "give a list: eval.compare=['~/a','~/b']"),  # ~ quoted for Hydra
        ("export.formats=vllm", "give a list: export.formats=[vllm]"),
    ],
)
def test_misspelt_keys_and_options_get_a_close_match(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, says: str
) -> None:
    assert main([f"workdir={tmp_path}", "stage=distill", override]) == 2
    assert says in _error_line(capsys)


def test_an_option_and_its_value_as_two_arguments_get_the_override(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([f"workdir={tmp_path}", "--stage", "train"]) == 2
    assert "'--stage train': arguments are key=value, without dashes: did you mean stage=train?" in (
        _error_line(capsys)
    )
    assert main([f"workdir={tmp_path}", "stage=eval", "--eval.num_prompts"]) == 2
    assert "did you mean eval.num_prompts=<value>?" in _error_line(capsys)
    assert not any(tmp_path.iterdir())


def test_wrong_backbone_path_with_model_hf_does_not_ask_for_model_hf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "models" / "my-qwen"
    argv = [f"workdir={tmp_path}", "stage=distill", "model=hf", f"model.name_or_path={missing}"]
    assert main([*argv, "tracking=disabled"]) == 2
    line = _error_line(capsys)
    assert f"model.name_or_path={missing}: no such directory here" in line and "pass model=hf" not in line


def test_hub_id_not_in_the_cache_in_offline_mode_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' line blamed the connection ("We couldn't connect to 'https://huggingface.co'") where
    offline mode tried none, and its advice was on the line dropped."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # nothing here may reach the Hub
    argv = [f"workdir={tmp_path / 'wd'}", "stage=distill", "model=hf", "model.name_or_path=acme/not-cached"]
    assert main([*argv, "tracking=disabled"]) == 2
    line = _error_line(capsys)
    assert "'acme/not-cached': it is not in the Hugging Face cache, and HF_HUB_OFFLINE" in line, line
    assert "`hf download acme/not-cached`" in line and "model.name_or_path=<a directory" in line
    assert not (tmp_path / "wd").exists()


@pytest.mark.parametrize(
    "engine", [[], ["distill.engine=server", "distill.server.urls=[http://127.0.0.1:9/v1]"]]
)
def test_backbone_with_custom_code_asks_for_trust_remote_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], engine: list[str]
) -> None:
    """A model repository with its own modeling code, loaded without model.trust_remote_code: one line
    naming the option, in process and for a served backbone (whose config and tokenizer are read here)."""
    remote = tmp_path / "remote"
    remote.mkdir()
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
    (remote / "config.json").write_text(json.dumps({"model_type": "x_custom", "auto_map": auto_map}))
    argv = [f"workdir={tmp_path / 'wd'}", "stage=distill", "model=hf", f"model.name_or_path={remote}"]
    assert main([*argv, *engine, "tracking=disabled"]) == 2
    assert "set model.trust_remote_code=true" in _error_line(capsys)


def _eval_prompts(workdir: Path, tmp_path: Path, capsys, *overrides: str) -> str:
    out = tmp_path / "wd"
    if not out.exists():
        shutil.copytree(workdir, out)
    assert main(tiny_overrides(out, "stage=eval", *overrides)) == 2
    return _error_line(capsys)


def test_eval_prompts_file_in_the_wrong_format_names_eval_options(
    workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mtbench = tmp_path / "question.jsonl"
    mtbench.write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Hi.", "More."]}) + "\n"
    )
    line = _eval_prompts(workdir, tmp_path, capsys, "eval.prompts=jsonl", f"eval.path={mtbench}")
    assert "a 'turns' field, as mtbench files do: set eval.prompts=mtbench" in line, line
    other = tmp_path / "prompts.jsonl"
    other.write_text(json.dumps({"id": 1, "question": "Hi."}) + "\n")
    line = _eval_prompts(workdir, tmp_path, capsys, "eval.prompts=jsonl", f"eval.path={other}")
    assert (
        "set eval.prompt_key= to the field that holds the prompt (its records have 'id', 'question')" in line
    )
    assert "data.format" not in line
    line = _eval_prompts(workdir, tmp_path, capsys, "eval.prompts=mtbench", f"eval.path={tmp_path}")
    assert f"eval.path={tmp_path} is a directory: give the prompts file itself" in line


# -- the held-out fault sweep's five cases ----------------------------------------------------------
@pytest.mark.parametrize("compared", ["missing", "empty"])
def test_eval_compare_of_no_heads_is_refused_before_decoding(
    workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    compared: str,
) -> None:
    """A wrong eval.compare entry was found after the main run decoded every prompt (minutes on a real
    model), then refused."""
    (tmp_path / "empty").mkdir()

    def decoding(*args, **kwargs):
        raise AssertionError("the main run started: eval.compare should have been refused first")

    monkeypatch.setattr("medusa_train.stages.eval._evaluate", decoding)
    line = _eval_prompts(workdir, tmp_path, capsys, f"eval.compare=[{tmp_path / compared}]")
    assert (
        line.startswith(f"error: eval.compare: {tmp_path / compared}") and "workdirs holding heads/" in line
    )


def test_sharegpt_array_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    from medusa_train.data.sources import read_records

    path = tmp_path / "sharegpt.json"
    rows = [
        {"conversations": [{"from": "human", "value": f"Hello {i}"}, {"from": "gpt", "value": "Hi"}]}
        for i in range(2)
    ]
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    result = read_records("sharegpt", path)
    assert [r.turns for r in result.records] == [["Hello 0"], ["Hello 1"]]


def test_empty_distill_manifest_is_a_damaged_artefact(
    train_workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wd = Path(shutil.copytree(train_workdir, tmp_path / "wd"))
    (wd / "distill" / "manifest.json").write_text("{}")
    assert main(["stage=train", *train_overrides(wd)]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"error: {wd / 'distill' / 'manifest.json'} is damaged (lacks 'backbone')"), line
    assert "stage=distill" in line and "another backbone" not in line


def test_recalibrating_heads_whose_config_names_another_hidden_size_is_one_line(
    train_workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wd = Path(shutil.copytree(train_workdir, tmp_path / "wd"))
    assert main(["stage=train", *train_overrides(wd)]) == 0
    config = json.loads((wd / "heads" / "config.json").read_text())
    (wd / "heads" / "config.json").write_text(
        json.dumps({**config, "hidden_size": config["hidden_size"] * 2})
    )
    assert main(["stage=train", *train_overrides(wd, "tree.max_nodes=16")]) == 2
    line = _error_line(capsys)
    assert "cannot be calibrated again" in line and "training.overwrite=true" in line, line


def test_checkpoint_optimizer_holding_a_pickle_is_one_line(
    train_workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wd = Path(shutil.copytree(train_workdir, tmp_path / "wd"))
    argv = ["stage=train", *train_overrides(wd)]
    assert main(argv) == 0
    shutil.rmtree(wd / "heads")  # the next run resumes from the last checkpoint
    checkpoint = max((wd / "train").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    marker = tmp_path / "code-ran"
    (checkpoint / "optimizer.pt").write_bytes(pickle.dumps({"state": _Payload(marker)}))
    assert main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith(f"error: {checkpoint / 'optimizer.pt'} holds a pickle"), line
    assert f"deleting {checkpoint}" in line and "training.overwrite=true" in line
    assert not marker.exists()


# -- quiet runs -------------------------------------------------------------------------------------
def test_third_party_notices_that_do_not_apply_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """transformers' imports pull in bitsandbytes and DeepSpeed whatever the run asks; their notices
    about a CPU 4-bit kernel and the accelerator are dropped unless the run quantizes to 4 bits / uses DeepSpeed."""
    import logging

    from medusa_train.__main__ import quiet_third_party

    bnb, ds = logging.getLogger("bitsandbytes.backends.cpu.ops"), logging.getLogger("DeepSpeed")
    saved = bnb.filters[:], ds.filters[:]
    for logger in (bnb, ds):  # DeepSpeed's logger does not propagate once deepspeed is imported
        logger.addHandler(caplog.handler)
    try:
        bnb.filters.clear(), ds.filters.clear()
        quiet_third_party("4bit", deepspeed=False)
        with caplog.at_level(logging.WARNING):
            bnb.warning(
                "Failed to load CPU gemm_4bit_forward from kernels-community: %s.",
                "No module named 'kernels'",
            )
            ds.warning(
                "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
            )
            ds.warning("another DeepSpeed warning")
        assert {r.getMessage()[:20] for r in caplog.records} == {
            "Failed to load CPU g",
            "another DeepSpeed wa",
        }
        caplog.clear()
        bnb.filters.clear()
        quiet_third_party("none", deepspeed=False)
        with caplog.at_level(logging.WARNING):
            bnb.warning(
                "Failed to load CPU gemm_4bit_forward from kernels-community: %s.",
                "No module named 'kernels'",
            )
        assert not caplog.records
    finally:
        bnb.filters[:], ds.filters[:] = saved
        for logger in (bnb, ds):
            logger.removeHandler(caplog.handler)
