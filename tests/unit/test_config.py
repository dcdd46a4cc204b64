"""Every config in conf/ composes and validates; bad input fails in one line with exit code 2."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_file

from medusa_train.__main__ import check_inputs, main, strip_launcher_args
from medusa_train.config import CONF_DIR, Config, EvalConfig, compose_config, register_configs
from medusa_train.errors import ConfigError, DamagedArtefactError, UserError
from medusa_train.heads_layout import HEADS_OPTIONS

# Options that need a value no default can supply (a file, a hub id, a tree).
REQUIRED = {
    ("model", "hf"): ["model.name_or_path=some/model"],
    ("data", "sharegpt"): ["data.path=x.json"],
    ("data", "alpaca"): ["data.path=x.json"],
    ("data", "mtbench"): ["data.path=q.jsonl"],
    ("data", "jsonl"): ["data.path=p.jsonl"],
    ("data", "text"): ["data.path=t.txt"],
    ("data", "hub"): ["data.name=some/dataset"],
    ("tree", "custom"): ["tree.choices=[[0],[0,0],[1]]"],
}


def _all_options() -> list[tuple[str, str]]:
    return [
        (g.name, f.stem) for g in sorted(CONF_DIR.iterdir()) if g.is_dir() for f in sorted(g.glob("*.yaml"))
    ]


def test_conf_has_every_group() -> None:
    groups = {g for g, _ in _all_options()}
    assert {"model", "data", "training", "deepspeed", "tree", "tracking", "debug"} <= groups


@pytest.mark.parametrize(("group", "option"), _all_options())
def test_every_config_composes(group: str, option: str) -> None:
    cfg = compose_config([f"{group}={option}", *REQUIRED.get((group, option), [])])
    assert isinstance(cfg, Config)


def test_defaults() -> None:
    cfg = compose_config([])
    assert cfg.stage == "all"
    assert cfg.workdir == "runs/default"
    assert cfg.model.embedded and cfg.model.name_or_path == "runs/default/pretrain"
    assert cfg.tracking.mode == "offline"
    assert cfg.training.mode == "medusa1" and cfg.training.decay == 0.8


def test_workdir_interpolates_into_backbone_path() -> None:
    assert compose_config(["workdir=/tmp/xyz"]).model.name_or_path == "/tmp/xyz/pretrain"


# Every option that names a local path: (the key, what makes the config need it, where it lands).
HOME_PATHS = [
    ("workdir", [], lambda cfg: cfg.workdir),
    ("model.name_or_path", ["model=hf"], lambda cfg: cfg.model.name_or_path),
    ("data.path", ["data=jsonl"], lambda cfg: cfg.data.path),
    ("data.name", ["data=hub"], lambda cfg: cfg.data.name),  # a save_to_disk folder
    ("training.init_heads", [], lambda cfg: cfg.training.init_heads),
    ("export.heads_dir", [], lambda cfg: cfg.export.heads_dir),
    ("eval.heads_dir", [], lambda cfg: cfg.eval.heads_dir),
    ("eval.path", ["eval.prompts=jsonl"], lambda cfg: cfg.eval.path),
    ("eval.assistant_model", [], lambda cfg: cfg.eval.assistant_model),
    ("eval.compare", [], lambda cfg: cfg.eval.compare[1]),
]


@pytest.mark.parametrize(("key", "needs", "read"), HOME_PATHS, ids=[k for k, _, _ in HOME_PATHS])
def test_a_leading_tilde_is_expanded_in_every_path_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, needs: list[str], read
) -> None:
    """A quoted override (no shell expands it), like a conf file's value or compose_config's caller,
    hands ``~/x`` over as is: the config holds the home directory's path, and is the config of the
    same run given that path; a path without ``~`` and a Hub id stay as they are."""
    monkeypatch.setenv("HOME", str(tmp_path))

    def value(path: str) -> str:
        return f"[runs/a,{path}]" if key == "eval.compare" else path

    cfg = compose_config([*needs, f"{key}={value(repr('~/x/y'))}"])
    assert read(cfg) == str(tmp_path / "x" / "y")
    assert cfg == compose_config([*needs, f"{key}={value(str(tmp_path / 'x' / 'y'))}"])
    assert read(compose_config([*needs, f"{key}={value(repr('~'))}"])) == str(tmp_path)
    for kept in ("runs/~x", "org/name"):
        assert read(compose_config([*needs, f"{key}={value(repr(kept))}"])) == kept


def test_a_tilde_user_path_is_that_users_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import pwd

    try:
        user = pwd.getpwuid(os.getuid())
    except KeyError:
        pytest.skip("this user has no passwd entry to name a home by")
    cfg = compose_config([f"eval.heads_dir='~{user.pw_name}/heads'"])
    assert cfg.eval.heads_dir == str(Path(user.pw_dir) / "heads")


def test_a_tilde_workdir_is_the_embedded_backbones_place_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model=tiny``'s ``name_or_path: ${workdir}/pretrain`` interpolates the workdir as given."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = compose_config(["workdir='~/w'"])
    assert cfg.workdir == str(tmp_path / "w") and cfg.model.name_or_path == str(tmp_path / "w" / "pretrain")


def test_a_tilde_in_a_conf_file_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's own conf file (YAML reads ``~/heads/run3`` as a string; only a bare ``~`` is null),
    built into the typed config as compose_config builds it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    yaml = "heads_dir: ~/heads/run3\ncompare: [~/runs/a, runs/b]\nassistant_model: ~\n"
    built = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvalConfig), OmegaConf.create(yaml)))
    assert built.heads_dir == str(tmp_path / "heads" / "run3")
    assert built.compare == [str(tmp_path / "runs" / "a"), "runs/b"] and built.assistant_model is None


def test_a_tilde_path_on_the_command_line_is_the_home_directorys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the CLI: the check before a stage names the expanded path, the stage writes under the
    home directory, and no folder named ``~`` appears where the command ran."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    args = ["workdir='~/w'", "tracking=disabled"]
    assert main([*args, "stage=all", "training.init_heads='~/missing'"]) == 2
    assert capsys.readouterr().err.startswith(f"error: training.init_heads: {home / 'missing'} ")
    assert main([*args, "stage=train"]) == 2
    assert str(home / "w" / "distill") in capsys.readouterr().err

    def stage(cfg: Config) -> dict:
        (Path(cfg.workdir) / "distill").mkdir(parents=True)
        return {}

    monkeypatch.setattr("medusa_train.__main__.get_stage", lambda name: stage)
    assert main([*args, "stage=distill"]) == 0
    assert (home / "w" / "distill").is_dir() and not any(cwd.iterdir())


@pytest.mark.parametrize(
    ("override", "read", "expected"),
    [
        ("eval.heads_dir=~/h", lambda cfg: cfg.eval.heads_dir, "{home}/h"),
        ("eval.compare=[~/a, runs/b,~/c]", lambda cfg: cfg.eval.compare, ["{home}/a", "runs/b", "{home}/c"]),
        ("training.init_heads=~", lambda cfg: cfg.training.init_heads, "{home}"),
        ("workdir=~/w", lambda cfg: cfg.model.name_or_path, "{home}/w/pretrain"),
        ("eval.heads_dir='~/quoted'", lambda cfg: cfg.eval.heads_dir, "{home}/quoted"),
        ("eval.heads_dir=runs/h", lambda cfg: cfg.eval.heads_dir, "runs/h"),
    ],
)
def test_an_unquoted_tilde_is_taken_where_no_shell_expands_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, override: str, read, expected
) -> None:
    """A shell expands ``~`` after the ``=`` of ``workdir=~/w`` (a variable assignment's form) but not
    after a dotted key, and Hydra's grammar refuses an unquoted ``~``: the value is taken as quoted."""
    monkeypatch.setenv("HOME", str(tmp_path))
    home = str(tmp_path)
    want = (
        [e.format(home=home) for e in expected] if isinstance(expected, list) else expected.format(home=home)
    )
    assert read(compose_config([override])) == want


def test_heads_compared_from_home_are_named_by_their_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``eval.compare=[~/heads]`` as bash hands it over: refused before the stage, naming the folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main([f"workdir={tmp_path / 'run'}", "stage=all", "eval.compare=[~/heads]"]) == 2
    assert capsys.readouterr().err == f"error: eval.compare: {tmp_path / 'heads'} does not exist " + (
        "(give heads folders or workdirs holding heads/)\n"
    )


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["stage=nope"], "stage"),
        (["training.lr=abc"], "training.lr"),
        (["training.lrr=1"], "lrr"),
        (["model=nope"], "model/nope"),
        (["model=hf"], "model.name_or_path"),
        (["data=sharegpt"], "data.path"),
        (["tree=custom"], "tree.choices"),
        (["distill.top_p=0"], "distill.top_p"),
        (["training.decay=1.5"], "training.decay"),
        (["training.head_loss=kl+0.5mse"], "training.head_loss"),
        (["deepspeed=zero2", "deepspeed.offload_param=true"], "offload_param"),
        (["tree=chain", "tree.chain_depth=6"], "chain_depth"),
        (["stage=pretrain", "model=hf", "model.name_or_path=x"], "model=tiny"),
        (["training=medusa2", "training.cache_hidden_states=true"], "cache_hidden_states"),
        (["workdir="], "workdir is empty"),  # every stage would write into the current directory
        (["workdir= "], "workdir is empty"),
    ],
)
def test_bad_config_names_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_config(overrides)
    message = str(err.value)
    assert needle in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("tree", "setting"),
    [
        (["tree=medusa63"], "tree=medusa63 (4 deep)"),
        (["tree=chain", "tree.chain_depth=4"], "tree.chain_depth=4"),
        (["tree=custom", "tree.choices=[[0],[1],[0,0],[0,0,0],[0,0,0,0]]"], "tree=custom (4 deep)"),
    ],
)
def test_a_tree_deeper_than_the_heads_stage_all_trains_is_refused_before_it_trains_them(
    tree: list[str], setting: str
) -> None:
    """stage=all exports and evaluates the heads it trains with the tree named: one deeper than those
    heads was refused by export, after pretraining, distillation and training. Where the heads come
    from elsewhere, or the stage runs alone, they are checked against the heads loaded (whose own
    number counts: FasterDecoding's published heads are 5), not against training.num_heads."""
    three = ["training.num_heads=3", *tree]
    with pytest.raises(ConfigError) as err:
        compose_config(["stage=all", *three])
    assert str(err.value) == (
        f"{setting} exceeds training.num_heads=3 (the heads this run trains): set training.num_heads=4 or "
        "choose a tree at most 3 deep (tree=calibrated fits the heads)"
    )
    with pytest.raises(ConfigError):
        compose_config(["stage=all", "eval.heads_dir=/elsewhere", *three])  # exports the run's own
    assert compose_config(["stage=all", "training.num_heads=4", *tree])
    assert compose_config(["stage=all", "export.heads_dir=/a", "eval.heads_dir=/b", *three])
    for stage in ("train", "export", "eval"):
        assert compose_config([f"stage={stage}", *three])


