"""Failover between `distill.server.urls`: one endpoint down never loses or repeats a request.

In-process stand-in servers (tests/helpers/fake_openai.py) whose replies depend only on the request,
so a run spread over several endpoints must produce exactly the replies of a run on one healthy
endpoint. Every test is short: retries are 1-2 with 10 ms backoff.
"""

from __future__ import annotations

import logging
import socket

import pytest

from medusa_train.engines.base import GenRequest
from medusa_train.engines.server import UNDELIVERABLE_AFTER, ServerClient, ServerEngine, check_server
from medusa_train.errors import UserError
from tests.helpers.fake_openai import EOS_ID, FakeOpenAI

TURNS = 3
CONVERSATIONS = 12


class _Tok:
    """Enough of a tokenizer for the tokens API (which never re-tokenises)."""

    eos_token_id = EOS_ID

    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.fixture
def fake():
    servers: list[FakeOpenAI] = []

    def make(**kw) -> FakeOpenAI:
        servers.append(FakeOpenAI(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # closed again: nothing listens there


def _engine(urls: list[str], concurrency: int = 2, **kw) -> ServerEngine:
    client = ServerClient(urls, max_retries=1, backoff_s=0.01, backoff_max_s=0.02, timeout_s=5)
    return ServerEngine(
        client, model="fake", tokenizer=_Tok(), api="tokens", max_new_tokens=8, eos_ids=[EOS_ID],
        end_id=EOS_ID, concurrency=concurrency, **kw,
    )  # fmt: skip


def _distill(engine: ServerEngine) -> dict[tuple[int, int], tuple[list[int], list[int]]]:
    """Multi-turn conversations as the distill loop drives them: ``(conversation, turn) -> (context,
    reply)``; a second reply for the same turn fails the test."""
    got: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def on_done(request: GenRequest, new: list[int] | None) -> GenRequest | None:
        conv, turn = request.key
        assert (conv, turn) not in got, f"turn {turn} of conversation {conv} answered twice"
        got[(conv, turn)] = (request.context, new)
        if turn + 1 < TURNS:
            return GenRequest((conv, turn + 1), [*request.context, *new, 100 + turn])
        return None

    engine.run([GenRequest((c, 0), [1, c]) for c in range(CONVERSATIONS)], on_done)
    return got


@pytest.fixture
def reference(fake) -> dict:
    """The replies of one healthy endpoint."""
    got = _distill(_engine([fake().url]))
    assert len(got) == CONVERSATIONS * TURNS
    return got


def _counts(engine: ServerEngine) -> dict[str, dict]:
    return {c["url"]: c for c in engine.endpoint_counts()}


def test_one_dead_endpoint_of_two_changes_no_reply(fake, reference, caplog) -> None:
    dead, healthy = _dead_url(), fake()
    engine = _engine([dead, healthy.url])
    with caplog.at_level(logging.WARNING, logger="medusa_train.engines.server"):
        assert _distill(engine) == reference  # every turn exactly once, the same tokens
    counts = _counts(engine)
    assert counts[dead]["went_down"] == 1 and counts[dead]["replies"] == 0 and counts[dead]["failures"] >= 1
    assert counts[healthy.url]["replies"] == CONVERSATIONS * TURNS == healthy.answered
    assert counts[dead]["down"] and dead in counts[dead]["down"]
    assert any(f"{dead} is down" in r.getMessage() for r in caplog.records)


def test_an_endpoint_that_dies_mid_run_hands_its_requests_over(fake, reference) -> None:
    dying, healthy = fake(dead_after=5), fake()
    engine = _engine([dying.url, healthy.url])
    assert _distill(engine) == reference
    counts = _counts(engine)
    assert dying.answered == 5 and counts[dying.url]["went_down"] == 1
    # a reply still under way when its endpoint went down is discarded (it was generated elsewhere)
    assert counts[dying.url]["replies"] <= 5
    assert counts[dying.url]["replies"] + counts[healthy.url]["replies"] == CONVERSATIONS * TURNS


def test_a_malformed_answer_counts_as_down(fake, reference) -> None:
    broken, healthy = fake(garbage=True), fake()
    engine = _engine([broken.url, healthy.url])
    assert _distill(engine) == reference
    assert _counts(engine)[broken.url]["went_down"] == 1


def test_all_endpoints_down_is_one_line_naming_each(fake) -> None:
    a, b = _dead_url(), fake(dead_after=3)
    engine = _engine([a, b.url])
    with pytest.raises(UserError) as err:
        _distill(engine)
    message = str(err.value)
    assert "\n" not in message and "all 2 distill.server.urls are down" in message
    assert f"server {a} did not answer" in message and f"server {b.url} did not answer" in message
    assert "resumes where it stopped" in message
    # before any work too
    with pytest.raises(UserError) as err:
        check_server(engine.client, "fake", "tokens", [{"role": "user", "content": "hi"}], [1, 2])
    assert "\n" not in str(err.value) and a in str(err.value) and b.url in str(err.value)


def test_a_single_endpoint_fails_as_before(fake) -> None:
    """One URL: no failover, the same one line as without it (the URL, the attempts, resume)."""
    srv = fake(dead_after=2)
    with pytest.raises(UserError) as err:
        _distill(_engine([srv.url]))
    message = str(err.value)
    assert message.startswith(f"server {srv.url} did not answer after 2 attempts") and "\n" not in message


def test_a_refused_key_fails_at_once_without_failover(fake, monkeypatch) -> None:
    """HTTP 401 is the same on every endpoint: one line at once, no endpoint marked down, no retry."""
    monkeypatch.setenv("MEDUSA_FAILOVER_KEY", "wrong")
    a, b = fake(key="right"), fake(key="right")
    client = ServerClient(
        [a.url, b.url],
        api_key_env="MEDUSA_FAILOVER_KEY",
        max_retries=3,
        sleep=lambda s: pytest.fail("retried"),
    )
    engine = ServerEngine(
        client, model="fake", tokenizer=_Tok(), api="tokens", max_new_tokens=8, eos_ids=[EOS_ID],
        end_id=EOS_ID, concurrency=2,
    )  # fmt: skip
    with pytest.raises(UserError, match="HTTP 401") as err:
        _distill(engine)
    assert "\n" not in str(err.value) and "down" not in str(err.value)
    assert all(c["went_down"] == 0 for c in engine.endpoint_counts())
    assert len(a.requests) + len(b.requests) <= 4  # the first requests in flight, none sent again
    # before any work: the first endpoint's answer ends it
    with pytest.raises(UserError, match="refused the API key"):
        check_server(client, "fake", "tokens", [{"role": "user", "content": "hi"}], [1, 2])
    assert len(b.requests) <= 2


def test_check_server_leaves_a_dead_endpoint_out_with_its_reason(fake, caplog) -> None:
    dead, healthy = _dead_url(), fake()
    client = ServerClient([dead, healthy.url], max_retries=1, backoff_s=0.01)
    with caplog.at_level(logging.WARNING, logger="medusa_train.engines.server"):
        found = check_server(client, "fake", "tokens", [{"role": "user", "content": "hi"}], [1, 2])
    assert [e["url"] for e in found["endpoints"]] == [healthy.url]
    assert list(found["down"]) == [dead] and "did not answer" in found["down"][dead]
    assert any(f"{dead} is down before any work" in r.getMessage() for r in caplog.records)
    with pytest.raises(UserError, match=r"does not take model 'nope'"):  # a user's mistake: no failover
        check_server(client, "nope", "tokens", [{"role": "user", "content": "hi"}], [1, 2])


def test_a_down_endpoint_rejoins_after_the_cool_down(fake, reference, caplog) -> None:
    flaky, slow = fake(dead_after=2), fake(delay_s=0.03)
    engine = _engine([flaky.url, slow.url], concurrency=1, readmit_after_s=0.0)
    engine.run(
        [GenRequest((0, 0), [1, 0]), GenRequest((1, 0), [1, 1]), GenRequest((2, 0), [1, 2])],
        lambda r, n: None,
    )
    engine.run([GenRequest((3, 0), [1, 3]), GenRequest((4, 0), [1, 4])], lambda r, n: None)
    assert _counts(engine)[flaky.url]["went_down"] == 1  # it went down ...
    flaky.dead_after = None  # ... and is restarted
    with caplog.at_level(logging.WARNING, logger="medusa_train.engines.server"):
        assert _distill(engine) == reference
    assert any(f"{flaky.url} is back" in r.getMessage() for r in caplog.records)
    assert flaky.answered > 2 and _counts(engine)[flaky.url]["down"] is None


def test_an_endpoint_down_before_any_work_is_checked_before_it_joins(fake, reference) -> None:
    late, slow = fake(), fake(delay_s=0.03)
    checked: list[str] = []
    engine = _engine(
        [late.url, slow.url], readmit_after_s=0.0, down={late.url: f"server {late.url} did not answer"},
        check=checked.append,
    )  # fmt: skip
    assert _distill(engine) == reference
    assert checked == [late.url] and late.answered > 0
    assert _counts(engine)[late.url]["went_down"] == 1


def test_an_unfit_endpoint_stays_out(fake, reference) -> None:
    """The full check refuses it (another model, say): it is not probed again and takes no request."""
    other, healthy = fake(), fake()

    def check(url: str) -> None:
        raise UserError(f"server {url} serves another model: use one model")

    engine = _engine([other.url, healthy.url], readmit_after_s=0.0, down={other.url: "down"}, check=check)
    assert _distill(engine) == reference
    assert other.answered == 0 and "serves another model" in _counts(engine)[other.url]["down"]


POISON = 77
"""A token no stand-in reply holds (their ids are below 50): the context that crashes the server."""


def _distill_with_poison(engine: ServerEngine, poisoned: int) -> dict:
    """``_distill`` with conversation ``poisoned``'s first context holding :data:`POISON`."""
    got: dict = {}

    def on_done(request: GenRequest, new: list[int] | None) -> GenRequest | None:
        conv, turn = request.key
        assert (conv, turn) not in got, f"turn {turn} of conversation {conv} answered twice"
        got[(conv, turn)] = (request.context, new)
        if new is not None and turn + 1 < TURNS:
            return GenRequest((conv, turn + 1), [*request.context, *new, 100 + turn])
        return None

    first = [GenRequest((c, 0), [1, c] + ([POISON] if c == poisoned else [])) for c in range(CONVERSATIONS)]
    engine.run(first, on_done)
    return got


@pytest.mark.parametrize("endpoints", [1, 2])
def test_a_request_that_crashes_every_server_is_given_up_not_the_endpoints(
    fake, reference, caplog, endpoints
):
    """A context that makes every server fail (HTTP 500 after every retry) while the same servers
    answer the other requests: the request is sent again, then given up (its reply dropped and
    counted); no endpoint goes down and every other conversation is generated as on a healthy server.
    Before, it took each endpoint down in turn and stopped the run, and again on every resume."""
    # conversation 0 holds it: every other request still to come shows that the servers work
    servers = [fake(poison=POISON, poison_delay_s=0.1, delay_s=0.05) for _ in range(endpoints)]
    engine = _engine([s.url for s in servers], concurrency=2)
    with caplog.at_level(logging.WARNING, logger="medusa_train.engines.server"):
        got = _distill_with_poison(engine, poisoned=0)
    assert got.pop((0, 0)) == ([1, 0, POISON], None)  # its one reply: given up
    assert got == {k: v for k, v in reference.items() if k[0] != 0}
    assert engine.stats["undeliverable"] == 1
    counts = _counts(engine)
    assert all(c["went_down"] == 0 and c["down"] is None for c in counts.values())
    assert sum(s.poisoned for s in servers) == UNDELIVERABLE_AFTER * 2  # each try: 2 attempts (1 retry)
    messages = [r.getMessage() for r in caplog.records]
    assert any("giving up request (0, 0)" in m and "replies_dropped_undeliverable" in m for m in messages)
    assert not any(" is down " in m for m in messages)


def test_a_crashing_request_is_given_up_when_nothing_else_is_left_to_show_the_server_works(fake) -> None:
    """The request's second failure comes when no other request is in flight (the end of a shard): it
    failed once on a working server already, and the server answers a probe now, so it is given up
    there too instead of taking the only endpoint down and stopping the run."""
    srv = fake(poison=POISON, poison_delay_s=0.2, delay_s=0.03)
    engine = _engine([srv.url], concurrency=2)
    got: dict = {}

    def on_done(request: GenRequest, new: list[int] | None) -> GenRequest | None:
        got[request.key] = new
        conv, turn = request.key
        return GenRequest((conv, turn + 1), [*request.context, *new, 9]) if new and turn < 2 else None

    engine.run([GenRequest((0, 0), [1, 0, POISON]), GenRequest((1, 0), [1, 1])], on_done)
    assert got[(0, 0)] is None and all(got[(1, t)] for t in range(3))  # conversation 1: 3 turns, 0.09 s
    assert engine.stats["undeliverable"] == 1 and _counts(engine)[srv.url]["went_down"] == 0
    assert srv.poisoned == UNDELIVERABLE_AFTER * 2
    assert ("GET", "/v1/models") in srv.requests  # the probe that found it working
