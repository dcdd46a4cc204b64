"""Artefacts: a workdir is its content, damaged artefacts give one line, publishing is atomic.

- copied, moved, renamed workdirs (named relatively or absolutely) are the same workdir: distill
  skips without loading the model, train resumes and then skips, export names a base model that
  exists here;
- every damaged artefact kind a stage reads (distill shards and manifest, progress.json, run.json,
  trainer_state.json, the hidden-state cache, heads config/weights, calibration.json) is refused in
  one line with exit code 2 naming the file and the repair, or repaired (a truncated shard is
  regenerated, a damaged checkpoint or cache skipped/rebuilt);
- a run killed while publishing a folder leaves, after the next run, the old or the new folder and
  no leftover, with ordinary permissions.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from medusa_train import workdir as workdir_mod
from medusa_train.__main__ import main
from medusa_train.config import compose_config
from medusa_train.data.distilled import load_distilled
from medusa_train.errors import DamagedArtefactError
from medusa_train.stages import distill, export
from medusa_train.stages import eval as eval_stage
from medusa_train.stages.train import calibrated_with
from medusa_train.stages.train import run as train_run
from medusa_train.training.hidden_cache import HiddenCache, build_hidden_cache, is_complete
from medusa_train.training.trainer import last_complete_checkpoint
from medusa_train.workdir import publish_dir, read_json, remove_stale, staging_dir
from tests.helpers.distill import rows as _rows
from tests.helpers.tiny_workdir import make_workdir, tiny_cfg, tiny_overrides
from tests.helpers.train_workdir import (
    make_records,
    make_train_workdir,
    run_killed_at_step,
    train_cfg,
    train_overrides,
)
from tests.helpers.training import tiny_llama, trainer_checkpoint

REPO = Path(__file__).resolve().parents[2]
WORDS = "the cat dog sat on a mat tell me story about why how what is big small".split()


def _fresh_copy(src: Path, dst: Path) -> Path:
    """``cp -r`` (new modification times, as a copy to another disk or machine gets)."""
    return Path(shutil.copytree(src, dst, copy_function=shutil.copyfile))


def _one_error_line(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; assert exit code 2 and exactly one line on stderr; return it."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]  # besides progress bars
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


@contextlib.contextmanager
def _killed_at_publish(monkeypatch, name: str) -> Iterator[None]:
    """The body must stop (``KeyboardInterrupt``, as a SIGKILL there) when :func:`publish_dir` renames the
    staged ``name`` folder into place; ``os.replace`` is itself again afterwards."""
    real = os.replace

    def killed(src, dst):
        if Path(src).name.startswith(f".{name}.tmp-"):
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(workdir_mod.os, "replace", killed)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        monkeypatch.setattr(workdir_mod.os, "replace", real)


def _no_dot_leftovers(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")], list(folder.iterdir())


# -- distill -----------------------------------------------------------------------------------------
def _distill_overrides(workdir: Path | str, prompts: Path) -> list[str]:
    return [
        "stage=distill",
        f"workdir={workdir}",
        "model=hf",
        f"model.name_or_path={Path(workdir) / 'base_model'}",  # inside the workdir, as model=tiny
        "model.dtype=float32",
        "model.device=cpu",
        "tracking=disabled",
        "data=jsonl",
        f"data.path={prompts}",
        "distill.max_new_tokens=6",
        "distill.batch_size=3",
        "distill.shard_size=2",
    ]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, tiny_backbone_dir) -> tuple[Path, Path, dict]:
    """A workdir holding its backbone and 3 distilled shards (6 prompts); the prompts file beside it."""
    root = tmp_path_factory.mktemp("distilled")
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=4 + i)) + "?"}) + "\n" for i in range(6))
    )
    wd = root / "wd"
    shutil.copytree(tiny_backbone_dir, wd / "base_model")
    figures = distill.run(compose_config(_distill_overrides(wd, prompts)))
    assert figures["num_shards"] == 3
    return wd, prompts, figures


def test_copied_renamed_workdir_named_relatively_is_complete_without_loading(
    distilled, tmp_path, monkeypatch
) -> None:
    wd, prompts, figures = distilled
    _fresh_copy(wd, tmp_path / "copy")
    os.rename(tmp_path / "copy", tmp_path / "renamed")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(distill, "load_configured_backbone", lambda *a, **k: pytest.fail("loaded the model"))
    again = distill.run(compose_config(_distill_overrides("renamed", prompts)))
    assert again["already_complete"] and again["records"] == figures["records"]


def test_truncated_progress_and_an_older_manifest_keep_complete_data(distilled, tmp_path) -> None:
    wd, prompts, figures = distilled
    copy = _fresh_copy(wd, tmp_path / "copy")
    progress = copy / "distill" / "progress.json"
    progress.write_text(progress.read_text()[:40])
    manifest = json.loads((copy / "distill" / "manifest.json").read_text())
    # The quick settings differ (no fingerprint), the full settings match: the data is kept.
    del manifest["quick_settings"]["backbone_source"]["fingerprint"]
    (copy / "distill" / "manifest.json").write_text(json.dumps(manifest))
    shards = {p.name: p.stat().st_mtime_ns for p in (copy / "distill" / "shards").iterdir()}
    again = distill.run(compose_config(_distill_overrides(copy, prompts)))
    assert again["already_complete"] and again["tokens_generated_now"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in (copy / "distill" / "shards").iterdir()} == shards
    assert _rows(copy) == _rows(wd)


# Rewrites distill/manifest.json (as a run that completed the data does) and SIGKILLs itself half-way
# through writing the temp file: what a kill mid-write leaves is the temp file, named with its pid.
_KILLED_MID_WRITE = """
import json, os, signal, sys
from pathlib import Path
from medusa_train.data.distilled import write_manifest
real = Path.write_text
def dies_half_way(self, text, *args, **kwargs):
    real(self, text[: len(text) // 2], *args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
Path.write_text = dies_half_way
distill_dir = Path(sys.argv[1])
write_manifest(distill_dir, json.loads((distill_dir / "manifest.json").read_text()))
"""


def test_distill_start_deletes_a_killed_writes_temp_file(distilled, tmp_path, monkeypatch) -> None:
    """A write SIGKILLed mid-way leaves ``.manifest.json.<pid>-<token>.<rand>.tmp``; the next stage
    start deletes it (its pid no longer runs) and finds the data complete, without loading the model."""
    wd, prompts, figures = distilled
    copy = _fresh_copy(wd, tmp_path / "copy")
    manifest = (copy / "distill" / "manifest.json").read_bytes()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_MID_WRITE, str(copy / "distill")],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, stderr[-2000:]
    left = [p.name for p in (copy / "distill").iterdir() if p.name.startswith(".")]
    assert left and all(n.startswith(f".manifest.json.{proc.pid}-") and n.endswith(".tmp") for n in left)
    assert (copy / "distill" / "manifest.json").read_bytes() == manifest  # the rename never happened
    monkeypatch.setattr(distill, "load_configured_backbone", lambda *a, **k: pytest.fail("loaded the model"))
    again = distill.run(compose_config(_distill_overrides(copy, prompts)))
    assert again["already_complete"] and again["records"] == figures["records"]
    _no_dot_leftovers(copy / "distill")


def test_distill_regenerates_a_truncated_shard(distilled, tmp_path) -> None:
    wd, prompts, _ = distilled
    copy = _fresh_copy(wd, tmp_path / "copy")
    shard = copy / "distill" / "shards" / "shard-00001.arrow"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(DamagedArtefactError, match=r"shard-00001.arrow is damaged.*stage=distill"):
        load_distilled(copy / "distill")
    again = distill.run(compose_config(_distill_overrides(copy, prompts)))
    assert not again["already_complete"] and again["tokens_generated_now"] > 0
    assert _rows(copy) == _rows(wd)


@pytest.mark.parametrize("damage", ["missing shard", "truncated manifest", "manifest not an object"])
def test_train_refuses_damaged_distilled_data_in_one_line(distilled, tmp_path, capsys, damage) -> None:
    wd, _, _ = distilled
    copy = _fresh_copy(wd, tmp_path / "copy")
    if damage == "missing shard":
        (copy / "distill" / "shards" / "shard-00002.arrow").unlink()
        name = "shard-00002.arrow is missing"
    else:
        manifest = copy / "distill" / "manifest.json"
        manifest.write_text(manifest.read_text()[:100] if damage == "truncated manifest" else "[1, 2]")
        name = "manifest.json is damaged"
    line = _one_error_line(capsys, train_overrides(copy, "stage=train"))
    assert name in line and "stage=distill" in line
    assert not (copy / "heads").exists() and not (copy / "train").exists()


# -- train -------------------------------------------------------------------------------------------
def test_moved_workdir_resumes_then_skips_then_exports(tmp_path, monkeypatch) -> None:
    root = make_train_workdir(tmp_path / "a")
    run_killed_at_step(train_cfg(root), monkeypatch, step=4)
    os.rename(tmp_path / "a", tmp_path / "b")  # moved (its backbone with it), then named relatively
    monkeypatch.chdir(tmp_path)
    result = train_run(train_cfg(Path("b")))
    assert result["resumed_from"].endswith("checkpoint-3") and result["steps"] == 6
    _fresh_copy(tmp_path / "b", tmp_path / "c")
    shutil.rmtree(tmp_path / "b")  # the heads name b/base_model as their base: gone now
    again = train_run(train_cfg(tmp_path / "c"))  # absolute this time
    assert again["skipped"]
    out = export.run(compose_config(train_overrides(Path("c"), "stage=export")))
    assert out["roundtrip_identical"]
    config = json.loads((tmp_path / "c" / "export" / "medusa" / "config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "c" / "base_model").resolve())
    assert oct((tmp_path / "c" / "export").stat().st_mode & 0o777) == oct(0o777 & ~_umask())
    # Killed while publishing recalibrated heads: the next run finds the old heads and recalibrates.
    heads = tmp_path / "c" / "heads"
    weights = (heads / "medusa_lm_head.safetensors").read_bytes()
    with _killed_at_publish(monkeypatch, "heads"):
        train_run(train_cfg(tmp_path / "c", "tree.max_nodes=3"))
    again = train_run(train_cfg(tmp_path / "c", "tree.max_nodes=3"))
    assert again["recalibrated"] and (heads / "medusa_lm_head.safetensors").read_bytes() == weights
    _no_dot_leftovers(tmp_path / "c")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("content", ['{"settings": {"lr"', '["not", "an", "object"]'])
def test_damaged_run_json_is_one_line(tmp_path, capsys, content) -> None:
    root = make_train_workdir(tmp_path)
    (root / "train").mkdir()
    (root / "train" / "run.json").write_text(content)
    line = _one_error_line(capsys, train_overrides(root, "stage=train"))
    assert "run.json is damaged" in line and "training.overwrite=true" in line


def test_other_settings_refusal_names_old_and_new_values(tmp_path) -> None:
    from medusa_train.errors import UserError

    root = make_train_workdir(tmp_path)
    (root / "train").mkdir()
    (root / "train" / "run.json").write_text(json.dumps({"settings": {"lr": 5.0}, "backbone": {}}))
    with pytest.raises(UserError, match=r"differs in .*\(.* -> .*\).*old values.*overwrite"):
        train_run(train_cfg(root))


def test_damaged_checkpoints_are_skipped(tmp_path) -> None:
    """Each file kind's checks: tests/unit/training/test_checkpoints.py."""
    train = tmp_path / "train"
    for step in (3, 6, 9):
        trainer_checkpoint(train, step)
    (train / "checkpoint-9" / "trainer_state.json").write_text('{"global_st')  # truncated
    assert last_complete_checkpoint(train).endswith("checkpoint-6")
    weights = train / "checkpoint-6" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # truncated
    assert last_complete_checkpoint(train, remove_incomplete=True).endswith("checkpoint-3")
    assert sorted(p.name for p in train.iterdir()) == ["checkpoint-3"]


def test_damaged_hidden_cache_is_rebuilt(tmp_path) -> None:
    model = tiny_llama()
    records = [{k: r[k] for k in ("input_ids", "loss_mask")} for r in make_records(6)]
    for r in records:
        r["input_ids"] = [i % model.config.vocab_size for i in r["input_ids"]]
    cache = tmp_path / "cache"
    first = build_hidden_cache(model, records, cache, 2, {"k": 1})
    expected = [first[i]["hidden_states"] for i in range(len(first))]
    hidden = cache / "hidden.bin"
    hidden.write_bytes(hidden.read_bytes()[:-8])
    assert not is_complete(cache, {"k": 1})
    with pytest.raises(DamagedArtefactError, match="hidden-state cache .* damaged"):
        HiddenCache(cache)
    (cache / "meta.json").write_text("{")
    rebuilt = build_hidden_cache(model, records, cache, 2, {"k": 1})
    assert all((rebuilt[i]["hidden_states"] == e).all() for i, e in enumerate(expected))


# -- heads, calibration -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def heads_workdir(tmp_path_factory) -> Path:
    return make_workdir(tmp_path_factory.mktemp("heads_wd"))


def _damage(heads: Path, kind: str) -> str:
    weights, config = heads / "medusa_lm_head.safetensors", heads / "config.json"
    if kind == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:-100])
        return "medusa_lm_head.safetensors: truncated"
    if kind == "pickle as safetensors":
        import torch

        torch.save({"0.1.weight": torch.zeros(2, 2)}, weights)
        return "medusa_lm_head.safetensors: truncated, or not a safetensors file"
    if kind == "truncated config":
        config.write_text(config.read_text()[:30])
        return "config.json is damaged"
    if kind == "config not an object":
        config.write_text("[]")
        return "config.json is not a JSON object"
    meta = json.loads(config.read_text())  # config that does not match the weights
    config.write_text(json.dumps({**meta, "medusa_num_heads": 5}))
    return "weights do not match the config"


