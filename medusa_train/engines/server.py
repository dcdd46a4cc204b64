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
  SGLang, TGI, ``transformers serve``). The reply is re-tokenised with our tokenizer; the record's
  tokens are those ids plus the turn's EOS when the server reports ``finish_reason="stop"``. That is
  also exactly what the server sees of its own reply in the next turn, since it re-renders the
  conversation from text. Exactness is checked three ways and counted (``stats``):
  ``not_round_trip`` (our re-tokenisation does not decode back to the server's text: the reply is
  dropped and the conversation ends before it, see :func:`~medusa_train.data.regenerate.distill_records`),
  ``token_count_differs`` (the server's ``usage.completion_tokens`` differs from the re-tokenised
  count: the model generated a non-canonical split of the same text, e.g. ``th|e`` for ``the``,
  which the record cannot know; the text is kept) and ``prompt_tokens_differ`` (the server's
  ``usage.prompt_tokens`` differs from our context length: its template or tokenizer is not ours).
- ``tokens``: ``POST {url}/completions`` with our exact token-id context as the prompt and the
  generated ids returned (vLLM: ``return_token_ids``, or ``logprobs`` with
  ``return_tokens_as_token_ids``, whose tokens read ``token_id:N``). Token-exact; vLLM only.

HTTP is the standard library (``urllib``, one thread per request in flight): retries with
exponential backoff and jitter on connection errors, timeouts, HTTP 408/429/5xx (``Retry-After``
honoured), then one :class:`~medusa_train.errors.UserError` line naming the URL. The API key is read
from the environment variable named by the caller and sent as ``Authorization: Bearer``; it is never
returned, logged or stored.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any

from medusa_train.engines.base import GenRequest
from medusa_train.errors import UserError

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
"""HTTP answers worth another try: timeouts, rate limits, overloaded or restarting servers."""


