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


def test_the_cli_leaves_the_group_when_the_stage_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing rank leaves too, so its exit code is the stage's error, not an abort at exit."""

    def failing_stage(cfg):
        assert tdist.is_initialized()
        raise RuntimeError("stage failed")

    _one_process_group(monkeypatch, launched=True)
    monkeypatch.setattr(cli, "get_stage", lambda name: failing_stage)
    with pytest.raises(RuntimeError, match="stage failed"):
        cli.run_stage(compose_config(["stage=eval"]))
    assert not tdist.is_initialized()