@pytest.mark.parametrize(
    "kind",
    ["truncated weights", "pickle as safetensors", "truncated config", "config not an object", "mismatch"],
)
def test_damaged_heads_are_one_line_for_export_eval_and_init_heads(heads_workdir, tmp_path, capsys, kind):
    wd = _fresh_copy(heads_workdir, tmp_path / "wd")
    expected = _damage(wd / "heads", kind)
    for stage in ("export", "eval"):
        line = _one_error_line(capsys, [f"stage={stage}", *tiny_overrides(wd)])
        assert expected in line and "stage=train training.overwrite=true" in line, line
    if kind == "truncated weights":  # training.init_heads reads the same files
        root = make_train_workdir(tmp_path / "train_wd")
        line = _one_error_line(
            capsys, train_overrides(root, "stage=train", f"training.init_heads={wd / 'heads'}")
        )
        assert line.startswith("error: training.init_heads:") and expected in line
        assert not (root / "heads").exists()


def test_damaged_calibration_is_one_line_for_eval(heads_workdir, tmp_path) -> None:
    wd = _fresh_copy(heads_workdir, tmp_path / "wd")
    (wd / "heads" / "calibration.json").write_text('{"head_topk_accuracy": [[0.5')
    cfg = tiny_cfg(wd, "stage=eval")
    with pytest.raises(DamagedArtefactError, match=r"calibration.json is damaged .*stage=train"):
        eval_stage.head_topk(wd / "heads", workdir_mod.Workdir(wd), cfg, None, None)


