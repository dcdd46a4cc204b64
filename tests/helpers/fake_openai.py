"""A stand-in OpenAI-compatible server (standard library only) for the failover tests and the fault sweep.

Its replies depend only on the request (the messages' text or the token-id prompt), never on which
server answered or when, so a run spread over several of them must give exactly the records of a run
on one. Faults on demand: a required API key (401), only one model name (404 otherwise), the first N
generation requests answered 429 or 5xx, answers that are not JSON, and stopping after K answers
(``dead_after``: every later request has its connection dropped, as from a crashed replica).

Run as (the fault sweep starts it so, to kill it with a signal)::

    python -m tests.helpers.fake_openai --port 8000 [--model NAME] [--key KEY] [--exit-after K] ...

``--exit-after K`` ends the process after its K-th answer (connections are then refused); ``--fail-from N
--fail-first M`` answers M requests 429 once N have been answered.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler

from tests.helpers.local_server import LocalServer

EOS_ID = 2
"""What ``/completions`` ends a token-id reply with (``finish_reason=stop``)."""


def _digest(payload) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).digest()[:8], "big")


def chat_reply(messages: list[dict], max_tokens: int) -> str:
    """1-6 words of the conversation's own text, chosen by its hash (so the tokenizer knows them)."""
    text = " ".join(str(m.get("content") or "") for m in messages)
    words = [w for w in text.split() if w.isalpha()] or ["ok"]
    h = _digest(messages)
    n = min(1 + h % 6, max(1, max_tokens))
    return " ".join(words[(h >> (8 * i)) % len(words)] for i in range(n))


def token_reply(prompt: list[int], max_tokens: int, vocab: int = 50) -> list[int]:
    """1-5 ids in [3, 3 + vocab), then EOS, chosen by the prompt's hash; cut at ``max_tokens``."""
    h = _digest(prompt)
    ids = [3 + (h >> (8 * i)) % vocab for i in range(1 + h % 5)] + [EOS_ID]
    return ids[:max_tokens]