class ServerRefused(Exception):
    """A non-retryable HTTP answer (4xx): the request itself is wrong for this server."""

    def __init__(self, url: str, status: int, detail: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {detail}")
        self.url, self.status, self.detail = url, status, detail


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
        UserError: ``api_key_env`` names a variable that is not set.
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
            key = os.environ.get(api_key_env)
            if not key:
                raise UserError(
                    f"distill.server.api_key_env={api_key_env} but the environment variable {api_key_env} "
                    "is not set: export it (the key is read from there, never from the config)"
                )
            self._key = key
        self._lock = threading.Lock()

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
    ) -> dict:
        """GET (``body`` None) or POST JSON to ``url + path``; the decoded JSON answer.

        Raises:
            ServerRefused: an HTTP status outside ``retry_statuses`` and not 2xx.
            UserError: still failing after ``max_retries`` retries (one line naming the URL).
        """
        data = None if body is None else json.dumps(body).encode()
        start = time.monotonic()
        last = ""
        for attempt in range(self.max_retries + 1):
            retry_after = None
            req = urllib.request.Request(
                url + path, data=data, headers=self._headers(), method="GET" if body is None else "POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as err:
                detail = _one_line(err.read().decode(errors="replace"))
                if err.code not in retry_statuses:
                    raise ServerRefused(url, err.code, detail) from None
                last, retry_after = f"HTTP {err.code}: {detail}", err.headers.get("Retry-After")
            except (urllib.error.URLError, OSError, http.client.HTTPException, json.JSONDecodeError) as err:
                reason = getattr(err, "reason", None) or err
                last = _one_line(f"{type(err).__name__}: {reason}")
            if attempt < self.max_retries:
                with self._lock:
                    self.retries += 1
                self._sleep(self._delay(attempt, retry_after))
        raise UserError(
            f"server {url} did not answer after {self.max_retries + 1} attempts over "
            f"{time.monotonic() - start:.0f} s (last: {last}): start it or fix distill.server.urls, then "
            "run the same command again (finished shards are kept)"
        )


def check_server(
    client: ServerClient, model: str, api: str, probe_messages: list[dict], probe_ids: list[int]
) -> dict:
    """Before any work: every endpoint answers, serves ``model`` and (``api=tokens``) returns token ids.

    Each endpoint gets ``GET /models`` (its listing, where it has one: ``transformers serve`` lists
    its hub cache, not a model it was started on) and a one-token probe request for ``model``.

    Returns:
        ``{"model": model, "api": api, "endpoints": [{"url", "model_id", "root"}, ...]}`` where
        ``model_id`` is the name the server answers with and ``root`` the listing's ``root`` (vLLM:
        the checkpoint the name stands for) or ``id``.

    Raises:
        UserError: unreachable URL (after the retry budget), wrong model name, refused key,
            no token ids from an ``api=tokens`` server, or endpoints serving different models.
    """
    endpoints = []
    for url in client.urls:
        listed: list[dict] = []
        try:
            answer = client.request(url, "/models", retry_statuses=frozenset({408, 429, 502, 503, 504}))
            listed = (
                [m for m in answer.get("data", []) if isinstance(m, dict)] if isinstance(answer, dict) else []
            )
        except ServerRefused as err:
            if err.status in (401, 403):
                raise UserError(
                    f"server {url} refused the API key (HTTP {err.status}): check distill.server.api_key_env"
                ) from None
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
                raise UserError(
                    f"server {url} refused the API key (HTTP {err.status}): check distill.server.api_key_env"
                ) from None
            names = ", ".join(str(m.get("id")) for m in listed) or "none listed"
            raise UserError(
                f"server {url} does not take model {model!r} (it lists: {names}): set distill.server.model "
                f"[HTTP {err.status}: {_one_line(err.detail, 120)}]"
            ) from None
        if api == "tokens":
            try:
                body = {**probe, "prompt": probe_ids, **_TOKEN_ID_FIELDS}
                ids = _completion_ids(client.request(url, "/completions", body)["choices"][0])
            except ServerRefused as err:
                raise UserError(
                    f"server {url} does not take a token-id prompt (HTTP {err.status}: "
                    f"{_one_line(err.detail, 120)}): api=tokens is for vLLM; use distill.server.api=chat"
                ) from None
            except (KeyError, IndexError, TypeError):
                ids = None
            if ids is None:
                raise UserError(
                    f"server {url} returned no token ids (needs vLLM's return_token_ids or "
                    "return_tokens_as_token_ids): use distill.server.api=chat"
                )
        endpoints.append(
            {
                "url": url,
                "model_id": str(answer.get("model", model)),
                "root": str(
                    (entry or {}).get("root") or (entry or {}).get("id") or answer.get("model", model)
                ),
            }
        )
    roots = {e["root"] for e in endpoints}
    if len(roots) > 1:
        raise UserError(
            f"distill.server.urls serve different models ({', '.join(sorted(roots))}): use one model"
        )
    return {"model": model, "api": api, "endpoints": endpoints}


_TOKEN_ID_FIELDS = {"logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True}
"""vLLM extras: generated ids as ``choices[0].token_ids`` (newer) or ``logprobs.tokens`` = ``token_id:N``."""


def _completion_ids(choice: dict) -> list[int] | None:
    """Generated token ids of a vLLM completions choice, or None when the server gives none."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return [int(i) for i in ids]
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if isinstance(tokens, list) and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t.split(":", 1)[1]) for t in tokens]
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


@dataclass
class _Reply:
    ids: list[int] | None
    counts: dict[str, int] = field(default_factory=dict)


class ServerEngine:
    """Generates :class:`GenRequest` replies on OpenAI-compatible servers; ``run`` as ``ContinuousBatcher.run``.

    Up to ``concurrency`` requests are in flight per endpoint (the server batches them); a new
    request goes to the least busy endpoint; a conversation's next turn is queued ahead of
    conversations not started yet. ``on_done`` is called on the calling thread, with the reply's
    token ids, or None when the reply cannot be tokenised exactly (``api=chat``, see the module
    docstring); the caller then ends that conversation.

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
        concurrency: requests in flight per endpoint.
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
        concurrency: int = 8,
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
        self.endpoints = [_Endpoint(u) for u in client.urls]
        self.concurrency = concurrency
        self.stats = {"replies": 0, "not_round_trip": 0, "token_count_differs": 0, "prompt_tokens_differ": 0}
        """Replies received, and the exactness counts of the module docstring (``api=chat``)."""

    # -- requests ---------------------------------------------------------------------------------

    def _sampling(self, request: GenRequest) -> dict[str, Any]:
        if self.temperature <= 0:
            return {"temperature": 0.0}
        out: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p}
        if request.seed is not None:  # per record and turn; honoured per request by vLLM, SGLang and TGI
            out["seed"] = request.seed % (1 << 31)
        return out

    def _generate(self, endpoint: _Endpoint, request: GenRequest) -> _Reply:
        if self.api == "tokens":
            body = {
                "model": self.model,
                "prompt": request.context,
                "max_tokens": self.max_new_tokens,
                "stop_token_ids": self.eos_ids,
                **self._sampling(request),
                **_TOKEN_ID_FIELDS,
            }
            answer = self._post(endpoint.url, "/completions", body)
            return self._tokens_reply(endpoint.url, answer)
        body = {
            "model": self.model,
            "messages": request.messages,
            "max_tokens": self.max_new_tokens,
            **self._sampling(request),
        }
        answer = self._post(endpoint.url, "/chat/completions", body)
        return self._chat_reply(answer, len(request.context))

    def _post(self, url: str, path: str, body: dict) -> dict:
        try:
            return self.client.request(url, path, body)
        except ServerRefused as err:
            raise UserError(
                f"server {url} refused a request (HTTP {err.status}: {_one_line(err.detail)})"
            ) from None

    def _tokens_reply(self, url: str, answer: dict) -> _Reply:
        choice = answer["choices"][0]
        ids = _completion_ids(choice)
        if ids is None:
            raise UserError(f"server {url} returned no token ids: use distill.server.api=chat")
        eos = set(self.eos_ids)
        end = next((i + 1 for i, t in enumerate(ids) if t in eos), None)
        if end is not None:
            ids = ids[:end]
        elif choice.get("finish_reason") == "stop":  # stopped on EOS without listing it
            ids.append(self.end_id)
        return _Reply(ids[: self.max_new_tokens])

    def _chat_reply(self, answer: dict, context_len: int) -> _Reply:
        choice = answer["choices"][0]
        text = (choice.get("message") or {}).get("content") or ""
        usage = answer.get("usage") or {}
        generated, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        counts = {"prompt_tokens_differ": int(prompt is not None and prompt != context_len)}
        if self.tokenizer.decode(ids) != text:
            return _Reply(None, {**counts, "not_round_trip": 1})
        finish = choice.get("finish_reason")
        # `transformers serve` reports "length" whenever the cap is reached, also when the last token
        # was the EOS (absent from the text): then the server counted one token more than the text has.
        ended = finish == "stop" or (
            finish == "length" and generated == len(ids) + 1 and len(ids) + 1 <= self.max_new_tokens
        )
        if ended:
            ids.append(self.end_id)
        counts["token_count_differs"] = int(generated is not None and generated != len(ids))
        return _Reply(ids, counts)

    # -- the loop ---------------------------------------------------------------------------------

    def run(
        self, requests: list[GenRequest], on_done: Callable[[GenRequest, list[int] | None], GenRequest | None]
    ) -> None:
        """Generate every request; ``on_done(request, ids)`` may return a follow-up request (queued first).

        Each request in flight is a daemon thread doing blocking HTTP; results come back through a
        queue, so ``on_done`` runs here. A failure (server down after the retry budget, a refused
        request) stops the run at once: requests still in flight are abandoned, not waited for.
        """
        queue = deque(requests)
        capacity = self.concurrency * len(self.endpoints)
        results: SimpleQueue = SimpleQueue()
        running = 0

        def work(endpoint: _Endpoint, request: GenRequest) -> None:
            try:
                results.put((endpoint, request, self._generate(endpoint, request), None))
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread, re-raised there
                results.put((endpoint, request, None, err))

        while queue or running:
            while queue and running < capacity:
                endpoint = min(self.endpoints, key=lambda e: e.in_flight)
                endpoint.in_flight += 1
                running += 1
                threading.Thread(target=work, args=(endpoint, queue.popleft()), daemon=True).start()
            endpoint, request, reply, err = results.get()
            endpoint.in_flight -= 1
            running -= 1
            if err is not None:
                raise err
            self.stats["replies"] += 1
            for key, value in reply.counts.items():
                self.stats[key] += value
            follow = on_done(request, reply.ids)
            if follow is not None:
                queue.appendleft(follow)