EVAL_RECALIBRATE = (
    "run `python -m medusa_train stage=train` (same settings) to calibrate again, or delete it to evaluate "
    "the tree without it"
)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ({"tree": [1, 2]}, "'tree' is a JSON list where an object is expected"),
        (
            {"tree": {"calibrated_for": "H100"}},
            "'tree.calibrated_for' is a JSON string where an object is expected",
        ),
        ({"tree": {"calibrated_for": {"dtype": "float32"}}}, "lacks 'tree.calibrated_for.device'"),
        ({"tree": {"context_len": "4k"}}, "'tree.context_len' is a JSON string where a number is expected"),
        ({"tree": {"choices": [[0], "x"]}}, "'tree.choices[1]' is a JSON string where a list is expected"),
        ({"tree": {"best": {"nodes": "5"}}}, "'tree.best.nodes' is a JSON string where a number is expected"),
        ({"head_topk_accuracy": [[0.5, "x"]]}, "'head_topk_accuracy[0][1]' is a JSON string where a number"),
        ({"head_topk_accuracy": [[0.5, 0.6], [0.4]]}, "'head_topk_accuracy' has rows of [1, 2] entries"),
        (b'{"tree": {"calibrated_for": {"device": "\xff"}}}', "not valid JSON: UnicodeDecodeError"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON: RecursionError"),
    ],
)
def test_a_calibration_with_an_entry_of_the_wrong_type_is_one_line_for_eval(
    heads_workdir, tmp_path, capsys, monkeypatch, content, problem
) -> None:
    """calibration.json with an entry eval reads of the wrong type (or missing, not UTF-8, nested deeper
    than the parser goes) stops eval in one line (exit 2) naming the file, what is wrong and the repair,
    before the backbone loads, with the calibrated tree, with a pinned one (whose head accuracies it
    gives) and for heads compared (eval.compare, decoded after the main run); the repair holds: stage=train takes such a file for no calibration and calibrates again."""
    wd = _fresh_copy(heads_workdir, tmp_path / "wd")
    path = wd / "heads" / "calibration.json"
    whole = {**json.loads(path.read_text()), "settings": {"tree_max_nodes": 5}}
    path.write_text(json.dumps(whole))
    assert calibrated_with(wd / "heads") == {"tree_max_nodes": 5}  # whole: stage=train finds its settings
    path.write_bytes(content if isinstance(content, bytes) else json.dumps({**whole, **content}).encode())

    def no_load(*args, **kwargs):
        raise AssertionError("the backbone loaded before calibration.json was checked")

    monkeypatch.setattr(eval_stage, "load_backbone_for_heads", no_load)
    whole_wd = _fresh_copy(heads_workdir, tmp_path / "whole")
    for argv in (  # the calibrated tree, a pinned one, these heads compared to others'
        [*tiny_overrides(wd), "tree=calibrated"],
        [*tiny_overrides(wd), "tree=chain", "tree.chain_depth=2"],
        [*tiny_overrides(whole_wd), f"eval.compare=[{wd}]"],
    ):
        line = _one_error_line(capsys, ["stage=eval", *argv])
        assert line.startswith(f"error: {path} is damaged ({problem}"), line
        assert line.endswith(f"): {EVAL_RECALIBRATE}"), line
    assert calibrated_with(wd / "heads") is None