def test_stage_all_refuses_a_draft_vocabulary_the_embedded_tokenizer_cannot_exceed() -> None:
    """stage=all model=tiny trains a tokenizer of at most pretrain.vocab_size tokens: truncated heads over
    that many (the whole vocabulary, which export refuses) are refused before pretraining and distilling."""
    truncated = ["stage=all", "export.formats=[vllm]", "training.head_projection=truncated"]
    for size in (300, 301):
        with pytest.raises(ConfigError, match=rf"draft_vocab_size={size} is not below .*=300.*=own") as err:
            compose_config([*truncated, "pretrain.vocab_size=300", f"training.draft_vocab_size={size}"])
        assert "\n" not in str(err.value)
    assert compose_config([*truncated, "pretrain.vocab_size=300", "training.draft_vocab_size=299"])
    # stage=train takes the model pretrain/ holds, whatever pretrain.vocab_size says now: checked there.
    assert compose_config(
        ["stage=train", *truncated[1:], "pretrain.vocab_size=300", "training.draft_vocab_size=300"]
    )


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["training.backbone_tuning=lora"], "training.backbone_tuning=lora is a Medusa-2 option"),
        (["training=medusa1", "training.lm_loss=ce"], "training.lm_loss=ce is a Medusa-2 option"),
        (["training.lambda0=0.5"], "add training=medusa2"),
        (
            ["training.lora_target_modules=[q_proj]"],
            "training.lora_target_modules=[q_proj] is a Medusa-2 option",
        ),
    ],
)
def test_a_medusa2_option_with_medusa1_is_refused(overrides: list[str], says: str) -> None:
    """Medusa-2 options with training=medusa1 are not read: the run they were meant for (a LoRA
    backbone) was silently another (Medusa-1 heads on a frozen one)."""
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        compose_config(overrides)
    assert "\n" not in str(err.value)


