"""Every config in conf/ composes and validates; bad input fails in one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from medusa_train.__main__ import main, strip_launcher_args
from medusa_train.config import CONF_DIR, Config, compose_config
from medusa_train.errors import ConfigError

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
        (["deepspeed=zero2", "deepspeed.offload_param=true"], "offload_param"),
        (["tree=chain", "tree.chain_depth=6"], "chain_depth"),
        (["stage=pretrain", "model=hf", "model.name_or_path=x"], "model=tiny"),
        (["stage=backbone"], "stage=pretrain"),  # the stage's name before issue 11
        (["training=medusa2", "training.cache_hidden_states=true"], "cache_hidden_states"),
    ],
)
def test_bad_config_names_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_config(overrides)
    message = str(err.value)
    assert needle in message
    assert "\n" not in message


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


def test_local_rank_flag_is_stripped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert strip_launcher_args(["--local_rank=3", "stage=train"]) == ["stage=train"]
    import os

    assert os.environ["LOCAL_RANK"] == "3"
    assert strip_launcher_args(["stage=eval", "--local-rank", "1", "x=1"]) == ["stage=eval", "x=1"]


def test_cfg_flag_prints_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cfg", "--local_rank=0", "training.lr=0.5"]) == 0
    assert '"lr": 0.5' in capsys.readouterr().out


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "stage=" in capsys.readouterr().out