EVAL_EXPORT_AGAIN = (
    "run `python -m medusa_train stage=export` (same settings) to copy the heads' calibration.json into the "
    "export again (`python -m medusa_train stage=train` first, same settings, if the heads' own is damaged "
    "too), or delete it to evaluate the tree without it"
)


@pytest.mark.parametrize("heads", ["export/medusa", "export"])
def test_a_damaged_calibration_in_an_export_names_stage_export(
    heads_workdir, tmp_path, capsys, heads
) -> None:
    """Eval of an export (its medusa/ folder, or the export folder) whose calibration.json is damaged:
    one line naming stage=export, which copies the heads' own again (stage=train alone skips: the heads'
    own is whole), and the repair holds."""
    wd = _fresh_copy(heads_workdir, tmp_path / "wd")
    export.run(tiny_cfg(wd, "stage=export"))
    copy = wd / "export" / "calibration.json"
    copy.write_text(json.dumps({**json.loads(copy.read_text()), "tree": [1, 2]}))
    line = _one_error_line(capsys, ["stage=eval", *tiny_overrides(wd), f"eval.heads_dir={wd / heads}"])
    assert line == (
        f"error: {copy} is damaged ('tree' is a JSON list where an object is expected): {EVAL_EXPORT_AGAIN}"
    ), line
    export.run(tiny_cfg(wd, "stage=export"))
    assert copy.read_bytes() == (wd / "heads" / "calibration.json").read_bytes()
    assert eval_stage.stored_topk(wd / heads) is not None


