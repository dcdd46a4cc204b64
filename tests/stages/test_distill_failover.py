"""stage=distill over several `distill.server.urls` when one of them is or goes down (failover).

The servers are in-process stand-ins (tests/helpers/fake_openai.py) whose replies depend only on the
conversation, so the records of a run whose endpoints fail must equal those of a run on one healthy
endpoint, each exactly once. Only the tiny backbone's tokenizer and config are loaded (no weights).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from medusa_train.config import compose_config
from medusa_train.data.distilled import read_manifest
from medusa_train.stages import distill
from tests.helpers.distill import rows as _rows
from tests.helpers.fake_openai import FakeOpenAI


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def _run(workdir: Path, backbone: Path, prompts: Path, urls: list[str], *more: str) -> dict:
    return distill.run(
        compose_config(
            [
                "stage=distill", f"workdir={workdir}", "model=hf", f"model.name_or_path={backbone}",
                "model.device=cpu", "tracking=disabled", "data=jsonl", f"data.path={prompts}",
                "distill.max_new_tokens=8", "distill.shard_size=4", "distill.engine=server",
                f"distill.server.urls=[{','.join(urls)}]", "distill.server.concurrency=2",
                "distill.server.max_retries=1", "distill.server.backoff_s=0.01", "distill.server.timeout_s=10",
                *more,
            ]
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    words = "the cat dog sat on a mat tell me a story about why the day is big".split()
    rows = [
        {"prompt": [" ".join(words[i : i + 3 + i % 5]) + "?" for _ in range(1 + i % 3)]} for i in range(10)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def fake(tiny_backbone_dir):
    servers: list[FakeOpenAI] = []

    def make(**kw) -> FakeOpenAI:
        servers.append(FakeOpenAI(str(tiny_backbone_dir), **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.fixture(scope="module")
def reference(tiny_backbone_dir, prompts, tmp_path_factory) -> list:
    srv = FakeOpenAI(str(tiny_backbone_dir))
    try:
        workdir = tmp_path_factory.mktemp("one_endpoint")
        _run(workdir, tiny_backbone_dir, prompts, [srv.url])
    finally:
        srv.close()
    rows = _rows(workdir)
    assert len(rows) == 10 and sum(len(ids) for _, ids, _ in rows) > 0
    return rows


@pytest.mark.parametrize("how", ["dead from the start", "dies mid-run"])
def test_records_equal_one_healthy_endpoint_run_and_counts_reach_the_manifest(
    how, fake, tiny_backbone_dir, prompts, reference, tmp_path
) -> None:
    healthy = fake()
    if how == "dead from the start":
        failing = _dead_url()
    else:
        failing = fake(dead_after=4).url
    figures = _run(tmp_path, tiny_backbone_dir, prompts, [failing, healthy.url])
    rows = _rows(tmp_path)
    assert rows == reference and figures["records"] == 10  # every record exactly once, same tokens
    assert len({source_id for source_id, _, _ in rows}) == len(rows)
    engine = read_manifest(tmp_path / "distill")["engine"]
    counts = {c["url"]: c for c in engine["endpoint_counts"]}
    assert counts[failing]["went_down"] == 1 and counts[healthy.url]["replies"] > 0
    if how == "dead from the start":  # left out before any work: its URL is not among the checked ones
        assert [e["url"] for e in engine["endpoints"]] == [healthy.url] and counts[failing]["replies"] == 0
    else:
        assert counts[failing]["replies"] <= 4 and counts[failing]["failures"] >= 1


@pytest.mark.parametrize("poisoned", [0, 1])
def test_a_record_whose_context_crashes_every_server_is_dropped_and_counted(
    fake, tiny_backbone_dir, tmp_path, poisoned
):
    """One record's first prompt makes every server fail (HTTP 500 after every retry) while they answer
    the others: that record is dropped (its reply counted as undeliverable), every other record is
    written as on a healthy server, and no endpoint goes down. The first record too: the servers'
    check before any work sends the shortest prompt, not the first."""
    words = "the cat dog sat on a mat tell me a story about why the day is big".split()
    rows = [{"prompt": [" ".join(words[i % 12 : i % 12 + 4])]} for i in range(16)]
    rows[poisoned]["prompt"] = ["xyzzy " + rows[poisoned]["prompt"][0]]  # the others still to come
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    healthy = fake()
    _run(tmp_path / "healthy", tiny_backbone_dir, prompts, [healthy.url])
    # each failure takes longer than a reply, so an endpoint has answered another request by then
    a, b = (fake(poison="xyzzy", poison_delay_s=0.25, delay_s=0.1) for _ in range(2))
    # one shard: a request is found to be what fails by the replies its endpoint gives meanwhile
    figures = _run(tmp_path / "poisoned", tiny_backbone_dir, prompts, [a.url, b.url], "distill.shard_size=16")
    expected = _rows(tmp_path / "healthy")
    poisoned_id = expected.pop(poisoned)[0]
    assert poisoned_id not in {r[0] for r in _rows(tmp_path / "poisoned")}
    assert _rows(tmp_path / "poisoned") == expected and figures["records"] == 15
    manifest = read_manifest(tmp_path / "poisoned" / "distill")
    assert manifest["counts"]["replies_dropped_undeliverable"] == 1
    assert manifest["counts"]["records_dropped_not_token_exact"] == 1  # left with no reply
    assert all(c["went_down"] == 0 for c in manifest["engine"]["endpoint_counts"])
