"""OpenAI-compatible inference servers as the generation engine of self-distillation.

Every peer regenerates its training data through a serving engine: FasterDecoding/Medusa
(``create_data.py``: vLLM servers on ports 8000-8009, chat mode replaying each human turn), NVIDIA
ModelOpt (vLLM), SpecForge (several SGLang servers), ``speculators`` (vLLM). This module is that
engine for :func:`medusa_train.data.regenerate.distill_records`: it implements the same ``run(requests,
on_done)`` contract (:class:`medusa_train.engines.base.Engine`) as the in-process
:class:`~medusa_train.engines.inprocess.ContinuousBatcher`, so
the multi-turn loop, the records and the shards do not depend on which engine made them.

Two request kinds (``api``):

- ``chat``: ``POST {url}/chat/completions`` with the conversation so far as messages; the server
  applies the chat template, generates, and returns TEXT (every OpenAI-compatible server: vLLM,
  SGLang, TGI, ``transformers serve``). The reply is re-tokenised with our tokenizer, as plain text
  (a special-token string in it, such as ``<|im_end|>`` the model wrote as text, is no special id; an
  added token that is not special, Qwen's ``<think>``, is its id: :func:`~medusa_train.data.chat.text_ids`);
  the record's tokens are those ids plus the turn's EOS when the server reports
  ``finish_reason="stop"``. That is also what the server sees of its own reply in the next turn,
  since it re-renders the conversation from text (but for such a string, which a server's template
  rendering turns into the special id: ``prompt_tokens_differ`` then counts it). Exactness is
  checked four ways and counted (``stats``):
  ``not_round_trip`` (our re-tokenisation does not decode back to the server's text: the reply is
  dropped and the conversation ends before it, see :func:`~medusa_train.data.regenerate.distill_records`),
  ``split_by_server`` (the server parsed part of the reply out of its text, :data:`PARSED_APART`: a
  reasoning parser's ``<think>`` block, tool calls; the text is not the reply: dropped the same way),
  ``token_count_differs`` (the server's ``usage.completion_tokens`` differs from the re-tokenised
  count: the model generated a non-canonical split of the same text, e.g. ``th|e`` for ``the``, or
  the server returned less text than the model generated, e.g. ``transformers serve`` strips the
  whitespace around a Qwen-family reply; the record cannot know which, the text is kept) and
  ``prompt_tokens_differ`` (the server's ``usage.prompt_tokens`` differs from our context length:
  its template or tokenizer is not ours).
- ``tokens``: ``POST {url}/completions`` with our exact token-id context as the prompt and the
  generated ids returned (vLLM: ``return_token_ids``, or ``logprobs`` with
  ``return_tokens_as_token_ids``, whose tokens read ``token_id:N``). Token-exact; vLLM only.

HTTP is the standard library (``urllib``, one thread per request in flight): retries with
exponential backoff and jitter on connection errors, timeouts, HTTP 408/424/425/429/500/502/503/504
(:data:`RETRY_STATUSES`; ``Retry-After`` honoured), unparsable answers. The API key is read from the
environment variable named by the caller and sent as ``Authorization: Bearer``; it is never returned,
logged or stored, and server text quoted in a message or a log has it replaced
(:meth:`ServerClient.quote`: a proxy may echo the header).

Failover between endpoints (a fleet of replicas, one of which restarts): an endpoint whose request
still fails after the retry budget (:class:`ServerUnavailable`), or that answers in a shape no
OpenAI-compatible server uses, is marked down with the reason; its requests in flight are abandoned
(a late answer is discarded) and, with every later request, go to the endpoints still up, so each
request gets exactly one reply. After ``readmit_after_s`` a down endpoint is probed with one
``GET /models`` (an endpoint that was already down before any work gets :func:`check_endpoint`'s full
check instead) and rejoins when it answers. The run stops with one line naming every URL and why it
is down only when all of them are. A refused request (any other HTTP error: a 4xx such as a bad key,
an unknown model, a bad request, or a 501/505) is the same on every endpoint, so it is no reason to
fail over: it stops the run at once.
A request that fails after the retry budget on an endpoint that answered other requests meanwhile
is what fails, not the endpoint (a context that crashes the server every time would otherwise take
every endpoint down in turn, and again on every resume): the endpoint stays up and the request is
sent again; when it fails again on an endpoint that answered others meanwhile or answers a probe
(``GET /models``) then, it is given up after :data:`UNDELIVERABLE_AFTER` failures in all, its reply
dropped and counted (``undeliverable``).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue
from typing import Any

from medusa_train.data.chat import text_ids
from medusa_train.engines.base import GenRequest
from medusa_train.errors import UserError

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 424, 425, 429, 500, 502, 503, 504})
"""HTTP answers worth another try: timeouts, rate limits, overloaded or restarting servers, and TGI's
424 (a generation error such as running out of GPU memory in one batch)."""


PROBE_STATUSES = frozenset({408, 429, 502, 503, 504})
"""HTTP answers to ``GET /models`` (the endpoint check, the re-admission probe) that mean "not up
yet"; any other answer means the server is up (a listing's other 4xx/500 is no reason to wait)."""