class FakeOpenAI(LocalServer):
    """The server on 127.0.0.1 (``port`` 0 = a free one), serving in a daemon thread.

    Args:
        model: the one model name it serves (``/v1/models`` lists it with ``root``).
        key: the API key it requires as ``Authorization: Bearer``; None = none.
        fail_first: how many generation requests get ``fail_status`` (with ``Retry-After: 0``) once
            ``fail_from`` have been answered.
        fail_from: generation answers before that storm.
        fail_status: that status (429: a rate-limit storm; 503: overloaded).
        garbage: every answer is a 200 whose body is not JSON.
        dead_after: after this many generation answers, every request has its connection dropped.
        exit_after: after this many generation answers, the whole process exits (``os._exit``).
        delay_s: seconds each generation answer takes (a slower replica).
        poison: what makes a generation request fail with HTTP 500, every time, after
            ``poison_delay_s`` (a context that crashes the server): a token id its ``prompt`` holds
            (``api=tokens``), or text one of its messages holds (``api=chat``).
        apart: text one of a chat request's messages holds that makes its reply carry a
            ``reasoning_content`` (a server's reasoning parser): the client drops that reply.

    Attributes:
        answered: generation requests answered with a reply so far.
        poisoned: generation requests failed for holding ``poison``.
        requests: every request that came in, as ``(method, path)``.
    """

    def __init__(
        self,
        model: str = "fake",
        *,
        port: int = 0,
        root: str | None = None,
        key: str | None = None,
        fail_first: int = 0,
        fail_from: int = 0,
        fail_status: int = 429,
        garbage: bool = False,
        dead_after: int | None = None,
        exit_after: int | None = None,
        delay_s: float = 0.0,
        poison: int | str | None = None,
        poison_delay_s: float = 0.0,
        apart: str | None = None,
    ) -> None:
        self.model, self.root, self.key = model, root or model, key
        self.fail_first, self.fail_status, self.garbage = fail_first, fail_status, garbage
        self.fail_from = fail_from
        self.dead_after, self.exit_after, self.delay_s = dead_after, exit_after, delay_s
        self.poison, self.poison_delay_s, self.poisoned = poison, poison_delay_s, 0
        self.apart = apart
        self.answered = 0
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, payload, headers: dict | None = None) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                status, payload, headers, after = owner.answer(
                    self.command, self.path, self.headers.get("Authorization"), body
                )
                if status is None:  # dead: drop the connection without a word
                    self.close_connection = True
                    return
                if self.command == "POST" and status == 200 and owner.delay_s:
                    time.sleep(owner.delay_s)
                if status == 500 and owner.poison_delay_s:
                    time.sleep(owner.poison_delay_s)
                self._send(status, payload, headers)
                self.wfile.flush()
                if after is not None:
                    after()

            do_GET = do_POST = _handle

            def log_message(self, *args) -> None:
                pass

        super().__init__(Handler, port, daemon_threads=True)

    def answer(self, method: str, path: str, auth: str | None, body: dict | None):
        """``(status or None to drop, payload, headers, then)`` for one request."""
        with self._lock:
            self.requests.append((method, path))
            if self.dead_after is not None and self.answered >= self.dead_after:
                return None, None, None, None
            if self.key is not None and auth != f"Bearer {self.key}":
                return 401, {"error": {"message": "invalid API key", "code": 401}}, None, None
            if method == "GET":
                if not path.rstrip("/").endswith("/v1/models"):
                    return 404, {"detail": "Not Found"}, None, None
                return 200, {"object": "list", "data": [{"id": self.model, "root": self.root}]}, None, None
            if not path.endswith(("/v1/chat/completions", "/v1/completions")) or not isinstance(body, dict):
                return 404, {"detail": "Not Found"}, None, None
            if body.get("model") != self.model:
                message = f"The model `{body.get('model')}` does not exist."
                return 404, {"error": {"message": message, "code": 404}}, None, None
            texts = [str(m.get("content")) for m in body.get("messages") or []]
            if (
                self.poison in (body.get("prompt") or [])
                if isinstance(self.poison, int)
                else self.poison is not None and any(self.poison in t for t in texts)
            ):
                self.poisoned += 1
                return 500, {"error": {"message": "CUDA error: device-side assert triggered"}}, None, None
            if self.fail_first > 0 and self.answered >= self.fail_from:
                self.fail_first -= 1
                return self.fail_status, {"error": {"message": "slow down"}}, {"Retry-After": "0"}, None
            if self.garbage:
                return 200, b"<html>502 Bad Gateway</html>", None, None
            max_tokens = int(body.get("max_tokens") or 16)
            if path.endswith("/chat/completions"):
                text = chat_reply(body["messages"], max_tokens)
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
                if self.apart is not None and any(self.apart in t for t in texts):
                    choice["message"]["reasoning_content"] = "let me think"
            else:
                ids = token_reply(list(body["prompt"]), max_tokens)
                finish = "stop" if ids[-1] == EOS_ID else "length"
                choice = {"index": 0, "text": "", "token_ids": ids, "finish_reason": finish}
            self.answered += 1
            then = None
            if self.exit_after is not None and self.answered >= self.exit_after:
                then = lambda: os._exit(0)  # noqa: E731 - after the answer is on its way
            return 200, {"model": self.model, "object": "chat.completion", "choices": [choice]}, None, then


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="fake")
    ap.add_argument("--root", default=None)
    ap.add_argument("--key", default=None)
    ap.add_argument("--fail-first", type=int, default=0)
    ap.add_argument("--fail-from", type=int, default=0)
    ap.add_argument("--fail-status", type=int, default=429)
    ap.add_argument("--garbage", action="store_true")
    ap.add_argument("--exit-after", type=int, default=None)
    args = ap.parse_args(argv)
    server = FakeOpenAI(
        args.model,
        port=args.port,
        root=args.root,
        key=args.key,
        fail_first=args.fail_first,
        fail_from=args.fail_from,
        fail_status=args.fail_status,
        garbage=args.garbage,
        exit_after=args.exit_after,
    )
    server._thread.join()


if __name__ == "__main__":
    main()