def test_medusa2_options_with_medusa2_pass() -> None:
    cfg = compose_config(
        ["training=medusa2", "training.backbone_tuning=lora", "training.lora_r=8", "training.lambda0=0.5"]
    )
    assert (cfg.training.lora_r, cfg.training.lambda0) == (8, 0.5)
    assert compose_config(["training=medusa1", "training.backbone_tuning=full", "training.lm_loss=kl"])
    # LoRA options with full tuning pass: overrides shared by runs of either tuning
    assert compose_config(["training=medusa2", "training.lora_dropout=0"]).training.backbone_tuning == "full"


def test_cli_bad_input_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["stage=nope"], ["training.num_heads=abc"], ["stage=train", "training.lr=abc"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err


def test_cli_subprocess_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "medusa_train", "stage=nope", f"workdir={tmp_path}"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert not any(tmp_path.iterdir()), "a rejected config must write nothing"


def _forget_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset LOCAL_RANK now and after the test, whatever sets it meanwhile (main exports --local_rank):
    a leaked LOCAL_RANK makes later tests' Trainer start torch.distributed. ``delenv`` of an unset
    variable records nothing to undo, hence the ``setenv`` first."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("LOCAL_RANK")


def test_local_rank_flag_is_stripped(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget_local_rank(monkeypatch)
    assert strip_launcher_args(["--local_rank=3", "stage=train"]) == ["stage=train"]
    import os

    assert os.environ["LOCAL_RANK"] == "3"
    assert strip_launcher_args(["stage=eval", "--local-rank", "1", "x=1"]) == ["stage=eval", "x=1"]


def test_cfg_flag_prints_config(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _forget_local_rank(monkeypatch)
    assert main(["--cfg", "--local_rank=0", "training.lr=0.5"]) == 0
    assert '"lr": 0.5' in capsys.readouterr().out


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "stage=" in capsys.readouterr().out


# Runs ``python -m medusa_train <args>`` in a fresh interpreter (runpy is what ``-m`` uses) and
# prints the exit code and which heavy packages the run imported.
_HELP_PROBE = """
import runpy, sys
sys.argv = ["medusa_train", *sys.argv[1:]]
try:
    runpy.run_module("medusa_train", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    code = exit.code
print("EXIT", code, sorted(m for m in ("torch", "transformers", "hydra") if m in sys.modules))
"""


@pytest.mark.parametrize("flag", ["--help", "-h", "--cfg"])
def test_help_and_cfg_import_no_torch(flag: str) -> None:
    """``--help`` and ``--cfg`` answer without importing torch or transformers (seconds on a
    busy machine): the config checks ``tree.choices`` with ``medusa_train.choices``, which needs no torch."""
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_PROBE, flag],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    if flag == "--cfg":
        assert '"stage": "all"' in proc.stdout and '"workdir": "runs/default"' in proc.stdout
    else:
        assert "stage=<pretrain|distill|train|export|eval|all>" in proc.stdout and "--cfg" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1] == "EXIT 0 ['hydra']", proc.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["stage=train"],
            "distilled data not found at {workdir}/distill: run `python -m medusa_train stage=distill`",
        ),
        (
            ["stage=export"],
            "trained heads not found at {workdir}/heads: run `python -m medusa_train stage=train`",
        ),
        (["stage=eval"], "trained heads not found at {workdir}/heads"),
        (
            ["stage=distill", "model=hf", "model.name_or_path={workdir}/nope"],
            "={workdir}/nope: no such directory",
        ),
        (
            ["stage=all", "model=hf", "model.name_or_path={workdir}/nope"],
            "={workdir}/nope: no such directory",
        ),
        (["stage=train", "model=hf", "model.name_or_path=./nope"], "distilled data not found"),
        (
            ["stage=distill", "data=jsonl", "data.path={workdir}/p.jsonl"],
            "data.path={workdir}/p.jsonl does not",
        ),
        (
            ["stage=distill", "data=sharegpt", "data.path={tmp}"],
            "={tmp} is a directory without .json or .jsonl",
        ),
        (
            ["stage=all", "data=text", "data.path={workdir}/corpus.txt"],
            "data.path={workdir}/corpus.txt does not",
        ),
        (
            ["stage=all", "eval.prompts=jsonl", "eval.path={workdir}/q.jsonl"],
            "eval.path={workdir}/q.jsonl does not",
        ),
        (
            ["stage=all", "eval.prompts=mtbench", "eval.path={tmp}"],
            "={tmp} is a directory",
        ),
        (
            ["stage=eval", "eval.heads_dir={tmp}", "eval.prompts=mtbench", "eval.path={tmp}"],
            "eval.heads_dir: {tmp} has no config.json: not a Medusa heads directory (FasterDecoding or vLLM "
            "layout) (give a heads folder of either layout, or an export folder holding one)",
        ),
        (
            ["stage=all", "export.heads_dir={workdir}/other"],
            "export.heads_dir: {workdir}/other does not exist (give a heads folder of either layout",
        ),
        (
            ["stage=all", "eval.prompts=jsonl", "eval.path={tmp}/prompts/q.jsonl", "eval.prompt_key=prompt"],
            "no usable record in {tmp}/prompts/q.jsonl (1 x no 'prompt' field): set eval.prompt_key= to the field",
        ),
        (
            ["stage=all", "eval.assistant_model={workdir}/draft"],
            "eval.assistant_model={workdir}/draft does not exist",
        ),
        (
            ["stage=all", "eval.compare=[{workdir}/other]"],
            "eval.compare: {workdir}/other does not exist (give heads folders or workdirs holding heads/)",
        ),
        (
            ["stage=all", "eval.compare=[{tmp}]"],
            "eval.compare: {tmp} has no config.json",
        ),
        (
            ["stage=all", "training.init_heads={workdir}/init"],
            "training.init_heads: {workdir}/init is not a Medusa heads directory",
        ),
        # the stage's order: its data source first, then the backbone
        (
            ["stage=distill", "model=hf", "model.name_or_path=./nope", "data=jsonl", "data.path=./p.jsonl"],
            "p.jsonl does",
        ),
    ],
)
def test_a_missing_input_is_told_before_the_stage_is_imported(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    """A wrong ``workdir=``, a stage not run yet, a mistyped data path or backbone directory: the one
    line comes before the stage's import (torch, transformers: seconds), with nothing written."""
    workdir = tmp_path / "run"
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "q.jsonl").write_text('{"question": "What is a Medusa head?"}\n')
    argv = [a.format(workdir=workdir, tmp=tmp_path) for a in args]
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_PROBE, f"workdir={workdir}", *argv],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert proc.stdout.rstrip().splitlines()[-1] == "EXIT 2 ['hydra']", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert needle.format(workdir=workdir, tmp=tmp_path) in proc.stderr, proc.stderr
    assert not workdir.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["stage=distill", "model=hf", "model.name_or_path=Qwen/Qwen2-0.5B"],  # a Hub id: left to the download
        ["stage=all", "model=hf", "model.name_or_path=gpt2", "data=hub", "data.name=org/chats"],
        [
            "stage=distill",
            "model=hf",
            "model.name_or_path='~/backbone'",
            "data=jsonl",
            "data.path='~/p.jsonl'",
        ],
        ["stage=all", "eval.prompts=jsonl", "eval.path='~/p.jsonl'", "eval.assistant_model=org/draft"],
        ["stage=all"],  # model=tiny: pretrain makes the backbone
        ["stage=eval", "eval.heads_dir={tmp}/heads", "eval.prompts=mtbench", "eval.path='~/mt.jsonl'"],
        ["stage=export", "export.heads_dir={tmp}/heads"],
        ["stage=all", "export.heads_dir={tmp}/export", "eval.heads_dir={tmp}/export"],  # an export folder
        ["stage=train", "training.init_heads={tmp}/heads"],  # the workdir's distill/ is there
        ["stage=all", "training.init_heads={tmp}/heads", "eval.compare=[{tmp},{tmp}/heads]"],  # a workdir
    ],
)
def test_inputs_that_are_there_pass_the_check_before_the_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    """What the check before a stage's import lets through: Hub ids, ``~`` paths, data=hub, the
    embedded backbone stage=all makes, heads folders given instead of the workdir's, heads folders
    to start from or compare with."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _heads_folder(tmp_path / "heads")
    _heads_folder(tmp_path / "export" / "medusa")
    (tmp_path / "p.jsonl").write_text('{"prompt": "Hi."}\n')
    (tmp_path / "mt.jsonl").write_text(
        '{"question_id": 81, "category": "writing", "turns": ["Hi.", "Again."]}\n'
    )
    (tmp_path / "backbone").mkdir()
    (tmp_path / "backbone" / "config.json").write_text("{}")
    (tmp_path / "run" / "distill").mkdir(parents=True)
    cfg = compose_config([f"workdir={tmp_path / 'run'}", *(a.format(tmp=tmp_path) for a in args)])
    assert check_inputs(cfg) is None


def _heads_folder(path: Path) -> Path:
    """A folder with what the checks before a stage read of heads: a medusa config.json and a
    safetensors file whose header matches its size (not heads of any backbone)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    save_file({"0.0.linear.weight": torch.zeros(2, 2)}, str(path / "medusa_lm_head.safetensors"))
    return path