class ServerRefused(Exception):
    """A non-retryable HTTP error (not in :data:`RETRY_STATUSES`: a 4xx, 501, 505, ...): the request itself
    is wrong for this server."""

    def __init__(self, url: str, status: int, detail: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {detail}")
        self.url, self.status, self.detail = url, status, detail


class ServerUnavailable(UserError):
    """An endpoint that still fails after the retry budget (nothing listening, timeouts, 5xx, answers
    that are not JSON) or that answered in a shape no OpenAI-compatible server uses.

    Attributes:
        url: the endpoint.
        reason: one line naming the URL and what went wrong, without advice (the failover's record).
    """

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(
            f"{reason}: start it or fix distill.server.urls, then run the same command again (it resumes "
            "where it stopped: finished shards are kept)"
        )
        self.url, self.reason = url, reason


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class ServerClient:
    """JSON over HTTP to one or more OpenAI-compatible base URLs, with retries.

    Args:
        urls: base URLs ending in ``/v1``.
        api_key_env: name of the environment variable holding the API key; None = no key.
        timeout_s: seconds one attempt may take.
        max_retries: further attempts after a retryable failure.
        backoff_s: first delay; delay ``i`` is ``min(backoff_max_s, backoff_s * 2**i)`` times a
            uniform jitter factor in [0.5, 1].
        backoff_max_s: cap of one delay (also of a server's ``Retry-After``).
        sleep: the sleep function (tests replace it).

    Raises:
        UserError: ``api_key_env`` names a variable that is not set, or holds what no header carries
            (whitespace around the key is dropped).
    """

    def __init__(
        self,
        urls: list[str],
        *,
        api_key_env: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 6,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._sleep = sleep
        self._rng = random.Random()
        self.retries = 0
        """Retries made so far (all endpoints)."""
        self._key: str | None = None
        if api_key_env:
            # A key read from a file (a mounted secret) often ends in a newline, which no header carries
            key = (os.environ.get(api_key_env) or "").strip()
            if not key:
                raise UserError(
                    f"distill.server.api_key_env={api_key_env} but the environment variable {api_key_env} "
                    "is not set: export it (the key is read from there, never from the config)"
                )
            if not (key.isascii() and key.isprintable()):  # http.client would refuse it, quoting it
                raise UserError(
                    f"the environment variable {api_key_env} (distill.server.api_key_env) holds characters "
                    "an HTTP header cannot carry (a line break, a control or non-ASCII character): set it "
                    "to the key alone"
                )
            self._key = key
        self._lock = threading.Lock()

    @property
    def has_key(self) -> bool:
        """Whether requests carry an API key."""
        return self._key is not None

    def quote(self, text: str, limit: int = 200) -> str:
        """``text`` from a server as one line of at most ``limit`` characters, for a message or a log,
        with the API key (also as JSON escapes it) replaced by ``<key>``: a proxy may echo the
        ``Authorization`` header. Every quote of server text goes through here."""
        text = str(text)
        if self._key:
            for form in {self._key, json.dumps(self._key)[1:-1]}:
                text = text.replace(form, "<key>")
        return _one_line(text, limit)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        return headers

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        delay = min(self.backoff_max_s, self.backoff_s * 2**attempt) * self._rng.uniform(0.5, 1.0)
        if retry_after and retry_after.strip().isdigit():
            delay = max(delay, min(float(retry_after), self.backoff_max_s))
        return delay

    def request(
        self,
        url: str,
        path: str,
        body: dict | None = None,
        *,
        retry_statuses: frozenset[int] = RETRY_STATUSES,
        max_retries: int | None = None,
        timeout_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> dict:
        """GET (``body`` None) or POST JSON to ``url + path``; the decoded JSON answer.

        Args:
            max_retries, timeout_s: this request's own budget (default: the client's).
            stop: set by the caller when it no longer wants the answer: no further attempt is made.

        Raises:
            ServerRefused: an HTTP status outside ``retry_statuses`` and not 2xx.
            ServerUnavailable: still failing after the retries (a one-line UserError naming the URL).
        """
        data = None if body is None else json.dumps(body).encode()
        retries = self.max_retries if max_retries is None else max_retries
        start = time.monotonic()
        last = ""
        attempts = 0
        answered = False  # the last attempt got an answer that is no JSON
        for attempt in range(retries + 1):
            if stop is not None and stop.is_set():
                break
            attempts += 1
            retry_after = None
            req = urllib.request.Request(
                url + path, data=data, headers=self._headers(), method="GET" if body is None else "POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as err:
                try:
                    detail = self.quote(err.read().decode(errors="replace"))
                except (OSError, http.client.HTTPException):  # the connection broke while reading it
                    detail = "(no readable body)"
                if err.code not in retry_statuses:
                    raise ServerRefused(url, err.code, detail) from None
                last, retry_after = f"HTTP {err.code}: {detail}", err.headers.get("Retry-After")
                answered = False
            except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:
                # ValueError: an answer that is not JSON, or not even UTF-8 (a proxy's gzip or HTML page)
                reason = getattr(err, "reason", None) or err
                last = self.quote(f"{type(err).__name__}: {reason}")  # a status line the server sent
                answered = isinstance(err, ValueError)
            if attempt < retries and not (stop is not None and stop.is_set()):
                with self._lock:
                    self.retries += 1
                self._sleep(self._delay(attempt, retry_after))
        tries = f"{attempts} attempt{'s' * (attempts != 1)} over {time.monotonic() - start:.0f} s"
        if answered:  # it answers, but not as an OpenAI-compatible API: not a server to start
            raise ServerUnavailable(
                url,
                f"server {url} answered {tries} with no JSON (last: {last}): is it the OpenAI-compatible "
                "base URL, ending in /v1? (a proxy's or login page answers HTML)",
            )
        raise ServerUnavailable(
            url, f"server {url} did not answer after {tries} (last: {last or 'abandoned'})"
        )


def _key_error(client: ServerClient, err: ServerRefused) -> UserError:
    """The one line for HTTP 401/403: the server wants a key and none is sent, or refuses the one sent."""
    what = f"HTTP {err.status}: {_one_line(err.detail, 120)}"
    if client.has_key:
        return UserError(
            f"server {err.url} refused the API key ({what}): check that distill.server.api_key_env names "
            "the variable holding the key it takes"
        )
    return UserError(
        f"server {err.url} needs an API key ({what}): export it in an environment variable and name "
        "that in distill.server.api_key_env"
    )


def check_endpoint(
    client: ServerClient,
    url: str,
    model: str,
    api: str,
    probe_messages: list[dict],
    probe_ids: list[int],
    *,
    roots: set[str] | None = None,
) -> dict:
    """One endpoint answers, serves ``model`` and (``api=tokens``) returns token ids.

    It gets ``GET /models`` (its listing, where it has one: ``transformers serve`` lists its hub
    cache, not a model it was started on) and a one-token probe request for ``model``.

    Args:
        roots: the checkpoints the other endpoints serve; None = do not compare.

    Returns:
        ``{"url", "model_id", "root"}``: ``model_id`` is the name the server answers with and ``root``
        the listing's ``root`` (vLLM: the checkpoint the name stands for) or ``id``.

    Raises:
        ServerUnavailable: unreachable (after the retry budget) or answering in no OpenAI shape.
        UserError: wrong model name, refused key, no ``/v1`` API, no token ids from an ``api=tokens``
            server, or another model than ``roots``.
    """
    listed: list[dict] = []
    try:
        listed = _listing(client, url, client.request(url, "/models", retry_statuses=PROBE_STATUSES))
    except ServerRefused as err:
        if err.status in (401, 403):
            raise _key_error(client, err) from None
        if err.status == 404:
            raise UserError(
                f"no OpenAI-compatible API at {url} (GET {url}/models: HTTP 404): the URL must end in /v1"
            ) from None
        # other 4xx/500 on the listing (e.g. `transformers serve` without a hub cache): rely on the probe
    entry = next((m for m in listed if m.get("id") == model), None)
    probe = {"model": model, "max_tokens": 1, "temperature": 0.0}
    try:
        answer = client.request(url, "/chat/completions", {**probe, "messages": probe_messages})
    except ServerRefused as err:
        if err.status in (401, 403):
            raise _key_error(client, err) from None
        names = client.quote(", ".join(m["id"] for m in listed) or "none listed")
        raise UserError(
            f"server {url} does not take model {model!r} (it lists: {names}): set distill.server.model "
            f"[HTTP {err.status}: {_one_line(err.detail, 120)}]"
        ) from None
    _first_choice(client, url, answer, "message")
    if api == "tokens":
        try:
            body = {**probe, "prompt": probe_ids, **_TOKEN_ID_FIELDS}
            answer = client.request(url, "/completions", body)
            ids = _completion_ids(url, _first_choice(client, url, answer, None))
        except ServerRefused as err:
            if err.status in (401, 403):
                raise _key_error(client, err) from None
            raise UserError(
                f"server {url} does not take a token-id prompt (HTTP {err.status}: "
                f"{_one_line(err.detail, 120)}): api=tokens is for vLLM; use distill.server.api=chat"
            ) from None
        if ids is None:
            raise UserError(
                f"server {url} returned no token ids (needs vLLM's return_token_ids or "
                "return_tokens_as_token_ids): use distill.server.api=chat"
            )
    served = str(answer.get("model", model))
    root = str((entry or {}).get("root") or (entry or {}).get("id") or served)
    if roots is not None and root not in roots:
        others = client.quote(f"{root}, the other distill.server.urls {', '.join(sorted(roots))}")
        raise UserError(f"server {url} serves {others}: use one model")
    return {"url": url, "model_id": served, "root": root}


def check_server(
    client: ServerClient, model: str, api: str, probe_messages: list[dict], probe_ids: list[int]
) -> dict:
    """Before any work: every endpoint that answers serves ``model`` (:func:`check_endpoint`).

    An endpoint that does not answer (after the retry budget) is left out and reported as down, with a
    warning, as long as another one is up: the engine probes it again later (failover).

    Returns:
        ``{"model": model, "api": api, "endpoints": [{"url", "model_id", "root"}, ...], "down":
        {url: reason}}``; ``endpoints`` holds the endpoints that passed, ``down`` those that did not answer.

    Raises:
        UserError: every endpoint down (one line naming each URL and why), or a user's mistake any
            endpoint reveals (wrong model name, refused key, a URL without ``/v1`` API, no token ids
            from an ``api=tokens`` server, endpoints serving different models).
    """
    endpoints, down = [], {}
    for url in client.urls:
        try:
            endpoints.append(check_endpoint(client, url, model, api, probe_messages, probe_ids))
        except ServerUnavailable as err:
            down[url] = err.reason
    if not endpoints:
        raise all_down_error(down)
    for url, reason in down.items():
        log.warning(
            "distill: %s is down before any work (%s); distilling on the other %d endpoint(s), probing it "
            "again later",
            url,
            reason,
            len(endpoints),
        )
    roots = {e["root"] for e in endpoints}
    if len(roots) > 1:
        served = client.quote(", ".join(sorted(roots)))
        raise UserError(f"distill.server.urls serve different models ({served}): use one model")
    return {"model": model, "api": api, "endpoints": endpoints, "down": down}


def all_down_error(down: dict[str, str]) -> UserError:
    """The one line that ends a run when no endpoint is up: every URL and why it is down."""
    if len(down) == 1:
        url, reason = next(iter(down.items()))
        return ServerUnavailable(url, reason)
    return UserError(
        f"all {len(down)} distill.server.urls are down: {'; '.join(down.values())}: start one or fix "
        "distill.server.urls, then run the same command again (it resumes where it stopped: finished "
        "shards are kept)"
    )


def _first_choice(client: ServerClient, url: str, answer: Any, kind: str | None) -> dict:
    """``answer["choices"][0]`` (with a ``message`` object where ``kind="message"``).

    Raises:
        ServerUnavailable: the answer has no such shape (no OpenAI-compatible server answers so).
    """
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict) or (kind is not None and not isinstance(choice.get(kind), dict)):
        shape = client.quote(json.dumps(answer), 120)
        raise ServerUnavailable(
            url, f"server {url} sent an answer without choices[0]{'.' + kind if kind else ''} ({shape})"
        )
    return choice


def _finish_reason(client: ServerClient, url: str, choice: dict) -> str | None:
    """``choice["finish_reason"]``: a string, or None where the server says none.

    Raises:
        ServerUnavailable: any other value (a list, an object, a number: no OpenAI-compatible server
            sends one).
    """
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        shape = client.quote(json.dumps(finish), 120)
        raise ServerUnavailable(url, f"server {url} sent a finish_reason that is no string ({shape})")
    return finish


def _listing(client: ServerClient, url: str, answer: Any) -> list[dict]:
    """The models of a ``GET /models`` answer: ``data``, a list of objects with a string ``id``; none
    where the answer is an object without ``data`` (then the probe alone decides).

    Raises:
        ServerUnavailable: any other shape (no OpenAI-compatible server answers so).
    """
    if isinstance(answer, dict) and "data" not in answer:
        return []
    listed = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(listed, list) or not all(
        isinstance(m, dict) and isinstance(m.get("id"), str) for m in listed
    ):
        shape = client.quote(json.dumps(answer), 120)
        raise ServerUnavailable(
            url, f"server {url} sent a /models answer that is no list of models ({shape})"
        )
    return listed


_TOKEN_ID_FIELDS = {"logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True}
"""vLLM extras: generated ids as ``choices[0].token_ids`` (newer) or ``logprobs.tokens`` = ``token_id:N``."""


def sampled_generation_config(top_k: int) -> dict[str, str]:
    """The ``generation_config`` field sent with every sampled request (``temperature > 0``).

    ``transformers serve`` samples only when its generation config says ``do_sample``: it takes the
    request's temperature and top_p but keeps the model's ``do_sample``, so a model whose
    ``generation_config.json`` does not set it (base models, e.g. GPT-2, Llama-3-8B) answered every
    sampled request greedily. A request's ``generation_config`` (a JSON string) is its override;
    what it leaves unset still comes from the model's own generation config (repetition penalty, EOS,
    min-p). ``top_k`` is the model's (0: none), which ``transformers serve`` would otherwise replace
    by ``generate``'s default of 50 where the config sets none: so it samples from the distribution
    vLLM and the in-process engine use. vLLM, SGLang and TGI ignore the field (vLLM logs it: at debug
    level in current versions, as a warning per request in older ones)."""
    return {"generation_config": json.dumps({"do_sample": True, "top_k": top_k})}


def _completion_ids(url: str, choice: dict) -> list[int] | None:
    """Generated token ids of a vLLM completions choice, or None when the server gives none.

    Raises:
        ServerUnavailable: ids that are not integers (no OpenAI-compatible server sends them).
    """
    try:
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            return [int(i) for i in ids]
        tokens = (choice.get("logprobs") or {}).get("tokens")
        if isinstance(tokens, list) and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            return [int(t.split(":", 1)[1]) for t in tokens]
    except (TypeError, ValueError, AttributeError):
        raise ServerUnavailable(url, f"server {url} sent token ids that are not integers") from None
    return None


def reply_end_id(tokenizer, eos_ids: list[int]) -> int:
    """The EOS id that closes an assistant turn in the chat template (``<|eot_id|>``, ``<|im_end|>``...).

    A text reply does not say WHICH EOS ended it; the template does: the EOS whose text starts what
    the template puts right after a reply. Falls back to the tokenizer's EOS, else the first id.
    """
    sentinel = "MEDUSAREPLYSENTINEL"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        after = text[text.rfind(sentinel) + len(sentinel) :]
    except Exception:  # noqa: BLE001 - a template that cannot render this: fall back below
        after = ""
    for eos in eos_ids:
        piece = tokenizer.decode([eos])
        if piece and after.startswith(piece):
            return eos
    return tokenizer.eos_token_id if tokenizer.eos_token_id in eos_ids else eos_ids[0]


@dataclass
class _Endpoint:
    url: str
    in_flight: int = 0
    down: str | None = None
    """Why it is down (one line naming the URL); None while it is up."""
    down_since: float = 0.0
    """``time.monotonic()`` when it went down or last failed a probe (``inf``: never probed again)."""
    checked: bool = True
    """It passed :func:`check_endpoint` (False: down since before any work, so never checked)."""
    probing: bool = False
    replies: int = 0
    failures: int = 0
    """Requests that failed there after the retry budget, or were in flight there when it went down."""
    went_down: int = 0


UNDELIVERABLE_AFTER = 2
"""Times a request may fail after the retry budget on an endpoint that answered other requests
meanwhile (so the endpoint works and the request is what fails: a context that crashes the server)
before it is given up: its reply is dropped (``undeliverable``) instead of the endpoint going down."""

PARSED_APART = ("reasoning_content", "reasoning", "thinking", "tool_calls")
"""Fields of a chat reply's ``message`` that hold part of what the model generated, parsed out of
``content`` by the server (vLLM and SGLang with a reasoning parser; ``transformers serve`` parses
Qwen-family replies always): a reply with any of them is not its text (``split_by_server``)."""

FINISHED = frozenset({"stop", "length", None})
"""The ``finish_reason`` of a reply to keep: ended (``stop``), cut at the cap (``length``), or not said.
Any other (vLLM's and SGLang's ``abort``, ``content_filter``, ``tool_calls``) leaves a reply the
model did not finish: it is dropped like a reply that is not token-exact (``unfinished``)."""


@dataclass
class _Reply:
    ids: list[int] | None
    counts: dict[str, int] = field(default_factory=dict)
    text: str | None = None
    """A chat reply's text, still to tokenise (:meth:`ServerEngine._tokenized`, on the calling thread),
    with its ``finish_reason`` and ``usage.completion_tokens``."""
    finish: str | None = None
    generated: int | None = None


class ServerEngine:
    """Generates :class:`GenRequest` replies on OpenAI-compatible servers; ``run`` as ``ContinuousBatcher.run``.

    Up to ``concurrency`` requests are in flight per endpoint (the server batches them); a new
    request goes to the least busy endpoint that is up; a conversation's next turn is queued ahead of
    conversations not started yet. ``on_done`` is called on the calling thread, with the reply's
    token ids, or None when the reply cannot be tokenised exactly (``api=chat``, see the module
    docstring); the caller then ends that conversation. Endpoints fail over as the module docstring
    says; :meth:`endpoint_counts` tells what each one did.

    Args:
        client: the HTTP client (its URLs are the endpoints).
        model: served model name.
        tokenizer: the backbone's tokenizer (the served model's).
        api: ``chat`` or ``tokens``.
        max_new_tokens: cap per reply (``max_tokens``).
        eos_ids: ids that end a turn (sent as vLLM's ``stop_token_ids`` with ``api=tokens``).
        end_id: EOS appended to a text reply the server ended itself (:func:`reply_end_id`).
        temperature: 0 = greedy.
        top_p: nucleus mass when sampling.
        top_k: the model's top-k (0: none), for servers that would apply another one when sampling
            (:func:`sampled_generation_config`).
        concurrency: requests in flight per endpoint.
        down: endpoints already down before any work (``check_server``'s ``down``: url -> reason).
        readmit_after_s: seconds a down endpoint waits before it is probed again.
        check: full check of an endpoint that was down before any work, before it joins
            (:func:`check_endpoint` with the other endpoints' ``roots``); None = the plain probe.
    """

    def __init__(
        self,
        client: ServerClient,
        *,
        model: str,
        tokenizer,
        api: str,
        max_new_tokens: int,
        eos_ids: list[int],
        end_id: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        concurrency: int = 8,
        down: dict[str, str] | None = None,
        readmit_after_s: float = 30.0,
        check: Callable[[str], Any] | None = None,
    ) -> None:
        self.client = client
        self.model = model
        self.tokenizer = tokenizer
        self.api = api
        self.max_new_tokens = max_new_tokens
        self.eos_ids = list(eos_ids)
        self.end_id = end_id
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.endpoints = [_Endpoint(u) for u in client.urls]
        for endpoint in self.endpoints:
            if endpoint.url in (down or {}):
                endpoint.down, endpoint.checked, endpoint.went_down = down[endpoint.url], False, 1
                endpoint.down_since = time.monotonic()
        self.concurrency = concurrency
        self.readmit_after_s = readmit_after_s
        self._check = check
        self._results: SimpleQueue = SimpleQueue()
        """Answers of request and probe threads, of this and earlier ``run`` calls."""
        self._dispatched = 0
        self.stats = {
            "replies": 0,
            "not_round_trip": 0,
            "token_count_differs": 0,
            "prompt_tokens_differ": 0,
            "unfinished": 0,
            "split_by_server": 0,
            "undeliverable": 0,
        }
        """Replies received, the exactness counts of the module docstring (``api=chat``), and the
        requests given up (:data:`UNDELIVERABLE_AFTER`)."""
        self._charges: dict[int, int] = {}
        """Failures charged to a request of the current ``run`` (by ``id``) rather than to its endpoint."""

    # -- requests ---------------------------------------------------------------------------------

    def _sampling(self, request: GenRequest) -> dict[str, Any]:
        if self.temperature <= 0:
            return {"temperature": 0.0}
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            **sampled_generation_config(self.top_k),
        }
        if request.seed is not None:  # per record and turn; honoured per request by vLLM, SGLang and TGI
            out["seed"] = request.seed % (1 << 31)
        return out

    def _generate(self, endpoint: _Endpoint, request: GenRequest, stop: threading.Event) -> _Reply:
        if self.api == "tokens":
            body = {
                "model": self.model,
                "prompt": request.context,
                "max_tokens": self.max_new_tokens,
                "stop_token_ids": self.eos_ids,
                **self._sampling(request),
                **_TOKEN_ID_FIELDS,
            }
            answer = self._post(endpoint.url, "/completions", body, stop)
            return self._tokens_reply(endpoint.url, answer)
        body = {
            "model": self.model,
            "messages": request.messages,
            "max_tokens": self.max_new_tokens,
            **self._sampling(request),
        }
        answer = self._post(endpoint.url, "/chat/completions", body, stop)
        return self._chat_reply(endpoint.url, answer, len(request.context))

    def _post(self, url: str, path: str, body: dict, stop: threading.Event) -> dict:
        try:
            return self.client.request(url, path, body, stop=stop)
        except ServerRefused as err:
            if err.status in (401, 403):
                raise _key_error(self.client, err) from None
            raise UserError(
                f"server {url} refused a request (HTTP {err.status}: {_one_line(err.detail)})"
            ) from None

    def _tokens_reply(self, url: str, answer: dict) -> _Reply:
        choice = _first_choice(self.client, url, answer, None)
        finish = _finish_reason(self.client, url, choice)
        if finish not in FINISHED:
            return _Reply(None, {"unfinished": 1})
        ids = _completion_ids(url, choice)
        if ids is None:
            raise UserError(f"server {url} returned no token ids: use distill.server.api=chat")
        eos = set(self.eos_ids)
        end = next((i + 1 for i, t in enumerate(ids) if t in eos), None)
        if end is not None:
            ids = ids[:end]
        elif finish == "stop":  # stopped on EOS without listing it
            ids.append(self.end_id)
        return _Reply(ids[: self.max_new_tokens])

    def _chat_reply(self, url: str, answer: dict, context_len: int) -> _Reply:
        choice = _first_choice(self.client, url, answer, "message")
        message = choice["message"]
        text = message.get("content") or ""
        if not isinstance(text, str):
            raise ServerUnavailable(
                url, f"server {url} sent a reply that is not text ({type(text).__name__})"
            )
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        generated, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        counts = {"prompt_tokens_differ": int(prompt is not None and prompt != context_len)}
        finish = _finish_reason(self.client, url, choice)
        if finish not in FINISHED:
            return _Reply(None, {**counts, "unfinished": 1})
        if any(message.get(key) for key in PARSED_APART):
            return _Reply(None, {**counts, "split_by_server": 1})
        return _Reply(None, counts, text, finish, generated)

    def _tokenized(self, reply: _Reply) -> _Reply:
        """A chat reply's ids (None when its text does not round-trip) and exactness counts.

        Called on the thread that called :meth:`run`, where the chat renderer uses the same tokenizer:
        ``split_special_tokens`` is state of a fast tokenizer that every call sets, so a call on a
        request thread would race with the renderer's (whose template markup could come out as text).
        """
        text, finish, generated, counts = reply.text, reply.finish, reply.generated, dict(reply.counts)
        # The text is the reply: a special-token string in it (the model wrote "<|im_end|>" as text, which
        # a text API returns as text) is plain text, not a special id (an end of turn inside the reply);
        # an added token that is not special (Qwen's "<think>") is its id, with a slow tokenizer too
        ids = text_ids(self.tokenizer, text)
        if self.tokenizer.decode(ids) != text:
            return _Reply(None, {**counts, "not_round_trip": 1})
        # `transformers serve` reports "length" whenever the cap is reached, also when the last token
        # was the EOS (absent from the text): then it counted one token more than the text has. A
        # reply cut at the cap whose text re-tokenises to one token fewer (a non-canonical split:
        # vLLM, SGLang) looks the same; the record takes the first reading, and the reply is counted
        # in `token_count_differs` either way, since either reading can be wrong.
        eos_at_cap = finish == "length" and generated == self.max_new_tokens == len(ids) + 1
        if finish == "stop" or eos_at_cap:
            ids.append(self.end_id)
        counts["token_count_differs"] = int(eos_at_cap or (generated is not None and generated != len(ids)))
        return _Reply(ids, counts)

    # -- the loop ---------------------------------------------------------------------------------

    def run(
        self, requests: list[GenRequest], on_done: Callable[[GenRequest, list[int] | None], GenRequest | None]
    ) -> None:
        """Generate every request; ``on_done(request, ids)`` may return a follow-up request (queued first).

        Each request in flight is a daemon thread doing blocking HTTP; results come back through a
        queue, so ``on_done`` runs here. An endpoint whose request fails after the retry budget goes
        down and its requests go to the others, unless it answered other requests meanwhile (or, for a
        request that already failed so, answers a probe): then the request is sent again, and given up
        after :data:`UNDELIVERABLE_AFTER` such failures (``on_done(request, None)``; the module
        docstring); the run stops (requests still
        in flight abandoned, not waited for) when every endpoint is down, or at once on a refused
        request (HTTP 4xx) or any other error.

        Raises:
            UserError: every endpoint down (one line naming each URL and why), or a refused request.
        """
        queue = deque(requests)
        self._charges = {}  # by id(): a request with an entry is queued or in flight, so alive
        live: dict[int, tuple[_Endpoint, GenRequest, threading.Event, int]] = {}
        """Requests in flight by dispatch number (with the endpoint's replies when it was sent); an
        answer whose number is not here is discarded."""

        def work(number: int, endpoint: _Endpoint, request: GenRequest, stop: threading.Event) -> None:
            try:
                self._results.put(("reply", number, self._generate(endpoint, request, stop), None))
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread, re-raised there
                self._results.put(("reply", number, None, err))

        while queue or live:
            self._start_probes()
            up = [e for e in self.endpoints if e.down is None]
            if not up:
                raise all_down_error({e.url: e.down or "" for e in self.endpoints})
            while queue:
                endpoint = min(up, key=lambda e: e.in_flight)
                if endpoint.in_flight >= self.concurrency:
                    break
                endpoint.in_flight += 1
                self._dispatched += 1
                stop = threading.Event()
                live[self._dispatched] = (endpoint, queue.popleft(), stop, endpoint.replies)
                threading.Thread(
                    target=work,
                    args=(self._dispatched, endpoint, live[self._dispatched][1], stop),
                    daemon=True,
                ).start()
            try:  # wake up now and then to probe down endpoints whose cool-down is over
                item = self._results.get(timeout=1.0)
            except Empty:
                continue
            if item[0] == "probe":
                self._probed(item[1], item[2])
                continue
            _, number, reply, err = item
            if number not in live:  # abandoned when its endpoint went down: generated elsewhere
                continue
            endpoint, request, _, replies_then = live.pop(number)
            endpoint.in_flight -= 1
            if isinstance(err, ServerUnavailable):
                endpoint.failures += 1
                # It answered others meanwhile, or (for a request already seen failing on a working
                # endpoint) it answers a probe now: the request is what fails.
                if endpoint.replies > replies_then or (
                    id(request) in self._charges and self._answers(endpoint)
                ):
                    if not self._charge(request, endpoint, err.reason):
                        queue.appendleft(request)  # again while other requests still show who works
                        continue
                    self.stats["undeliverable"] += 1
                    follow = on_done(request, None)
                    if follow is not None:
                        queue.appendleft(follow)
                    continue
                queue.appendleft(request)
                self._went_down(endpoint, err.reason, queue, live)
                continue
            if err is not None:
                raise err
            self._charges.pop(id(request), None)
            if reply.text is not None:
                reply = self._tokenized(reply)
            endpoint.replies += 1
            self.stats["replies"] += 1
            for key, value in reply.counts.items():
                self.stats[key] += value
            if reply.counts.get("split_by_server") and self.stats["split_by_server"] == 1:
                log.warning(
                    "distill: %s returns part of a reply apart from its text (%s: a reasoning or "
                    "tool-call parser); such replies are dropped (replies_dropped_split_by_server): use a "
                    "server started without that parser (vLLM, SGLang: no --reasoning-parser), or "
                    "distill.server.api=tokens (vLLM)",
                    endpoint.url,
                    "/".join(PARSED_APART),
                )
            follow = on_done(request, reply.ids)
            if follow is not None:
                queue.appendleft(follow)

    # -- failover ---------------------------------------------------------------------------------

    def _ping(self, endpoint: _Endpoint) -> None:
        """One ``GET /models`` (one attempt, at most 10 s); returns if ``endpoint`` answers.

        Raises:
            ServerUnavailable: it does not, or answers "not up yet" (:data:`PROBE_STATUSES`).
        """
        try:
            self.client.request(
                endpoint.url,
                "/models",
                retry_statuses=PROBE_STATUSES,
                max_retries=0,
                timeout_s=min(self.client.timeout_s, 10.0),
            )
        except ServerRefused:  # it answers (some servers do not list models): it is up
            pass

    def _answers(self, endpoint: _Endpoint) -> bool:
        """Whether ``endpoint`` answers :meth:`_ping` now (blocks for at most 10 s)."""
        try:
            self._ping(endpoint)
        except ServerUnavailable:
            return False
        return True

    def _charge(self, request: GenRequest, endpoint: _Endpoint, reason: str) -> bool:
        """Charge a failure to ``request`` (its endpoint answered other requests while it failed, or a
        probe after); True when that makes :data:`UNDELIVERABLE_AFTER` and the request is given up."""
        charges = self._charges[id(request)] = self._charges.get(id(request), 0) + 1
        if charges < UNDELIVERABLE_AFTER:
            log.warning(
                "distill: request %s failed on %s, which answered other requests meanwhile (%s); "
                "sending it again",
                request.key,
                endpoint.url,
                reason,
            )
            return False
        del self._charges[id(request)]
        log.warning(
            "distill: giving up request %s: it failed %d times on endpoints that answered other requests "
            "or a probe (last: %s); its reply is dropped (counted in replies_dropped_undeliverable)",
            request.key,
            charges,
            reason,
        )
        return True

    def _went_down(self, endpoint: _Endpoint, reason: str, queue: deque, live: dict) -> None:
        """Mark ``endpoint`` down; its requests in flight go back to the front of ``queue``."""
        endpoint.down, endpoint.down_since = reason, time.monotonic()
        endpoint.went_down += 1
        for number in [n for n, (e, *_) in live.items() if e is endpoint]:
            _, request, stop, _ = live.pop(number)
            stop.set()  # no further attempt; an answer still under way is discarded
            endpoint.in_flight -= 1
            endpoint.failures += 1
            queue.appendleft(request)
        up = [e.url for e in self.endpoints if e.down is None]
        if up:  # (with none left the run stops with the reasons: no warning line before the error)
            log.warning(
                "distill: %s is down (%s); its requests go to %s; probing it again in %.0f s",
                endpoint.url,
                reason,
                ", ".join(up),
                self.readmit_after_s,
            )

    def _start_probes(self) -> None:
        """A probe thread for each down endpoint whose cool-down is over (one at a time per endpoint)."""
        now = time.monotonic()
        for endpoint in self.endpoints:
            if endpoint.down is None or endpoint.probing or now - endpoint.down_since < self.readmit_after_s:
                continue
            endpoint.probing = True
            threading.Thread(target=self._probe, args=(endpoint,), daemon=True).start()

    def _probe(self, endpoint: _Endpoint) -> None:
        """Whether ``endpoint`` is back: ``(probe, endpoint, None)`` or ``(..., reason, permanent)``."""
        try:
            if endpoint.checked or self._check is None:
                self._ping(endpoint)
            else:
                self._check(endpoint.url)
            self._results.put(("probe", endpoint, None))
        except ServerUnavailable as err:
            self._results.put(("probe", endpoint, (err.reason, False)))
        except UserError as err:  # up, but unfit (another model, refuses the key): not probed again
            self._results.put(("probe", endpoint, (self.client.quote(str(err)), True)))
        except Exception as err:  # noqa: BLE001 - whatever it is, the endpoint stays down
            self._results.put(("probe", endpoint, (self.client.quote(f"{endpoint.url}: {err!r}"), False)))

    def _probed(self, endpoint: _Endpoint, failed: tuple[str, bool] | None) -> None:
        endpoint.probing = False
        if failed is None:
            endpoint.down, endpoint.checked = None, True
            log.warning("distill: %s is back: requests go to it again", endpoint.url)
            return
        reason, permanent = failed
        endpoint.down = reason
        endpoint.down_since = math.inf if permanent else time.monotonic()
        if permanent:
            log.warning("distill: %s answers but is left out for this run: %s", endpoint.url, reason)

    def endpoint_counts(self) -> list[dict]:
        """Per endpoint: ``url``, ``replies``, ``failures`` (requests that failed there or were moved off
        it), ``went_down`` (times it was marked down, before any work included) and ``down`` (why it
        is down now, or None)."""
        return [
            {
                "url": e.url,
                "replies": e.replies,
                "failures": e.failures,
                "went_down": e.went_down,
                "down": e.down,
            }
            for e in self.endpoints
        ]