# -- generic checks ----------------------------------------------------------------------------------
def test_read_json_names_the_file_and_the_repair(tmp_path) -> None:
    path = tmp_path / "x.json"
    for text, reason in (
        ("{", "not valid JSON"),
        ("[1]", "a JSON list where an object"),
        ('{"a": 1}', "lacks 'b'"),
    ):
        path.write_text(text)
        with pytest.raises(DamagedArtefactError, match=rf"x.json is damaged \({reason}.*\): do this"):
            read_json(path, repair="do this", keys=("b",))
    path.write_bytes(b"[" * 100000 + b"]" * 100000)  # nesting deeper than the parser allows
    with pytest.raises(DamagedArtefactError, match="not valid JSON"):
        read_json(path, repair="do this")
    with pytest.raises(DamagedArtefactError, match="missing: do this"):
        read_json(tmp_path / "nope.json", repair="do this")


@pytest.mark.parametrize(
    ("text", "expect", "reason"),
    [
        ("[1]", dict, "a JSON list where an object is expected"),
        ('"x"', dict, "a JSON string where an object is expected"),
        ("1.5", dict, "a JSON number where an object is expected"),
        ("true", dict, "a JSON boolean where an object is expected"),
        ("null", dict, "JSON null where an object is expected"),
        ("{}", list, "a JSON object where a list is expected"),
        ("2", (dict, list), "a JSON number where an object or a list is expected"),
    ],
)
def test_read_json_names_the_kind_it_found_and_the_one_expected(tmp_path, text, expect, reason) -> None:
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(DamagedArtefactError) as err:
        read_json(path, expect=expect, repair="do this")
    assert str(err.value) == f"{path} is damaged ({reason}): do this"


