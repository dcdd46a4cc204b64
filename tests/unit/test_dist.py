"""The process group's end of life: a launched rank leaves it before exiting, nothing else is touched."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as tdist

from medusa_train import __main__ as cli
from medusa_train import dist
from medusa_train.config import compose_config


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