@pytest.mark.parametrize("stage", ["all", "eval"])
def test_heads_compared_with_a_damaged_calibration_are_refused_before_the_stage(
    tmp_path: Path, stage: str
) -> None:
    """eval.compare's calibration.json is read when the comparison decodes (with stage=all, after
    training and the main run): a damaged one is told before anything runs, as eval tells it."""
    heads = _heads_folder(tmp_path / "other" / "heads")
    (heads / "calibration.json").write_text(json.dumps({"head_topk_accuracy": "high"}))
    cfg = compose_config(
        [
            f"workdir={tmp_path / 'run'}",
            f"stage={stage}",
            f"eval.heads_dir={_heads_folder(tmp_path / 'heads')}",
            f"eval.compare=[{tmp_path / 'other'}]",
        ]
    )
    with pytest.raises(
        DamagedArtefactError, match=r"calibration.json is damaged \('head_topk_accuracy' is a"
    ):
        check_inputs(cfg)


@pytest.mark.parametrize("layout", ["medusa", "vllm"])
@pytest.mark.parametrize("option", ["export.heads_dir", "eval.heads_dir", "eval.compare"])
def test_damaged_heads_an_option_names_are_refused_before_the_stage_as_the_stage_refuses_them(
    tmp_path: Path, option: str, layout: str
) -> None:
    """Heads given by an option whose weights file was cut short (a killed copy): told before the
    stage's import in one line naming the option, the file and what to give; the stage, called as a
    library, refuses them with the same line (and stage=all before pretraining, not at export/eval)."""
    from medusa_train.formats import save_medusa, save_vllm
    from medusa_train.heads import MedusaHeads
    from medusa_train.stages import eval as eval_stage
    from medusa_train.stages import export

    whole = MedusaHeads(hidden_size=8, vocab_size=50, num_heads=1)
    save_medusa(whole, tmp_path / "whole")
    heads = (save_medusa if layout == "medusa" else save_vllm)(whole, tmp_path / "cut")
    weights = heads / ("medusa_lm_head.safetensors" if layout == "medusa" else "model.safetensors")
    weights.write_bytes(weights.read_bytes()[:-10])
    value = f"[{heads}]" if option == "eval.compare" else str(heads)
    args = [f"workdir={tmp_path / 'run'}", f"{option}={value}", "tree=chain", "tree.chain_depth=1"]
    if option == "eval.compare":
        args.append(f"eval.heads_dir={tmp_path / 'whole'}")
    line = f"{option}: cannot read {weights}: truncated or damaged ("
    for stage in ("all", option.split(".")[0]):
        with pytest.raises(UserError) as before:
            check_inputs(compose_config([f"stage={stage}", *args]))
        assert str(before.value).startswith(line), before.value
        assert str(before.value).endswith(HEADS_OPTIONS[option]), before.value
    run = export.run if option == "export.heads_dir" else eval_stage.run
    with pytest.raises(UserError) as during:
        run(compose_config([f"stage={option.split('.')[0]}", "tracking=disabled", *args]))
    assert str(during.value) == str(before.value)
    assert not (tmp_path / "run").exists()


