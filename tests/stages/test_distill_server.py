"""stage=distill through a real OpenAI-compatible server (`transformers serve` on 127.0.0.1).

The server runs the shared tiny random Llama (tests/conftest.py) from its directory; nothing is
downloaded (HF_HUB_OFFLINE=1, an empty hub cache). Every server started here is killed in teardown.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from medusa_train.data.distilled import read_manifest, shard_files
from medusa_train.errors import UserError
from tests.helpers.distill import REPO, PausingCLI, run_cli
from tests.helpers.distill import distill_overrides as _overrides
from tests.helpers.distill import rows as _rows
from tests.helpers.distill import run_distill as _run
from tests.helpers.distill import spans as _spans
from tests.helpers.distill import write_prompts as _write_prompts
from tests.helpers.local_server import LocalServer

pytest.importorskip("fastapi", reason="transformers serve needs its serving extra (pip install -e .[dev])")
pytest.importorskip("uvicorn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`transformers serve <model dir>` on 127.0.0.1:port, in its own process group."""

    def __init__(self, model_dir: Path, cache: Path, port: int | None = None) -> None:
        self.model_dir, self.cache, self.port = model_dir, cache, port or _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 90.0) -> Server:
        cmd = [
            str(Path(sys.executable).parent / "transformers"), "serve", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(self.cache), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.kill()
        raise RuntimeError("transformers serve did not come up")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


def _server_overrides(url: str, *extra: str) -> list[str]:
    return [
        "distill.engine=server",
        f"distill.server.urls=[{url}]",
        "distill.server.concurrency=4",
        "distill.server.timeout_s=60",
        "distill.server.max_retries=2",
        "distill.server.backoff_s=0.1",
        *extra,
    ]


@pytest.fixture(scope="module")
def word_backbone(tiny_backbone_dir, tmp_path_factory) -> Path:
    """The tiny random Llama, able to emit only whole-word tokens (`Ġcat`) and EOS.

    A random model otherwise emits token splits our tokenizer would never make of the same text
    (`t|he`) and partial UTF-8 bytes: a text API cannot return those tokens, so nearly every record
    would differ for that reason alone. Zeroing the other lm_head rows gives them logit 0, below the
    largest of ~40 random word logits, so greedy replies are canonical and records comparable.
    """
    import torch

    from medusa_train.backbone import load_backbone

    model, tok = load_backbone(str(tiny_backbone_dir), dtype="float32", device="cpu")
    keep = {tok.eos_token_id}
    for token, index in tok.get_vocab().items():
        text = tok.decode([index])
        if (
            token.startswith("\u0120")
            and text[1:].isalpha()
            and tok(text, add_special_tokens=False)["input_ids"] == [index]
        ):
            keep.add(index)
    with torch.no_grad():
        weight = model.lm_head.weight  # (V, d)
        for index in range(weight.shape[0]):
            if index not in keep:
                weight[index] = 0.0
    out = tmp_path_factory.mktemp("word_backbone") / "base_model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return _write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


@pytest.fixture(scope="module")
def server(word_backbone, tmp_path_factory):
    srv = Server(word_backbone, tmp_path_factory.mktemp("hub_cache"))
    try:
        yield srv.start()
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def inprocess(word_backbone, prompts, tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("inprocess")
    _run(workdir, word_backbone, prompts)
    return workdir


@pytest.fixture(scope="module")
def served(word_backbone, prompts, server, tmp_path_factory) -> tuple[Path, dict]:
    workdir = tmp_path_factory.mktemp("served")
    return workdir, _run(workdir, word_backbone, prompts, *_server_overrides(server.url))


def _canonical(tok, ids: list[int], eos: int) -> bool:
    """Whether a reply's tokens are what our tokenizer makes of their own text (+ the EOS)."""
    body = ids[:-1] if ids and ids[-1] == eos else ids
    text = tok.decode(body)
    return (
        tok(text, add_special_tokens=False)["input_ids"] == body
        and tok.decode(tok(text)["input_ids"]) == text
    )


def test_greedy_records_equal_inprocess_except_non_canonical_replies(
    served, inprocess, word_backbone
) -> None:
    """Same prompts, greedy: the server's records equal the in-process ones token for token, except
    records in which the model generated a token split our tokenizer would not make of the same text
    (a text API cannot return it; the manifest counts those replies)."""
    from medusa_train.backbone import load_tokenizer

    tok = load_tokenizer(str(word_backbone))
    workdir, figures = served
    ours, theirs = _rows(inprocess), _rows(workdir)
    manifest = read_manifest(workdir / "distill")
    counts = manifest["counts"]
    assert manifest["engine"]["kind"] == "server" and manifest["engine"]["api"] == "chat"
    assert manifest["engine"]["endpoints"][0]["model_id"].startswith(str(word_backbone))
    assert len(theirs) + counts["records_dropped_not_token_exact"] == len(ours) == 10
    theirs_by_id = {r[0]: r for r in theirs}
    equal = exact_records = 0
    for source_id, ids, mask in ours:
        canonical = all(_canonical(tok, ids[s:e], tok.eos_token_id) for s, e in _spans(mask))
        exact_records += canonical
        if canonical:
            assert theirs_by_id[source_id] == (source_id, ids, mask), source_id
        equal += theirs_by_id.get(source_id) == (source_id, ids, mask)
    assert exact_records >= 3  # the comparison is not vacuous
    # every differing record holds a reply the server's counts flag as not token-exact
    flagged = counts["replies_token_count_differs"] + counts["replies_dropped_not_round_trip"]
    assert (len(ours) - equal) <= flagged
    assert counts["replies_prompt_tokens_differ"] == 0  # the server renders our template to our tokens
    # stage=train checks the data's backbone identity: the same whichever engine made it
    assert manifest["backbone"] == read_manifest(inprocess / "distill")["backbone"]
    print(f"\nserver vs in-process: {equal}/{len(ours)} records equal; counts {counts}")


def test_sampled_records_are_sampled(served, word_backbone, prompts, server, tmp_path) -> None:
    """``distill.temperature > 0`` through `transformers serve`, whose model (like any base model)
    has no ``do_sample`` in its generation config: the replies are drawn, not the greedy ones (the
    server used to answer such requests greedily, keeping the model's ``do_sample``)."""
    sampled = _run(
        tmp_path, word_backbone, prompts, *_server_overrides(server.url, "distill.temperature=1.0")
    )
    assert read_manifest(tmp_path / "distill")["generation"]["temperature"] == 1.0
    greedy = {r[0]: r for r in _rows(served[0])}
    drawn = {r[0]: r for r in _rows(tmp_path)}
    common = drawn.keys() & greedy.keys()
    assert sampled["records"] and len(common) >= 5
    # a reply of ~40 nearly equiprobable words drawn at temperature 1 is the greedy one by chance
    # only: every record of the server's greedy answers would be equal
    assert sum(drawn[i] != greedy[i] for i in common) >= len(common) // 2


def test_complete_server_folder_is_reused_without_contacting_the_server(served, word_backbone, prompts):
    workdir, figures = served
    again = _run(workdir, word_backbone, prompts, *_server_overrides("http://127.0.0.1:9/v1"))
    assert again["already_complete"] and again["records"] == figures["records"]


def test_switching_engine_or_served_model_is_refused(
    served, word_backbone, prompts, tmp_path_factory, tmp_path
) -> None:
    workdir, _ = served
    with pytest.raises(UserError, match=r"other settings.*engine"):
        _run(workdir, word_backbone, prompts, "distill.max_new_tokens=5")  # the in-process engine now
    # another served model (here: the same weights under another name) on another server
    other = tmp_path / "other_backbone"
    shutil.copytree(word_backbone, other)
    srv = Server(other, tmp_path_factory.mktemp("hub_cache3")).start()
    try:
        with pytest.raises(UserError, match=r"other settings.*engine"):
            _run(
                workdir, word_backbone, prompts, *_server_overrides(srv.url, f"distill.server.model={other}")
            )
    finally:
        srv.kill()


def test_client_sigkill_resumes_to_the_same_records(served, word_backbone, prompts, server, tmp_path):
    """Five client SIGKILLs (the issue's target), then the same command: every record exactly once."""
    overrides = [
        *_overrides(tmp_path, word_backbone, prompts, "distill.shard_size=1"),
        *_server_overrides(server.url, "distill.server.concurrency=1"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shards = tmp_path / "distill" / "shards"
    for kill in range(1, 6):
        PausingCLI(tmp_path, f"kill{kill}", overrides, env).wait_paused().kill()
        assert sorted(p.name for p in shards.glob("*.arrow")) == [f"shard-{i:05d}.arrow" for i in range(kill)]
    result = run_cli(overrides, env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resuming, 5 of 10 shards" in result.stderr
    assert [p.name for p in shard_files(tmp_path / "distill")] == [f"shard-{i:05d}.arrow" for i in range(10)]
    assert _rows(tmp_path) == _rows(served[0])  # every record exactly once, the same tokens


def test_server_down_fails_in_one_line_then_resumes_and_restarts_mid_run_complete(
    served, word_backbone, prompts, tmp_path_factory, tmp_path
) -> None:
    """Two server kills: one it stays down from (one line naming the URL, exit 2, shards kept), one
    it comes back from within the retry budget (the run completes); then the records are the same."""
    srv = Server(word_backbone, tmp_path_factory.mktemp("hub_cache2")).start()
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        shards = tmp_path / "distill" / "shards"

        def overrides(*extra: str) -> list[str]:
            return [
                *_overrides(tmp_path, word_backbone, prompts, "distill.shard_size=1"),
                *_server_overrides(srv.url, "distill.server.concurrency=1", *extra),
            ]

        # 1. the server dies mid-run and stays down
        down = PausingCLI(tmp_path, "down", overrides(), env).wait_paused()
        srv.kill()
        down.go_on()
        proc = down.proc
        _, err = proc.communicate(timeout=120)
        errors = [ln for ln in err.decode().splitlines() if ln.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, err.decode()[-2000:]
        assert srv.url in errors[0] and "did not answer after 3 attempts" in errors[0]
        assert sorted(p.name for p in shards.glob("*.arrow")) == ["shard-00000.arrow", "shard-00001.arrow"]

        # 2. the same command while the server is still down, with a longer retry budget: the server
        #    comes back, then dies mid-run once more and is restarted a second later; the run completes.
        #    The budget (100 attempts, the most the option takes: about 90 s) outlasts a server start on
        #    a loaded machine (30 attempts, ~21 s, ran out once while two test workers and other jobs
        #    shared two cores); the client goes on as soon as the server answers.
        patient = overrides("distill.server.max_retries=100", "distill.server.backoff_max_s=1")
        again = PausingCLI(tmp_path, "again", patient, env)
        time.sleep(3)  # the client starts, finds nothing listening, backs off
        srv.start()
        again.wait_paused()
        srv.kill()
        again.go_on()
        time.sleep(1)
        srv.start()
        _, err = again.proc.communicate(timeout=180)
        assert again.proc.returncode == 0, err.decode()[-2000:]
        assert "resuming, 2 of 10 shards" in err.decode()
        assert _rows(tmp_path) == _rows(served[0])  # every record exactly once, the same tokens
    finally:
        srv.kill()


def test_errors_before_any_work(word_backbone, prompts, server, tmp_path, monkeypatch) -> None:
    # a wrong model name
    with pytest.raises(UserError, match=r"does not take model 'nope'.*distill.server.model"):
        _run(
            tmp_path / "a",
            word_backbone,
            prompts,
            *_server_overrides(server.url, "distill.server.model=nope"),
        )
    # a bad URL: nothing listens there (after the retry budget), or no /v1 API at that path
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(UserError, match=rf"server {dead} did not answer after 3 attempts"):
        _run(tmp_path / "b", word_backbone, prompts, *_server_overrides(dead))
    with pytest.raises(UserError, match="no OpenAI-compatible API"):
        _run(tmp_path / "c", word_backbone, prompts, *_server_overrides(server.url[: -len("/v1")] + "/v2"))
    # a missing API key variable: named, never its value
    monkeypatch.delenv("MEDUSA_TEST_KEY", raising=False)
    with pytest.raises(UserError, match="MEDUSA_TEST_KEY is not set"):
        _run(
            tmp_path / "d",
            word_backbone,
            prompts,
            *_server_overrides(server.url, "distill.server.api_key_env=MEDUSA_TEST_KEY"),
        )
    # api=tokens needs token-id prompts, which transformers serve does not take
    with pytest.raises(UserError, match="token-id prompt|does not take"):
        _run(
            tmp_path / "e",
            word_backbone,
            prompts,
            *_server_overrides(server.url, "distill.server.api=tokens"),
        )
    for name in "abcde":
        assert not list((tmp_path / name / "distill" / "shards").glob("*.arrow"))
    # the CLI: one line, exit code 2
    cmd = [
        sys.executable, "-m", "medusa_train",
        *_overrides(tmp_path / "f", word_backbone, prompts),
        *_server_overrides(server.url, "distill.server.model=nope"),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "'nope'" in errors[0]


def test_api_key_is_sent_and_never_stored(served, word_backbone, prompts, server, tmp_path, monkeypatch):
    """The key goes out as a bearer header (transformers serve ignores it) and appears in no file."""
    secret = "sk-test-" + "q" * 24
    monkeypatch.setenv("MEDUSA_TEST_KEY", secret)
    _run(
        tmp_path,
        word_backbone,
        prompts,
        *_server_overrides(server.url, "distill.server.api_key_env=MEDUSA_TEST_KEY"),
    )
    for path in (tmp_path / "distill").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert _rows(tmp_path) == _rows(served[0])


class VllmShaped(LocalServer):
    """A stand-in for vLLM's completions API (vLLM cannot run on this CPU machine): token-id prompts
    in, ``choices[0].token_ids`` out, as vLLM documents them; the generation is the real model's
    unbatched greedy ``generate``. It checks our side of ``distill.server.api=tokens``."""

    def __init__(self, model_dir: Path, name: str) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler

        import torch

        from medusa_train.backbone import load_backbone

        model, tok = load_backbone(str(model_dir), dtype="float32", device="cpu")
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def _send(self, payload: dict, status: int = 200) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send({"object": "list", "data": [{"id": name, "root": str(model_dir)}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if body.get("model") != name:
                    return self._send({"error": f"model {body.get('model')} does not exist"}, 404)
                chat = self.path.endswith("/chat/completions")
                if chat:  # vLLM renders the messages with the chat template (here: only the probe)
                    text = tok.apply_chat_template(
                        body["messages"], add_generation_prompt=True, tokenize=False
                    )
                    prompt = tok(text, add_special_tokens=False)["input_ids"]
                else:
                    prompt = body["prompt"]
                stop = body.get("stop_token_ids") or [tok.eos_token_id]
                ids = torch.tensor([prompt])
                with lock, torch.no_grad():
                    out = model.generate(
                        ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=body["max_tokens"], eos_token_id=stop, pad_token_id=tok.pad_token_id,
                    )[0, ids.shape[1] :].tolist()  # fmt: skip
                end = next((i + 1 for i, t in enumerate(out) if t in stop), len(out))
                new = out[:end]
                finish = "stop" if new and new[-1] in stop else "length"
                choice = {"index": 0, "text": tok.decode(new), "token_ids": new, "finish_reason": finish}
                if chat:
                    message = {"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)}
                    choice = {"index": 0, "message": message, "finish_reason": finish}
                usage = {"prompt_tokens": ids.shape[1], "completion_tokens": len(new)}
                self._send({"model": name, "choices": [choice], "usage": usage})

            def log_message(self, *args) -> None:
                pass

        super().__init__(Handler)


def test_tokens_api_is_token_exact_even_for_non_canonical_replies(tiny_backbone_dir, prompts, tmp_path):
    """The unrestricted random model: nearly every reply is a split the tokenizer would not make,
    yet through token ids the server's records equal the in-process ones exactly."""
    stub = VllmShaped(tiny_backbone_dir, "tiny")
    try:
        _run(tmp_path / "in", tiny_backbone_dir, prompts)
        _run(
            tmp_path / "srv",
            tiny_backbone_dir,
            prompts,
            *_server_overrides(stub.url, "distill.server.api=tokens", "distill.server.model=tiny"),
        )
    finally:
        stub.close()
    assert _rows(tmp_path / "srv") == _rows(tmp_path / "in")
    manifest = read_manifest(tmp_path / "srv" / "distill")
    assert manifest["engine"]["token_exact"] and manifest["engine"]["endpoints"][0]["root"] == str(
        tiny_backbone_dir
    )
    assert manifest["counts"]["replies_token_count_differs"] == 0
