"""The OpenAI-compatible client: retries with backoff and jitter, refusals, the key, token-id replies.

A scripted HTTP server on 127.0.0.1 (standard library) answers with the statuses and bodies under
test; the real `transformers serve` runs in tests/stages/test_distill_server.py.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from medusa_train.data.chat import ChatRenderer
from medusa_train.data.regenerate import distill_records
from medusa_train.data.sources import Conversation
from medusa_train.data.tokenizer import train_tokenizer
from medusa_train.engines.base import GenRequest
from medusa_train.engines.server import (
    ServerClient,
    ServerEngine,
    ServerRefused,
    ServerUnavailable,
    check_endpoint,
)
from medusa_train.errors import UserError
from tests.helpers.distill import spans
from tests.helpers.local_server import LocalServer
from tests.helpers.tokenizers import THINK, fast_chat_tokenizer, slow_chat_tokenizer


class Scripted(LocalServer):
    """Answers requests with ``script`` in order (status, headers, body: JSON, or bytes sent as they
    are), recording what came in."""

    def __init__(self, script: list[tuple[int, dict, dict]]) -> None:
        self.script = list(script)
        self.seen: list[tuple[str, dict, dict | None]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                owner.seen.append((self.path, dict(self.headers), body))
                status, headers, payload = owner.script.pop(0) if owner.script else (500, {}, {})
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        super().__init__(Handler)


@pytest.fixture
def scripted():
    servers = []

    def make(script):
        servers.append(Scripted(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_retries_429_and_5xx_with_exponential_backoff_and_jitter(scripted) -> None:
    srv = scripted([(503, {}, {}), (429, {"Retry-After": "0"}, {}), (502, {}, {}), (200, {}, {"ok": 1})])
    delays: list[float] = []
    client = ServerClient([srv.url], max_retries=5, backoff_s=0.5, backoff_max_s=1.5, sleep=delays.append)
    assert client.request(srv.url, "/models") == {"ok": 1}
    assert client.retries == 3 and len(srv.seen) == 4
    for i, d in enumerate(delays):  # jitter in [0.5, 1] of min(cap, base * 2**i)
        cap = min(1.5, 0.5 * 2**i)
        assert 0.5 * cap <= d <= cap


def test_answers_that_are_not_utf8_and_tgis_424_are_retried(scripted) -> None:
    """A proxy's gzip page (not even UTF-8) and TGI's 424 (a generation error, e.g. out of memory)
    are server faults: retried, not a crash or a refusal."""
    gzip_page = b"\x1f\x8b\x08\x00\xff\xfe not json"
    srv = scripted([(200, {}, gzip_page), (424, {}, {"error": "CUDA out of memory"}), (200, {}, {"ok": 1})])
    client = ServerClient([srv.url], max_retries=3, backoff_s=0.0, sleep=lambda _: None)
    assert client.request(srv.url, "/models") == {"ok": 1}
    assert client.retries == 2


def test_a_server_answering_no_json_is_told_apart_from_one_that_does_not_answer(scripted) -> None:
    """An endpoint that answers every attempt with a page that is no JSON (a proxy's, a login page, a
    URL without /v1) is not down: the one line says it answered and what to check, not "start it"."""
    page = b"<html>502 Bad Gateway</html>"
    srv = scripted([(200, {}, page)] * 3)
    client = ServerClient([srv.url], max_retries=2, backoff_s=0.0, sleep=lambda _: None)
    with pytest.raises(ServerUnavailable) as err:
        client.request(srv.url, "/models")
    message = str(err.value)
    assert "\n" not in message and f"server {srv.url} answered 3 attempts" in message
    assert "with no JSON" in message and "ending in /v1" in message and "did not answer" not in message
    srv = scripted([(200, {}, page), (503, {}, {})])  # the last attempt got no answer: down as before
    client = ServerClient([srv.url], max_retries=1, backoff_s=0.0, sleep=lambda _: None)
    with pytest.raises(ServerUnavailable, match="did not answer after 2 attempts"):
        client.request(srv.url, "/models")


def test_a_4xx_is_not_retried(scripted) -> None:
    srv = scripted([(400, {}, {"detail": "bad field"})])
    client = ServerClient([srv.url], max_retries=5, sleep=lambda s: pytest.fail("must not retry"))
    with pytest.raises(ServerRefused, match="HTTP 400.*bad field"):
        client.request(srv.url, "/chat/completions", {"x": 1})


def test_a_server_that_stays_down_fails_in_one_line_naming_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}/v1"
    client = ServerClient([url], max_retries=2, backoff_s=0.01)
    with pytest.raises(UserError) as err:
        client.request(url, "/models")
    message = str(err.value)
    assert "\n" not in message and url in message and "after 3 attempts" in message


def test_the_key_comes_from_the_named_variable_and_is_sent_as_bearer(scripted, monkeypatch) -> None:
    monkeypatch.delenv("MEDUSA_UNIT_KEY", raising=False)
    with pytest.raises(UserError, match="MEDUSA_UNIT_KEY is not set"):
        ServerClient(["http://127.0.0.1:9/v1"], api_key_env="MEDUSA_UNIT_KEY")
    monkeypatch.setenv("MEDUSA_UNIT_KEY", "sk-unit-secret")
    srv = scripted([(401, {}, {"error": "no"})])
    client = ServerClient([srv.url], api_key_env="MEDUSA_UNIT_KEY")
    with pytest.raises(ServerRefused) as err:
        client.request(srv.url, "/models")
    assert srv.seen[0][1]["Authorization"] == "Bearer sk-unit-secret"
    assert "sk-unit-secret" not in str(err.value)


class _Tok:
    """Enough of a tokenizer for the tokens API (which never re-tokenises)."""

    eos_token_id = 2

    def decode(self, ids):
        return " ".join(map(str, ids))


def _engine(*urls: str, tokenizer=None, api: str = "tokens", max_new_tokens: int = 4, **kw) -> ServerEngine:
    """A ServerEngine of model ``m`` on ``urls``: EOS 2, one request in flight per endpoint."""
    return ServerEngine(
        ServerClient(list(urls)), model="m", tokenizer=tokenizer or _Tok(), api=api,
        max_new_tokens=max_new_tokens, eos_ids=[2], end_id=2, concurrency=1, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("shape", ["token_ids", "logprobs"])
def test_tokens_api_reads_vllm_ids_and_closes_replies_with_eos(scripted, shape) -> None:
    def choice(ids: list[int], finish: str) -> dict:
        if shape == "token_ids":
            return {"token_ids": ids, "finish_reason": finish}
        return {"logprobs": {"tokens": [f"token_id:{i}" for i in ids]}, "finish_reason": finish}

    srv = scripted(
        [
            (200, {}, {"model": "m", "choices": [choice([5, 6, 2], "stop")]}),  # EOS listed
            (200, {}, {"model": "m", "choices": [choice([7, 8], "stop")]}),  # EOS not listed: appended
            (200, {}, {"model": "m", "choices": [choice([9, 9, 9], "length")]}),  # cut at the cap
        ]
    )
    engine = _engine(srv.url, max_new_tokens=3)
    got = {}
    engine.run([GenRequest(i, [1, 4, i]) for i in range(3)], lambda r, new: got.__setitem__(r.key, new))
    assert got == {0: [5, 6, 2], 1: [7, 8, 2], 2: [9, 9, 9]}
    bodies = [b for _, _, b in srv.seen]
    assert [b["prompt"] for b in bodies] == [[1, 4, 0], [1, 4, 1], [1, 4, 2]]  # our exact ids
    assert all(b["return_tokens_as_token_ids"] and b["stop_token_ids"] == [2] for b in bodies)


@pytest.mark.parametrize("top_k", [0, 20])
def test_sampled_requests_carry_their_seed_and_the_generation_config_override(scripted, top_k) -> None:
    """A sampled request asks for sampling in ``generation_config`` (``transformers serve`` otherwise
    keeps a base model's greedy default) with the model's top-k (0: none, not generate's 50); a
    greedy one sends temperature 0 alone."""
    answer = (200, {}, {"model": "m", "choices": [{"token_ids": [5, 2], "finish_reason": "stop"}]})
    srv = scripted([answer] * 2)
    for temperature in (0.8, 0.0):
        engine = _engine(srv.url, temperature=temperature, top_p=0.9, top_k=top_k)
        engine.run([GenRequest(0, [1, 3], seed=(1 << 31) + 7)], lambda r, new: None)
    sampled, greedy = (body for _, _, body in srv.seen)
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"]) == (0.8, 0.9, 7)
    assert json.loads(sampled["generation_config"]) == {"do_sample": True, "top_k": top_k}
    assert greedy["temperature"] == 0.0
    assert not {"top_p", "seed", "generation_config"} & greedy.keys()


class _WordTok:
    """Enough of a tokenizer for the chat API: a text of numbers is its ids."""

    is_fast = True

    def __call__(self, text, add_special_tokens=False, split_special_tokens=False):
        return {"input_ids": [int(w) for w in text.split()]}

    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.mark.parametrize(
    ("text", "finish", "generated", "ids", "counted"),
    [
        ("5 6", "stop", 3, [5, 6, 2], 0),  # ended: the EOS appended
        ("5 6 7", "length", 3, [5, 6, 7], 0),  # cut at the cap (3)
        ("5 6", "length", 3, [5, 6, 2], 1),  # EOS at the cap (transformers serve), or a split one short
        ("5 6", "stop", 4, [5, 6, 2], 1),  # text the server dropped (transformers serve: Qwen's spaces)
        ("5 6", "length", 2, [5, 6], 0),  # a server that cut early at its own limit: no EOS
        ("5 6", "abort", 2, None, 0),  # a reply the model did not finish: dropped
    ],
)
def test_chat_replies_end_with_eos_only_when_they_ended(
    scripted, text, finish, generated, ids, counted
) -> None:
    usage = {"completion_tokens": generated, "prompt_tokens": 2}
    answer = {
        "model": "m",
        "usage": usage,
        "choices": [{"message": {"content": text}, "finish_reason": finish}],
    }
    srv = scripted([(200, {}, answer)])
    engine = _engine(srv.url, tokenizer=_WordTok(), api="chat", max_new_tokens=3)
    got = {}
    engine.run(
        [GenRequest(0, [1, 4], None, [{"role": "user", "content": "4"}])], lambda r, n: got.update({0: n})
    )
    assert got[0] == ids
    assert engine.stats["token_count_differs"] == counted
    assert engine.stats["unfinished"] == (ids is None)


def test_a_chat_reply_quoting_the_eos_is_text_in_the_record(scripted) -> None:
    """A reply whose text holds the EOS string or another special token's (the model wrote ``<|end|>``
    as text; a text API returns it as text) is re-tokenised as plain text: each reply span of the
    record holds one special id, the EOS that closes it (the quoted one was the EOS id: an end of turn
    in mid-reply), the template's markup around it keeps its ids, and the next turn's messages hold
    the reply as the server wrote it (the EOS id was dropped from them)."""
    tok = train_tokenizer(
        ["why is the cat on the mat?", "tell me more about the dog.", "it is big"] * 20, 300
    )
    renderer = ChatRenderer(tok)
    conv = Conversation("r", ["why is the cat big?", "and the dog?"])
    replies = ["it is <|end|> big", "the <|assistant|>dog<|end|>"]
    srv = scripted(
        [
            (200, {}, {"model": "m", "choices": [{"message": {"content": text}, "finish_reason": "stop"}]})
            for text in replies
        ]
    )
    eos = tok.eos_token_id
    engine = ServerEngine(
        ServerClient([srv.url]), model="m", tokenizer=tok, api="chat", max_new_tokens=32, eos_ids=[eos],
        end_id=eos, concurrency=1,
    )  # fmt: skip
    (record,) = distill_records(
        engine, renderer, [conv], [renderer.prompt_ids(conv)], max_context=10_000, eos_ids=[eos]
    )
    special = set(tok.all_special_ids)
    replied = [record.input_ids[a:b] for a, b in spans(record.loss_mask)]
    assert [tok.decode(ids) for ids in replied] == [text + "<|end|>" for text in replies]
    assert [[i for i in ids if i in special] for ids in replied] == [[eos], [eos]]
    markup = [i for i, m in zip(record.input_ids, record.loss_mask, strict=True) if not m and i in special]
    assert tok.convert_ids_to_tokens(markup) == [
        "<|bos|>", "<|user|>", "<|end|>", "<|assistant|>", "<|user|>", "<|end|>", "<|assistant|>"
    ]  # fmt: skip
    assert srv.seen[1][2]["messages"][1] == {"role": "assistant", "content": replies[0]}
    assert engine.stats["not_round_trip"] == 0


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_a_chat_reply_keeps_its_added_tokens_that_are_not_special_with_a_slow_tokenizer_too(
    scripted, kind
) -> None:
    """A reply holding ``<think>`` (added, not special: the model generated its id, and the servers keep
    it in the text) gets that id back, the special-token string beside it stays text: with a slow
    (Python) tokenizer too, whose ``split_special_tokens`` split ``<think>`` into its bytes (the
    text round-trips, so the reply was kept with ids the model never generated)."""
    tok = fast_chat_tokenizer() if kind == "fast" else slow_chat_tokenizer()
    think, eos = tok.convert_tokens_to_ids(THINK), tok.eos_token_id
    text = "<think>why</think> it is <|end|> big"
    answer = {"model": "m", "choices": [{"message": {"content": text}, "finish_reason": "stop"}]}
    srv = scripted([(200, {}, answer)])
    engine = ServerEngine(
        ServerClient([srv.url]), model="m", tokenizer=tok, api="chat", max_new_tokens=64, eos_ids=[eos],
        end_id=eos, concurrency=1,
    )  # fmt: skip
    got = {}
    request = GenRequest(0, [1, 4], None, [{"role": "user", "content": "why?"}])
    engine.run([request], lambda r, new: got.update({0: new}))
    ids = got[0]
    assert ids[0] == think and ids.count(think) == 1 and ids.index(eos) == len(ids) - 1
    assert tok.decode(ids[:-1]) == text and engine.stats["not_round_trip"] == 0


def test_chat_replies_are_tokenised_on_the_thread_that_runs_the_engine(scripted) -> None:
    """The request threads never call the tokenizer: its ``split_special_tokens`` is state every call
    sets, and the chat renderer uses the same tokenizer on the calling thread meanwhile."""
    answer = {"model": "m", "choices": [{"message": {"content": "5 6"}, "finish_reason": "stop"}]}
    srv = scripted([(200, {}, answer)] * 4)
    threads: set[int] = set()

    class Recording(_WordTok):
        def __call__(self, text, **kw):
            threads.add(threading.get_ident())
            return super().__call__(text, **kw)

        def decode(self, ids):
            threads.add(threading.get_ident())
            return super().decode(ids)

    engine = _engine(srv.url, tokenizer=Recording(), api="chat")
    got = {}
    requests = [GenRequest(i, [1, 4], None, [{"role": "user", "content": "4"}]) for i in range(4)]
    engine.run(requests, lambda r, n: got.update({r.key: n}))
    assert got == {i: [5, 6, 2] for i in range(4)} and threads == {threading.get_ident()}


def test_an_unfinished_token_reply_is_dropped(scripted) -> None:
    answer = {"model": "m", "choices": [{"token_ids": [5, 6], "finish_reason": "abort"}]}
    srv = scripted([(200, {}, answer)])
    engine = _engine(srv.url)
    got = {}
    engine.run([GenRequest(0, [1, 3])], lambda r, new: got.update({0: new}))
    assert got == {0: None} and engine.stats["unfinished"] == 1


@pytest.mark.parametrize("api", ["tokens", "chat"])
@pytest.mark.parametrize("finish", [["stop"], {"type": "stop"}, 1])
def test_a_finish_reason_that_is_no_string_is_one_line_naming_the_url(scripted, api, finish) -> None:
    """A list or an object as finish_reason raised TypeError (unhashable) mid-run: it is the
    ServerUnavailable of other answers in no OpenAI shape, as is a number."""
    choice = {"token_ids": [5, 2]} if api == "tokens" else {"message": {"content": "5"}}
    srv = scripted([(200, {}, {"model": "m", "choices": [{**choice, "finish_reason": finish}]})])
    engine = _engine(srv.url, tokenizer=_WordTok(), api=api)
    request = GenRequest(0, [1, 4], None, [{"role": "user", "content": "4"}])
    with pytest.raises(ServerUnavailable, match="finish_reason that is no string") as err:
        engine.run([request], lambda r, new: None)
    assert err.value.url == srv.url and "\n" not in str(err.value)


def test_requests_spread_over_endpoints_within_their_concurrency(scripted) -> None:
    """Two endpoints, one request in flight each: both serve, and follow-ups are generated too."""
    answer = (200, {}, {"model": "m", "choices": [{"token_ids": [5, 2], "finish_reason": "stop"}]})
    a, b = scripted([answer] * 6), scripted([answer] * 6)
    engine = _engine(a.url, b.url)
    done: list[int] = []

    def on_done(request, new):
        done.append(request.key)
        return GenRequest(request.key + 100, [1]) if request.key < 2 else None  # one follow-up each

    engine.run([GenRequest(i, [1, i]) for i in range(4)], on_done)
    assert sorted(done) == [0, 1, 2, 3, 100, 101]
    assert len(a.seen) >= 1 and len(b.seen) >= 1 and len(a.seen) + len(b.seen) == 6  # the first two: one each


@pytest.mark.parametrize(
    "apart",
    [
        {"reasoning_content": "hm"},  # vLLM/SGLang with a reasoning parser, transformers serve (Qwen)
        {"reasoning": "hm"},  # newer vLLM
        {"tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ],
)
def test_a_chat_reply_the_server_parsed_apart_is_dropped(scripted, apart, caplog) -> None:
    """A server with a reasoning (or tool-call) parser returns only part of what the model generated
    as ``content``: the rest of the reply (``<think>...</think>``) is not in the text, so the
    re-tokenised text is not the model's reply. It is dropped and counted, with one warning."""
    usage = {"completion_tokens": 9, "prompt_tokens": 2}
    split = {"message": {"content": "5 6", **apart}, "finish_reason": "stop"}
    # vLLM's message always holds these fields: empty, the reply is whole
    whole = {
        "message": {"content": "5 6", "reasoning_content": None, "tool_calls": []},
        "finish_reason": "stop",
    }
    srv = scripted([(200, {}, {"model": "m", "usage": usage, "choices": [c]}) for c in (split, split, whole)])
    engine = _engine(srv.url, tokenizer=_WordTok(), api="chat", max_new_tokens=3)
    got = {}
    with caplog.at_level("WARNING", logger="medusa_train.engines.server"):
        engine.run(
            [GenRequest(i, [1, 4], None, [{"role": "user", "content": "4"}]) for i in range(3)],
            lambda r, n: got.update({r.key: n}),
        )
    assert got == {0: None, 1: None, 2: [5, 6, 2]}
    assert engine.stats["split_by_server"] == 2
    warnings = [r.getMessage() for r in caplog.records if "apart" in r.getMessage()]
    assert len(warnings) == 1 and srv.url in warnings[0]


def test_every_count_of_a_dropped_or_flagged_reply_reaches_the_shard_counts() -> None:
    """stage=distill writes each of the engine's counts (but ``replies``) into the shard's counts."""
    from medusa_train.stages.distill import _exactness_counts

    stats = {key: 1 for key in _engine("http://127.0.0.1:9/v1").stats}
    counts = _exactness_counts(stats, {}, [])
    assert sum(counts.values()) == len(stats) - 1  # records_dropped_not_token_exact: 0 of no rows


def test_a_key_with_a_trailing_newline_is_sent_without_it_and_a_bad_key_is_refused_unseen(
    scripted, monkeypatch
) -> None:
    """A key read from a file (a Kubernetes secret) often ends in a newline, which no header carries:
    the request failed every retry as a server fault, its one line quoting the key. Whitespace around
    the key is dropped; a key a header cannot carry is refused before any request, without its value."""
    monkeypatch.setenv("MEDUSA_UNIT_KEY", "sk-unit-secret\n")
    srv = scripted([(200, {}, {"ok": 1})])
    client = ServerClient([srv.url], api_key_env="MEDUSA_UNIT_KEY", max_retries=0)
    assert client.request(srv.url, "/models") == {"ok": 1}
    assert srv.seen[0][1]["Authorization"] == "Bearer sk-unit-secret"
    for bad in ("sk-unit\nsecret", "sk-unit-s\u00e9cret"):
        monkeypatch.setenv("MEDUSA_UNIT_KEY", bad)
        with pytest.raises(UserError, match="MEDUSA_UNIT_KEY") as err:
            ServerClient([srv.url], api_key_env="MEDUSA_UNIT_KEY")
        assert "\n" not in str(err.value) and "sk-unit" not in str(err.value)


class _FakeClient(ServerClient):
    """Answers ``request(url, path, ...)`` from ``answers`` by path (an exception instance is raised)."""

    def __init__(self, answers: dict, api_key_env: str | None = None) -> None:
        super().__init__(["http://gpu0:8000/v1"], api_key_env=api_key_env)
        self.answers = answers

    def request(self, url, path, body=None, **kw):
        answer = self.answers[path]
        if isinstance(answer, Exception):
            raise answer
        return answer


_CHAT_OK = {"model": "m", "choices": [{"message": {"content": "x"}, "finish_reason": "length"}]}


@pytest.mark.parametrize(
    "listing",
    [
        {"data": None},
        {"data": 5},
        {"data": "m"},
        {"data": {"id": "m"}},
        [{"id": "m"}],
        "m",
        {"data": [{"root": "m"}]},  # an entry without an id
        {"data": [{"id": ["m"]}]},
        {"data": ["m"]},
    ],
)
def test_a_malformed_models_listing_is_one_line_naming_the_url(listing) -> None:
    """Every /models answer in a shape no OpenAI-compatible server sends is the error the check raises
    for other answers in no OpenAI shape (``{"data": null}`` raised TypeError)."""
    url = "http://gpu0:8000/v1"
    client = _FakeClient({"/models": listing, "/chat/completions": _CHAT_OK})
    with pytest.raises(ServerUnavailable) as err:
        check_endpoint(client, url, "m", "chat", [{"role": "user", "content": "hi"}], [1])
    assert err.value.url == url and "/models" in err.value.reason and "\n" not in str(err.value)


def test_a_models_answer_without_a_listing_leaves_it_to_the_probe() -> None:
    """A server that answers /models with one model object (no ``data``) is checked by the probe."""
    client = _FakeClient({"/models": {"id": "m", "object": "model"}, "/chat/completions": _CHAT_OK})
    got = check_endpoint(client, "http://gpu0:8000/v1", "m", "chat", [{"role": "user", "content": "hi"}], [1])
    assert got == {"url": "http://gpu0:8000/v1", "model_id": "m", "root": "m"}


@pytest.mark.parametrize(
    "choice",
    [
        {"token_ids": ["a"], "finish_reason": "length"},
        {"token_ids": [None], "finish_reason": "length"},
        {"logprobs": ["token_id:5"], "finish_reason": "length"},
        {"logprobs": {"tokens": ["token_id:x"]}, "finish_reason": "length"},
    ],
)
def test_token_ids_that_are_not_integers_are_one_line_in_the_check_and_the_run(scripted, choice) -> None:
    """The api=tokens probe raised the ValueError/TypeError/AttributeError of the bad ids."""
    url = "http://gpu0:8000/v1"
    listing = {"data": [{"id": "m"}]}
    answer = {"model": "m", "choices": [choice]}
    client = _FakeClient({"/models": listing, "/chat/completions": _CHAT_OK, "/completions": answer})
    with pytest.raises(ServerUnavailable, match="token ids that are not integers") as err:
        check_endpoint(client, url, "m", "tokens", [{"role": "user", "content": "hi"}], [1])
    assert err.value.url == url
    srv = scripted([(200, {}, answer)])
    engine = _engine(srv.url)
    with pytest.raises(UserError, match="token ids that are not integers"):
        engine.run([GenRequest(0, [1, 3])], lambda r, new: None)


@pytest.mark.parametrize("key", ["sk-unit-secret", 'sk-unit"secret\\'])
def test_server_text_quoted_in_errors_and_logs_never_holds_the_key(
    scripted, monkeypatch, caplog, key
) -> None:
    """A proxy may echo the Authorization header in what it answers; every quote of server text (an
    error body, the shape of an answer, the models a listing names) leaves the key out, also where the
    server escaped it as JSON."""
    monkeypatch.setenv("MEDUSA_UNIT_KEY", key)
    echo = {"error": f"got headers: Authorization: Bearer {key}"}
    probe = [{"role": "user", "content": "hi"}]
    srv = scripted(
        [
            (401, {}, echo),  # a refusal: ServerRefused's detail
            (503, {}, echo),  # a retryable answer: the last failure of ServerUnavailable
            (200, {}, {"data": echo}),  # a listing in no OpenAI shape
            (200, {}, {"data": [{"id": key}]}),  # a listing naming the key; then a refused probe
            (404, {}, echo),
            (200, {}, {"data": []}),  # an answer without choices
            (200, {}, echo),
            (500, {}, echo),  # the run's request: its endpoint goes down, the run stops
        ]
    )
    client = ServerClient([srv.url], api_key_env="MEDUSA_UNIT_KEY", max_retries=0)
    errors = []
    for call in (
        lambda: client.request(srv.url, "/models"),
        lambda: client.request(srv.url, "/models"),
        lambda: check_endpoint(client, srv.url, "m", "chat", probe, [1]),
        lambda: check_endpoint(client, srv.url, "m", "chat", probe, [1]),
        lambda: check_endpoint(client, srv.url, "m", "chat", probe, [1]),
    ):
        with pytest.raises(Exception) as err:  # noqa: PT011 - each its own kind; none may quote the key
            call()
        errors.append(err.value)
    engine = ServerEngine(client, model="m", tokenizer=_Tok(), api="tokens", max_new_tokens=4, eos_ids=[2],
                          end_id=2, concurrency=1)  # fmt: skip
    with caplog.at_level("WARNING", logger="medusa_train.engines.server"):
        with pytest.raises(UserError) as err:
            engine.run([GenRequest(0, [1, 3])], lambda r, new: None)
    errors.append(err.value)
    assert [type(e).__name__ for e in errors] == ["ServerRefused"] + ["ServerUnavailable"] * 2 + [
        "UserError"
    ] + ["ServerUnavailable"] * 2
    assert all(srv.url in str(e) for e in errors)
    quoted = [str(e) for e in errors] + [getattr(e, "detail", "") for e in errors] + [caplog.text]
    quoted += [str(engine.endpoint_counts())]
    escaped = json.dumps(key)[1:-1]
    assert not any(key in text or escaped in text for text in quoted), quoted
    assert "Bearer" in str(errors[0])  # the rest of the text stays


def test_a_status_line_echoing_the_key_is_quoted_without_it(monkeypatch) -> None:
    """What a broken proxy sends instead of a status line is quoted in the last failure, without the key."""
    monkeypatch.setenv("MEDUSA_UNIT_KEY", "sk-unit-secret")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.wfile.write(f"HTTP/1.1 bad {self.headers['Authorization']}\r\n\r\n".encode())

        def log_message(self, *args) -> None:
            pass

    srv = LocalServer(Handler)
    try:
        client = ServerClient([srv.url], api_key_env="MEDUSA_UNIT_KEY", max_retries=0)
        with pytest.raises(ServerUnavailable) as err:
            client.request(srv.url, "/models")
    finally:
        srv.close()
    assert "BadStatusLine: HTTP/1.1 bad Bearer <key>" in str(err.value)


@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("path", ["/models", "/chat/completions", "/completions"])
def test_a_refused_key_says_so_naming_the_option_wherever_it_is_refused(
    monkeypatch, keyed, status, path
) -> None:
    """HTTP 401/403 to any request of the check or the run says the key is missing (no
    distill.server.api_key_env) or refused: it read "refused the API key" without a key, "does not
    take a token-id prompt" from the api=tokens probe and "refused a request" in the run."""
    monkeypatch.setenv("MEDUSA_UNIT_KEY", "sk-unit-secret")
    url = "http://gpu0:8000/v1"
    tokens_ok = {"model": "m", "choices": [{"token_ids": [5, 2], "finish_reason": "stop"}]}
    answers = {"/models": {"data": [{"id": "m"}]}, "/chat/completions": _CHAT_OK, "/completions": tokens_ok}
    answers[path] = ServerRefused(url, status, "invalid API key")
    client = _FakeClient(answers, api_key_env="MEDUSA_UNIT_KEY" if keyed else None)
    expected = "refused the API key" if keyed else "needs an API key"
    with pytest.raises(UserError, match=f"server {url} {expected}.*distill.server.api_key_env") as err:
        check_endpoint(client, url, "m", "tokens", [{"role": "user", "content": "hi"}], [1])
    assert f"HTTP {status}" in str(err.value) and "\n" not in str(err.value)
    if path == "/completions":
        engine = ServerEngine(client, model="m", tokenizer=_Tok(), api="tokens", max_new_tokens=4,
                              eos_ids=[2], end_id=2, concurrency=1)  # fmt: skip
        with pytest.raises(UserError, match=f"server {url} {expected}.*distill.server.api_key_env"):
            engine.run([GenRequest(0, [1, 3])], lambda r, new: None)