def test_export_and_eval_inputs_are_checked_on_the_first_rank_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other ranks of a launch return from export and eval at once, without reading anything."""
    for stage in ("export", "eval"):
        cfg = compose_config([f"workdir={tmp_path}", f"stage={stage}"])
        monkeypatch.setenv("RANK", "1")
        assert check_inputs(cfg) is None
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(UserError, match="trained heads not found"):
            check_inputs(cfg)


# One bad value per line, each for a field whose range __post_init__ checks: the message
# names the key and says the allowed range. Every numeric field must appear here (next test).
BAD_VALUES = [
    "model.device=tpu",
    "model.device=cuda:x",
    "pretrain.vocab_size=261",
    "pretrain.hidden_size=0",
    "pretrain.num_layers=0",
    "pretrain.num_attention_heads=0",
    "pretrain.intermediate_size=0",
    "pretrain.max_position_embeddings=-1",
    "pretrain.seq_len=1",
    "pretrain.seq_len=2048",  # beyond max_position_embeddings
    "pretrain.batch_size=0",
    "pretrain.lr=0",
    "pretrain.lr=nan",
    "pretrain.warmup_steps=-1",
    "pretrain.max_steps=0",
    "pretrain.max_minutes=0",
    "pretrain.max_minutes=inf",
    "pretrain.num_conversations=-5",
    "pretrain.heldout_fraction=0",
    "pretrain.heldout_fraction=1",
    "data.max_records=0",
    "data.max_records=-3",
    "data.num_prompts=0",
    "data.num_prompts=-1",
    "data.text_prompt_chars=0",
    "data.max_prompt_tokens=0",
    "data.eval_fraction=-0.1",
    "data.eval_fraction=1",
    "distill.max_new_tokens=0",
    "distill.temperature=-1",
    "distill.temperature=nan",
    "distill.top_p=0",
    "distill.top_p=1.5",
    "distill.batch_size=0",
    "distill.shard_size=0",
    "distill.server.concurrency=0",
    "distill.server.timeout_s=0",
    "distill.server.max_retries=-1",
    "distill.server.backoff_s=-1",
    "distill.server.backoff_max_s=nan",
    "distill.server.readmit_after_s=-1",
    "distill.seed=-1",
    "distill.seed=4294967296",
    "training.num_heads=0",
    "training.num_layers=-1",
    "training.decay=0",
    "training.lr=-0.001",
    "training.lr=inf",
    "training.weight_decay=-0.1",
    "training.warmup_ratio=1",
    "training.per_device_batch_size=0",
    "training.gradient_accumulation_steps=0",
    "training.num_epochs=-1",
    "training.num_epochs=0",  # and no max_steps: nothing to train
    "training.max_steps=0",
    "training.max_steps=-5",
    "training.max_minutes=0",
    "training.max_minutes=-1",
    "training.max_seq_len=-5",
    "training.max_seq_len=5",  # 4 heads need 6 tokens
    "training.loss_chunk_size=0",
    "training.logging_steps=0",
    "training.save_steps=0",
    "training.save_total_limit=0",
    "training.seed=-1",
    "training.lr_scheduler=bogus",
    "training.lora_target_modules=[]",  # with backbone_tuning=lora (below)
    "training.draft_vocab_size=0",  # with head_projection=truncated (below)
    "training.lr_scheduler=cosine_with_min_lr",  # needs lr_scheduler_kwargs
    "training.calibration_max_records=-1",
    "training.calibration_max_records=0",
    "training.head_lr_multiplier=0",
    "training.lambda0=-0.2",
    "training.head_loss_temperature=0",
    "training.head_loss_temperature=nan",
    "training.head_loss=mse",
    "training.head_loss=kl+kl",
    "training.head_loss=0ce",
    "training.head_loss=1e400ce",  # a weight that overflows to inf
    "training.head_loss=kl+",
    "training.lambda_warmup_steps=-1",
    "training.heads_only_steps=-1",
    "training.lora_r=0",
    "training.lora_alpha=0",
    "training.lora_dropout=1",
    "deepspeed.zero_stage=4",
    "tree.chain_depth=0",
    "tree.max_nodes=0",
    "tree.topk=0",
    "tree.topk=11",
    "tree.latency_context=0",
    "tree.tolerance=-0.01",
    "tree.tolerance=1",
    "tree.choices=[1,2,3]",  # ints instead of paths
    "tree.choices=[[0],[]]",  # an empty path
    "tree.choices=[[0],[0,0,0]]",  # [0, 0] missing
    "tree.choices=[[0],[-1]]",
    "tree.choices=[[0],[0]]",
    "eval.num_prompts=0",
    "eval.max_new_tokens=0",
    "eval.temperature=0",
    "eval.posterior_threshold=-0.1",
    "eval.posterior_threshold=1.5",
    "eval.posterior_alpha=-1",
    "eval.sweep_tree_sizes=[1,0]",
    "eval.sweep_prompts=0",
    "eval.batch_sizes=[4,0]",
    "eval.prompt_lookup_tokens=0",
    "eval.seed=-1",
    "eval.attention=flash",
    "seed=-1",
    "seed=4294967296",
]


def _key(override: str) -> str:
    return override.split("=", 1)[0]


@functools.cache
def _composed_defaults() -> DictConfig:
    """conf/config.yaml composed once (Hydra's compose takes ~0.4 s, too slow to run 90 times)."""
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config")
    finally:
        GlobalHydra.instance().clear()


def _build(*overrides: str) -> Config:
    """What compose_config does after Hydra's parsing: merge the overrides into the typed schema and
    build the dataclasses (their ``__post_init__`` checks run here)."""
    merged = OmegaConf.merge(_composed_defaults(), OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_object(merged)


@pytest.mark.parametrize("override", BAD_VALUES)
def test_out_of_range_value_is_one_config_error(override: str) -> None:
    extra = {
        "tree.choices": ["tree.name=custom"],
        "training.lora_target_modules": ["training.backbone_tuning=lora"],
        "training.draft_vocab_size": ["training.head_projection=truncated"],
    }
    extra = extra.get(_key(override), [])
    with pytest.raises(ConfigError) as err:
        _build(*extra, override)
    message = str(err.value)
    assert _key(override) in message and "\n" not in message, message
    if not override.startswith("tree.choices"):  # a range or the allowed values
        assert any(w in message for w in ("must be", "is not one of", "set training.", " needs ")), message


def test_every_numeric_field_has_a_range_check() -> None:
    """A new int/float option without an entry in BAD_VALUES (and so maybe without a check) fails here."""
    numeric = {"int", "float", "int | None", "float | None", "list[int]", "list[Any] | None"}

    def walk(cls: type, prefix: str) -> list[str]:
        keys = []
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(
                f.default_factory if f.default_factory is not dataclasses.MISSING else None
            ):
                keys += walk(f.default_factory, f"{prefix}{f.name}.")
            elif f.type in numeric:
                keys.append(f"{prefix}{f.name}")
        return keys

    checked = {_key(o) for o in BAD_VALUES}
    missing = sorted(set(walk(Config, "")) - checked)
    assert not missing, f"no out-of-range test value for {missing}"
    assert "model.device" in checked


@pytest.mark.parametrize(
    "override",
    [
        "training.max_seq_len=-5",
        "data.num_prompts=0",
        "training.calibration_max_records=-1",
        "training.lr=nan",
    ],
)
def test_out_of_range_value_through_compose_config_and_cli(
    override: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same checks on the real path: Hydra's override parser, compose_config, the CLI (exit 2, one line)."""
    with pytest.raises(ConfigError, match=_key(override).replace(".", r"\.")):
        compose_config([override])
    assert main(["stage=train", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {_key(override)}=") and err.count("\n") == 1, err


def test_good_edge_values_pass() -> None:
    """The ends of each range that are allowed stay allowed (null means "all" where typed so)."""
    cfg = compose_config(
        [
            "data.max_records=1",
            "data.max_records=null",
            "training.num_layers=0",
            "training.max_steps=-1",
            "training.max_seq_len=6",
            "training.max_minutes=null",
            "distill.temperature=0",
            "distill.top_p=1",
            "pretrain.vocab_size=262",
            "pretrain.seq_len=1024",
            "tree.topk=10",
            "eval.sweep_tree_sizes=[]",
            "seed=4294967295",
            "model.device=cuda:3",  # the syntax only; whether this machine has it is checked at load
            "tree=custom",
            "tree.choices=[[1],[0],[1,0]]",
        ]
    )
    assert cfg.data.max_records is None and cfg.training.max_seq_len == 6


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://h:80a/v1", "port"),
        ("http://h:99999/v1", "port"),
        ("http://h:0/v1", "port"),
        ("h:8000/v1", "http:// or https://"),
        ("ftp://h:8000/v1", "http:// or https://"),
        ("http:///v1", "host"),
        ("http://:8000/v1", "host"),
        ("http://[::1/v1", "host"),
        ("http://h :8000/v1", "space"),
        ("http://h:8000/v1?key=1", "query"),
        ("http://user:pw@h:8000/v1", "credentials"),
    ],
)
def test_a_malformed_server_url_is_one_config_error_naming_it(url: str, why: str) -> None:
    """A URL the client cannot send to (a port that is no number, no host, another scheme) failed each
    attempt as a server fault, one line only after the whole retry budget; refused up front instead."""
    from medusa_train.config import DistillServerConfig

    with pytest.raises(ConfigError) as err:
        DistillServerConfig(urls=["http://gpu0:8000/v1", url])
    message = str(err.value)
    assert "distill.server.urls" in message and why in message and "\n" not in message, message
    if "@" not in url:
        assert repr(url) in message


def test_well_formed_server_urls_pass() -> None:
    from medusa_train.config import DistillServerConfig

    urls = [
        "http://gpu0:8000/v1",
        "https://api.example.com/v1/",
        "http://[::1]:30000/v1",
        "http://10.0.0.2/v1",
    ]
    assert DistillServerConfig(urls=urls).urls == urls