def test_publish_killed_between_its_renames_keeps_the_old_folder(tmp_path, monkeypatch) -> None:
    final = tmp_path / "out"
    final.mkdir()
    (final / "a.txt").write_text("old")
    tmp = staging_dir(final)
    (tmp / "a.txt").write_text("new")
    real, calls = os.replace, []

    def dies_on_the_second_rename(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a SIGKILL at this point (the finally of publish_dir never runs)
        real(src, dst)

    monkeypatch.setattr(workdir_mod.os, "replace", dies_on_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        publish_dir(tmp, final)
    monkeypatch.setattr(workdir_mod.os, "replace", real)
    assert not final.exists()
    remove_stale(final)  # what the next run does first
    assert (final / "a.txt").read_text() == "old"
    _no_dot_leftovers(tmp_path)
    tmp = staging_dir(final)
    (tmp / "a.txt").write_text("new")
    publish_dir(tmp, final)
    assert (final / "a.txt").read_text() == "new" and final.stat().st_mode & 0o777 == 0o777 & ~_umask()
    _no_dot_leftovers(tmp_path)


# Runs stage=export from the CLI and SIGKILLs itself at the publishing step: after export/ was
# renamed aside, before the new one is renamed into place (the worst moment).
_KILLED_AT_PUBLISH = """
import os, signal, sys
from medusa_train.__main__ import main
real = os.replace
def replace(src, dst):
    if os.path.basename(str(src)).startswith(".export.tmp-"):
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)
os.replace = replace
sys.exit(main(sys.argv[1:]))
"""


def test_export_sigkilled_at_publish_then_rerun_leaves_nothing(heads_workdir, tmp_path) -> None:
    wd = _fresh_copy(heads_workdir, tmp_path / "wd")
    argv = ["stage=export", *tiny_overrides(wd)]
    assert main(argv) == 0
    card = (wd / "export" / "README.md").read_bytes()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_AT_PUBLISH, *argv], cwd=REPO, env=env, capture_output=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (wd / "export").exists() and {p.name.split("-")[0] for p in wd.glob(".export*")} == {
        ".export.old",
        ".export.tmp",
    }
    remove_stale(wd / "export")  # the old export comes back whole ...
    assert (wd / "export" / "README.md").read_bytes() == card
    assert export.run(tiny_cfg(wd, "stage=export"))["roundtrip_identical"]  # ... and a rerun replaces it
    _no_dot_leftovers(wd)


def test_eval_killed_at_publish_then_rerun_gives_one_runs_files(heads_workdir, tmp_path, monkeypatch) -> None:
    wd = _fresh_copy(heads_workdir, tmp_path / "wd")
    fast = (
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
        "eval.sweep_tree_sizes=[]",
        "eval.acceptance_extra=false",
    )
    eval_stage.run(tiny_cfg(wd, "stage=eval", *fast))
    (wd / "eval" / "stray.png").write_text("from an older run")
    with _killed_at_publish(monkeypatch, "eval"):
        eval_stage.run(tiny_cfg(wd, "stage=eval", *fast))
    report = eval_stage.run(tiny_cfg(wd, "stage=eval", *fast))
    on_disk = json.loads((wd / "eval" / "report.json").read_text())
    assert on_disk["date"] == report["date"] and not (wd / "eval" / "stray.png").exists()
    lines = (wd / "eval" / "generations.jsonl").read_text().splitlines()
    assert len(lines) == report["num_prompts"]
    _no_dot_leftovers(wd)
