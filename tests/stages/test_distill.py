"""stage=distill on a tiny random Llama: greedy parity with `generate`, exact loss masks, resume, ranks."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BartConfig, RwkvConfig

from medusa_train.backbone import load_backbone, local_fingerprint
from medusa_train.config import ModelConfig
from medusa_train.data.chat import ChatRenderer, eos_token_ids
from medusa_train.data.distilled import read_manifest, shard_files
from medusa_train.data.regenerate import distill_records
from medusa_train.data.sources import Conversation
from medusa_train.decoding.attention import AttentionBackendError
from medusa_train.engines.base import GenRequest
from medusa_train.engines.inprocess import ContinuousBatcher
from medusa_train.errors import UserError
from medusa_train.stages import distill
from tests.helpers.distill import MAX_NEW, REPO, PausingCLI, run_cli
from tests.helpers.distill import distill_overrides as _overrides
from tests.helpers.distill import rows as _rows
from tests.helpers.distill import run_distill as _run
from tests.helpers.distill import spans as _spans
from tests.helpers.distill import write_prompts as _write_prompts
from tests.helpers.fake_openai import FakeOpenAI
from tests.helpers.models import add_remote_code
from tests.helpers.tokenizers import phi3_style


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path, prompts: Path
) -> tuple[Path, dict]:
    """One uninterrupted single-process run that the other tests compare with."""
    workdir = tmp_path_factory.mktemp("reference")
    return workdir, _run(workdir, tiny_backbone_dir, prompts)


LLAMA2_STYLE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
"""Llama-2-chat's shape: a space between the reply and its end-of-turn token."""


@pytest.fixture(scope="module")
def spaced_reference(
    tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path
) -> tuple[Path, Path, Path]:
    """The tiny backbone with :data:`LLAMA2_STYLE` as its chat template, four prompts of one to three
    turns and a workdir distilled from them with it."""
    root = tmp_path_factory.mktemp("spaced")
    prompts = _write_prompts(root / "prompts.jsonl", n=4)
    backbone = root / "backbone"
    shutil.copytree(tiny_backbone_dir, backbone)
    _, tok = load_backbone(str(tiny_backbone_dir))
    tok.chat_template = LLAMA2_STYLE
    tok.save_pretrained(backbone)
    _run(root / "workdir", backbone, prompts)
    return root / "workdir", backbone, prompts


@pytest.fixture(scope="module")
def rstrip_reference(
    tmp_path_factory: pytest.TempPathFactory, tiny_backbone_dir: Path
) -> tuple[Path, Path, Path]:
    """The tiny backbone with Phi-3's chat shape (:func:`~tests.helpers.tokenizers.phi3_style`: a newline
    after its EOS, which has ``rstrip``), four prompts of one to three turns and a workdir distilled from
    them with it."""
    root = tmp_path_factory.mktemp("rstrip")
    prompts = _write_prompts(root / "prompts.jsonl", n=4)
    backbone = root / "backbone"
    shutil.copytree(tiny_backbone_dir, backbone)
    _, tok = load_backbone(str(tiny_backbone_dir))
    phi3_style(tok).save_pretrained(backbone)
    _run(root / "workdir", backbone, prompts)
    return root / "workdir", backbone, prompts


def _drop_setting(distill_dir: Path, key: str = "spaced_eos") -> None:
    """Make ``distill_dir`` a folder whose settings do not record ``key`` (progress and manifest), as an
    earlier version wrote it."""
    for name in ("progress.json", "manifest.json"):
        path = distill_dir / name
        if path.exists():
            content = json.loads(path.read_text())
            content["settings"].pop(key, None)
            path.write_text(json.dumps(content))


def _earlier_copy(distill_dir: Path, dest: Path, key: str, *, finished: bool) -> Path:
    """A copy of ``distill_dir`` at ``dest/distill`` as an earlier version left it without ``key``
    recorded: unfinished (no manifest, its last shard missing) or finished."""
    copy = dest / "distill"
    shutil.copytree(distill_dir, copy)
    if not finished:
        (copy / "manifest.json").unlink()
        shard_files(copy)[-1].unlink()
    _drop_setting(copy, key)
    return copy


def _forget_settings_files(distill_dir: Path) -> None:
    """Drop the settings files' record from ``distill_dir``'s manifest, as an older manifest lacks it:
    the check before the model loads then misses, and the one after it decides."""
    manifest = json.loads((distill_dir / "manifest.json").read_text())
    del manifest["quick_settings"]["backbone_source"]["settings_files"]
    (distill_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_template_with_a_space_before_eos_is_recorded_for_multi_turn_data_only(
    spaced_reference, reference, tmp_path
) -> None:
    """Later turns' contexts drop the space Llama-2's template puts before EOS: recorded in the settings
    where it applies, not for another template nor for single-turn data (their settings are unchanged)."""
    workdir, backbone, _ = spaced_reference
    assert read_manifest(workdir / "distill")["settings"]["spaced_eos"] == "dropped"
    assert (
        "spaced_eos" not in read_manifest(reference[0] / "distill")["settings"]
    )  # EOS right after the reply
    single = tmp_path / "single.jsonl"
    single.write_text('{"prompt": "why is the cat big?"}\n{"prompt": ["tell me a story"]}\n')
    _run(tmp_path, backbone, single)
    assert "spaced_eos" not in read_manifest(tmp_path / "distill")["settings"]


def test_an_eos_with_rstrip_and_whitespace_after_it_is_recorded_for_multi_turn_data_only(
    rstrip_reference, reference, tmp_path
) -> None:
    """Later turns' contexts drop the newline Phi-3's template puts after its EOS, whose token has
    ``rstrip``: recorded in the settings where it applies, not for a template without whitespace after
    EOS nor for single-turn data (their settings are unchanged). The records themselves: the unit tests
    of ChatRenderer (the tiny random backbone's replies seldom end with EOS before a later turn)."""
    workdir, backbone, _ = rstrip_reference
    assert read_manifest(workdir / "distill")["settings"]["eos_rstrip"] == "applied"
    assert "eos_rstrip" not in read_manifest(reference[0] / "distill")["settings"]
    _, tok = load_backbone(str(backbone))
    assert tok.added_tokens_decoder[tok.eos_token_id].rstrip  # saved and loaded with the flag
    single = tmp_path / "single.jsonl"
    single.write_text('{"prompt": "why is the cat big?"}\n{"prompt": ["tell me a story"]}\n')
    _run(tmp_path, backbone, single)
    assert "eos_rstrip" not in read_manifest(tmp_path / "distill")["settings"]


@pytest.mark.parametrize(
    ("folder", "key", "value", "says"),
    [
        ("spaced_reference", "spaced_eos", "dropped", "whitespace before the template's EOS"),
        ("rstrip_reference", "eos_rstrip", "applied", "whitespace after an EOS whose rstrip drops it"),
    ],
)
def test_a_folder_without_its_rendering_entry_is_refused_unfinished_and_kept_complete(
    folder: str, key: str, value: str, says: str, request, tmp_path
) -> None:
    """A folder of that template and multi-turn data whose settings lack the entry holds EOS, space, EOS
    (Llama-2's space before EOS) or EOS, newline (Phi-3's newline after an EOS with ``rstrip``) in later
    turns' contexts: unfinished, resuming would mix both renderings (refused, naming
    distill.overwrite=true); complete, its records are whole and kept, before and after the model loads."""
    workdir, backbone, prompts = request.getfixturevalue(folder)
    unfinished = _earlier_copy(workdir / "distill", tmp_path / "unfinished", key, finished=False)
    with pytest.raises(UserError, match=rf"{re.escape(says)}.*{key}.*distill.overwrite=true"):
        _run(unfinished.parent, backbone, prompts)
    assert not _run(unfinished.parent, backbone, prompts, "distill.overwrite=true")["already_complete"]
    assert _rows(unfinished.parent) == _rows(workdir)

    complete = _earlier_copy(workdir / "distill", tmp_path / "complete", key, finished=True)
    assert _run(complete.parent, backbone, prompts)["already_complete"]  # the check before the model loads
    _forget_settings_files(complete)  # an older manifest: that check misses
    assert _run(complete.parent, backbone, prompts)["already_complete"]  # the check after it
    assert "settings_files" in read_manifest(complete)["quick_settings"]["backbone_source"]
    assert not _run(complete.parent, backbone, prompts, "distill.overwrite=true")["already_complete"]
    assert read_manifest(complete)["settings"][key] == value


def test_later_turns_quoting_a_special_token_are_recorded_and_an_older_unfinished_folder_refused(
    reference, tiny_backbone_dir: Path, tmp_path
) -> None:
    """A later user turn quoting the EOS string is encoded as text (earlier versions: the EOS id), which
    the prompts' hash does not see: the settings record ``quoted_special_tokens`` for such data only, a
    folder without it is refused unfinished (resuming would mix both encodings) and kept complete."""
    _, tok = load_backbone(str(tiny_backbone_dir))
    prompts = tmp_path / "quoting.jsonl"
    rows = [["why is the sky blue?", f"what does {tok.eos_token} mean?"]] + [
        [f"tell me {i} things"] for i in range(3)
    ]
    prompts.write_text("".join(json.dumps({"prompt": turns}) + "\n" for turns in rows))
    workdir = tmp_path / "workdir"
    _run(workdir, tiny_backbone_dir, prompts)
    assert read_manifest(workdir / "distill")["settings"]["quoted_special_tokens"] == "text"
    assert "quoted_special_tokens" not in read_manifest(reference[0] / "distill")["settings"]

    unfinished = _earlier_copy(
        workdir / "distill", tmp_path / "unfinished", "quoted_special_tokens", finished=False
    )
    with pytest.raises(
        UserError, match=r"quote a special-token string.*quoted_special_tokens.*overwrite=true"
    ):
        _run(unfinished.parent, tiny_backbone_dir, prompts)
    complete = _earlier_copy(
        workdir / "distill", tmp_path / "complete", "quoted_special_tokens", finished=True
    )
    _forget_settings_files(complete)  # the check before the model misses
    assert _run(complete.parent, tiny_backbone_dir, prompts)["already_complete"]  # the check after it


@pytest.mark.parametrize("api", ["chat", "tokens"])
def test_a_server_chat_run_records_quoted_special_tokens_and_an_older_unfinished_folder_is_refused(
    api: str, tiny_backbone_dir: Path, prompts: Path, tmp_path
) -> None:
    """A server's chat reply is re-tokenised with special-token strings as text (earlier versions: the
    special id), and which reply quotes one is known only once it is generated: every api=chat run
    records ``quoted_special_tokens``, so a folder without it is refused unfinished (resuming would mix
    both encodings) and kept complete. api=tokens replies are the generated ids: nothing recorded."""
    srv = FakeOpenAI(str(tiny_backbone_dir))
    server = (
        "distill.engine=server", f"distill.server.urls=[{srv.url}]", f"distill.server.api={api}",
        "distill.server.max_retries=1", "distill.server.backoff_s=0.01",
    )  # fmt: skip
    try:
        workdir = tmp_path / "workdir"
        _run(workdir, tiny_backbone_dir, prompts, *server)
        settings = read_manifest(workdir / "distill")["settings"]
        if api == "tokens":
            assert "quoted_special_tokens" not in settings
            return
        assert settings["quoted_special_tokens"] == "text"
        unfinished = _earlier_copy(
            workdir / "distill", tmp_path / "unfinished", "quoted_special_tokens", finished=False
        )
        with pytest.raises(
            UserError,
            match=r"server's chat replies that quote a special-token.*quoted_special_tokens.*overwrite",
        ):
            _run(unfinished.parent, tiny_backbone_dir, prompts, *server)
        complete = _earlier_copy(
            workdir / "distill", tmp_path / "complete", "quoted_special_tokens", finished=True
        )
        assert _run(complete.parent, tiny_backbone_dir, prompts, *server)["already_complete"]
        _forget_settings_files(complete)  # the check before the model misses
        assert _run(complete.parent, tiny_backbone_dir, prompts, *server)["already_complete"]  # the one after
    finally:
        srv.close()


def test_greedy_turns_equal_generate_and_mask_is_exact(
    reference, tiny_backbone_dir: Path, prompts: Path
) -> None:
    workdir, figures = reference
    model, tok = load_backbone(str(tiny_backbone_dir))
    eos = tok.eos_token_id
    rows = _rows(workdir)
    assert figures["records"] == len(rows) == 10 and figures["num_shards"] == 4
    user_turns = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
    saw_eos = saw_cut = multi = 0
    for (source_id, ids, mask), turns in zip(rows, user_turns, strict=True):
        assert source_id.startswith("prompts.jsonl:") and len(ids) == len(mask)
        spans = _spans(mask)
        assert len(spans) == len(turns)  # every user turn answered (nothing near the context limit)
        first = tok.apply_chat_template(
            [{"role": "user", "content": turns[0]}], add_generation_prompt=True, tokenize=False
        )
        assert ids[: spans[0][0]] == tok(first, add_special_tokens=False)["input_ids"]
        for start, end in spans:
            # The same context, unbatched, unpadded: token-for-token the same reply.
            ctx = torch.tensor([ids[:start]])
            ref = model.generate(
                ctx,
                attention_mask=torch.ones_like(ctx),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )[0, start:].tolist()
            if eos in ref:
                ref = ref[: ref.index(eos) + 1]
            assert ids[start:end] == ref, source_id
            # 1 exactly on generated tokens: ends with EOS, or was cut at max_new_tokens without one
            assert ids[end - 1] == eos or end - start == MAX_NEW
            assert eos not in ids[start : end - 1]
            saw_eos += ids[end - 1] == eos
            saw_cut += ids[end - 1] != eos
        multi += len(turns) > 1
        if all(ids[e - 1] == eos for _, e in spans):  # the sequence is the chat template of its own replies
            replies = [tok.decode(ids[s:e], skip_special_tokens=True) for s, e in spans]
            msgs = [
                m
                for u, r in zip(turns, replies, strict=True)
                for m in ({"role": "user", "content": u}, {"role": "assistant", "content": r})
            ]
            assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert saw_eos and saw_cut and multi  # the fixture exercises both endings and multi-turn conditioning
    manifest = read_manifest(workdir / "distill")
    assert (
        manifest["counts"]["tokens_generated"]
        == sum(sum(m) for _, _, m in rows)
        == figures["tokens_generated"]
    )
    assert manifest["backbone"]["fingerprint"] and manifest["tokenizer"]["vocab_size"] == len(tok)
    assert manifest["generation"]["max_new_tokens"] == MAX_NEW and manifest["world_size"] == 1
    assert manifest["tokens_per_s"] > 0 and manifest["counts"]["records"] == 10
    assert [p.name for p in shard_files(workdir / "distill")] == [f"shard-{i:05d}.arrow" for i in range(4)]


def test_complete_folder_returns_immediately(
    reference, tiny_backbone_dir: Path, prompts: Path, monkeypatch
) -> None:
    workdir, figures = reference
    monkeypatch.setattr(
        distill, "load_configured_backbone", lambda *a, **k: pytest.fail("must not load the model")
    )
    again = _run(workdir, tiny_backbone_dir, prompts)
    assert again["already_complete"] and again["records"] == figures["records"]
    # settings that change no record (run-only fields; top_p and seed of a greedy run) reuse it too
    same = ("distill.batch_size=2", "data.strict=true", "distill.seed=7", "distill.top_p=0.5")
    assert _run(workdir, tiny_backbone_dir, prompts, *same)["already_complete"]


def test_injected_failure_then_resume_gives_the_same_records(
    reference, tiny_backbone_dir, prompts, tmp_path, monkeypatch
) -> None:
    real_write = distill.write_shard
    calls = []

    def failing_write(path, rows):
        if calls:
            raise RuntimeError("injected failure")
        calls.append(path)
        real_write(path, rows)

    monkeypatch.setattr(distill, "write_shard", failing_write)
    with pytest.raises(RuntimeError, match="injected"):
        _run(tmp_path, tiny_backbone_dir, prompts)
    assert len(list((tmp_path / "distill" / "shards").glob("*.arrow"))) == 1
    monkeypatch.setattr(distill, "write_shard", real_write)
    resumed = _run(tmp_path, tiny_backbone_dir, prompts)
    assert resumed["tokens_generated_now"] < resumed["tokens_generated"]  # the first shard was not redone
    assert _rows(tmp_path) == _rows(reference[0])


def test_sigkill_then_restart_gives_the_same_records(reference, tiny_backbone_dir, prompts, tmp_path) -> None:
    overrides = _overrides(
        tmp_path, tiny_backbone_dir, prompts, "distill.batch_size=1", "distill.shard_size=1"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shards = tmp_path / "distill" / "shards"
    PausingCLI(tmp_path, "kill", overrides, env, pause_at=3).wait_paused().kill()
    kept = {p.name: p.stat().st_mtime_ns for p in shards.glob("*.arrow")}
    assert sorted(kept) == [f"shard-{i:05d}.arrow" for i in range(3)]
    (shards / ".shard-00003.arrow.k1ll3d.tmp").write_bytes(b"half a shard")  # what a kill mid-write leaves
    result = run_cli(overrides, env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resuming, 3 of 10 shards" in result.stderr
    assert not list(shards.glob(".*tmp*"))
    assert [p.name for p in shard_files(tmp_path / "distill")] == [f"shard-{i:05d}.arrow" for i in range(10)]
    assert {name: (shards / name).stat().st_mtime_ns for name in kept} == kept  # finished shards not redone
    # greedy results do not depend on shard or batch size: equal to the uninterrupted reference run
    assert _rows(tmp_path) == _rows(reference[0])


def test_the_backbones_repetition_penalty_applies_as_in_generate(
    tiny_backbone_dir, prompts, tmp_path
) -> None:
    """A generation config with a repetition penalty: every greedy reply is the model's own ``generate``
    (which applies it), unlike the replies without it; the manifest says which penalty was applied."""
    backbone = tmp_path / "penalised"
    shutil.copytree(tiny_backbone_dir, backbone)
    config = json.loads((backbone / "generation_config.json").read_text())
    (backbone / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 1.8}))
    _run(tmp_path, backbone, prompts, "data.num_prompts=4")
    model, tok = load_backbone(str(backbone))
    assert model.generation_config.repetition_penalty == 1.8
    changed = 0
    for _, ids, mask in _rows(tmp_path):
        for start, end in _spans(mask):
            ctx = torch.tensor([ids[:start]])
            kw = dict(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=tok.eos_token_id)
            ref, plain = (
                model.generate(ctx, attention_mask=torch.ones_like(ctx), repetition_penalty=p, **kw)[
                    0, start:
                ]
                for p in (1.8, 1.0)
            )
            ref = ref.tolist()
            if tok.eos_token_id in ref:
                ref = ref[: ref.index(tok.eos_token_id) + 1]
            assert ids[start:end] == ref
            changed += plain.tolist()[: end - start] != ids[start:end]
    assert changed  # the penalty changed replies
    assert read_manifest(tmp_path / "distill")["generation"]["repetition_penalty"] == 1.8


def test_the_backbones_top_k_applies_when_sampling(tiny_backbone_dir, prompts, tmp_path) -> None:
    """A generation config's top-k applies to sampled replies (as vLLM and ``generate`` apply it): with
    top-k 1 every reply drawn at temperature 1.5 is the greedy one. A greedy run does not record it."""
    backbone = tmp_path / "top1"
    shutil.copytree(tiny_backbone_dir, backbone)
    config = json.loads((backbone / "generation_config.json").read_text())
    (backbone / "generation_config.json").write_text(json.dumps({**config, "top_k": 1}))
    _run(tmp_path / "greedy", backbone, prompts, "data.num_prompts=4")
    _run(tmp_path / "sampled", backbone, prompts, "data.num_prompts=4", "distill.temperature=1.5")
    _run(tmp_path / "plain", tiny_backbone_dir, prompts, "data.num_prompts=4", "distill.temperature=1.5")
    assert _rows(tmp_path / "sampled") == _rows(tmp_path / "greedy") != _rows(tmp_path / "plain")
    assert read_manifest(tmp_path / "sampled" / "distill")["generation"]["top_k"] == 1
    greedy = read_manifest(tmp_path / "greedy" / "distill")
    assert greedy["generation"]["top_k"] == 0 and "top_k" not in greedy["settings"]


def test_generation_config_settings_the_engine_does_not_apply_are_named(
    tiny_backbone_dir, prompts, tmp_path, caplog
) -> None:
    backbone = tmp_path / "ngram"
    shutil.copytree(tiny_backbone_dir, backbone)
    config = json.loads((backbone / "generation_config.json").read_text())
    (backbone / "generation_config.json").write_text(json.dumps({**config, "no_repeat_ngram_size": 3}))
    with caplog.at_level("WARNING", logger="medusa_train.stages.distill"):
        _run(tmp_path / "plain", tiny_backbone_dir, prompts, "data.num_prompts=2")
        assert "does not apply" not in caplog.text
        _run(tmp_path / "ngram", backbone, prompts, "data.num_prompts=2")
    assert "sets no_repeat_ngram_size=3, which the in-process engine does not apply" in caplog.text


def test_resume_with_other_settings_is_refused(reference, tiny_backbone_dir, prompts, tmp_path) -> None:
    shutil.copytree(reference[0] / "distill", tmp_path / "distill")
    with pytest.raises(UserError, match=r"other settings.*distill.max_new_tokens.*distill.overwrite=true"):
        _run(tmp_path, tiny_backbone_dir, prompts, "distill.max_new_tokens=5")
    other_data = _write_prompts(tmp_path / "other.jsonl", seed=1)
    with pytest.raises(UserError, match=r"other settings.*data"):
        _run(tmp_path, tiny_backbone_dir, other_data)
    # another backbone: same architecture, one weight changed
    other = tmp_path / "other_backbone"
    model, tok = load_backbone(str(tiny_backbone_dir))
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    model.save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(UserError, match="a different backbone"):
        _run(tmp_path, other, prompts)
    figures = _run(tmp_path, tiny_backbone_dir, prompts, "distill.max_new_tokens=5", "distill.overwrite=true")
    assert figures["records"] == 10 and all(sum(m) <= 5 * 3 for _, _, m in _rows(tmp_path))


def test_overwrite_redoes_a_complete_folder_whose_weights_changed_under_the_same_name(
    reference, tiny_backbone_dir, prompts, tmp_path, monkeypatch
) -> None:
    """The check before the model loads compares a Hub id by name and revision; its weights can change
    under them (stage=train then refuses the data and names distill.overwrite=true). Overwrite redoes
    that folder; one complete with every setting the same it reuses as it is."""
    shutil.copytree(reference[0] / "distill", tmp_path / "distill")
    manifest = tmp_path / "distill" / "manifest.json"
    before = manifest.read_bytes()
    assert _run(tmp_path, tiny_backbone_dir, prompts, "distill.overwrite=true")["already_complete"]
    assert manifest.read_bytes() == before
    real = distill.backbone_identity
    monkeypatch.setattr(
        distill, "backbone_identity", lambda *a, **k: {**real(*a, **k), "fingerprint": "0" * 16}
    )
    figures = _run(tmp_path, tiny_backbone_dir, prompts, "distill.overwrite=true")
    assert not figures["already_complete"] and figures["tokens_generated_now"] == figures["tokens_generated"]
    assert read_manifest(tmp_path / "distill")["backbone"]["fingerprint"] == "0" * 16


def test_a_folder_an_earlier_version_fingerprinted_says_so() -> None:
    """A folder whose settings record the backbone by a fingerprint of an earlier medusa_train (16 hex
    digits: other bytes of the files, or of a model's tensors) is refused as that, not as "a different
    backbone" (which the refusal also says for a fingerprint of this version)."""
    old = {"backbone_fingerprint": "0123456789abcdef", "dtype": "float32"}
    new = {"backbone_fingerprint": "v2-0123456789abcdef", "dtype": "float32"}
    assert distill._difference(old, new).startswith(
        "a backbone fingerprint an earlier medusa_train computed from other bytes than this version reads: "
    )
    other = {**old, "backbone_fingerprint": "v2-fedcba9876543210"}
    assert distill._difference(other, new).startswith("a different backbone: backbone_fingerprint")


def test_a_folder_distilled_with_the_other_trust_remote_code_says_so(
    prompts, tiny_backbone_dir, tmp_path
) -> None:
    """A backbone whose config.json's auto_map names remote code has one fingerprint loaded with
    model.trust_remote_code and another without (its code counts only with it). A folder distilled with
    one setting, resumed unfinished or rerun complete with the other, is refused naming that setting
    (not as "a different backbone", naming the same model) and left as it is."""
    backbone = tmp_path / "remote_code_backbone"
    shutil.copytree(tiny_backbone_dir, backbone)
    add_remote_code(backbone)
    trusted, plain = tmp_path / "trusted", tmp_path / "plain"
    _run(trusted, backbone, prompts, "data.max_records=4", "model.trust_remote_code=true")
    _run(plain, backbone, prompts, "data.max_records=4")
    (trusted / "distill" / "manifest.json").unlink()  # unfinished: the next run resumes it
    shard_files(trusted / "distill")[-1].unlink()
    for workdir, distilled_with, now in ((trusted, "true", "false"), (plain, "false", "true")):
        before = {p: p.read_bytes() for p in (workdir / "distill").rglob("*") if p.is_file()}
        with pytest.raises(UserError) as err:
            _run(workdir, backbone, prompts, "data.max_records=4", f"model.trust_remote_code={now}")
        message = str(err.value)
        assert message.startswith(
            f"{workdir / 'distill'} holds distilled data made with other settings (the same backbone loaded "
            f"with model.trust_remote_code={distilled_with}, where this run sets model.trust_remote_code={now} "
            "(the remote code its config.json's auto_map names counts only with it): backbone_fingerprint ("
        ), message
        assert message.endswith(
            "run with the old values to keep and finish it, pass distill.overwrite=true to discard it, or use "
            "another workdir="
        )
        assert {p: p.read_bytes() for p in (workdir / "distill").rglob("*") if p.is_file()} == before
    # another backbone's fingerprint, or none recorded, is a different backbone, remote code or not
    current = {"backbone_fingerprint": local_fingerprint(str(backbone))}
    for model in (ModelConfig(str(backbone)), ModelConfig(str(tiny_backbone_dir))):
        for recorded in ({"backbone_fingerprint": "v2-0123456789abcdef"}, {}):
            assert distill._difference(recorded, current, model).startswith("a different backbone: ")


def test_a_complete_folder_is_refused_after_the_backbones_template_or_generation_config_changed(
    reference, tiny_backbone_dir, prompts, tmp_path
) -> None:
    """The chat template and the generation config live beside the weights, outside their fingerprint:
    an edit of either is another setting for a complete folder too (refused, not reused unseen)."""
    backbone = tmp_path / "backbone"
    shutil.copytree(tiny_backbone_dir, backbone)
    shutil.copytree(reference[0] / "distill", tmp_path / "distill")
    assert _run(tmp_path, backbone, prompts)["already_complete"]  # a copied backbone is the same one
    template = next(
        p for p in (backbone / "chat_template.jinja", backbone / "tokenizer_config.json") if p.exists()
    )
    original = template.read_text()
    template.write_text(original.replace("<|assistant|>", "<|assistant|> "))
    with pytest.raises(UserError, match=r"other settings.*chat_template"):
        _run(tmp_path, backbone, prompts)
    template.write_text(original)
    config = json.loads((backbone / "generation_config.json").read_text())
    (backbone / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 1.3}))
    with pytest.raises(UserError, match=r"other settings.*repetition_penalty"):
        _run(tmp_path, backbone, prompts)


def test_sampling_is_seeded_per_record(tiny_backbone_dir, prompts, tmp_path) -> None:
    a = _run(tmp_path / "a", tiny_backbone_dir, prompts, "distill.temperature=1.5", "distill.batch_size=1")
    b = _run(
        tmp_path / "b",
        tiny_backbone_dir,
        prompts,
        "distill.temperature=1.5",
        "distill.batch_size=4",
        "distill.shard_size=5",
    )
    assert a["records"] == b["records"] == 10
    assert _rows(tmp_path / "a") == _rows(tmp_path / "b")  # independent of batch composition and sharding
    _run(tmp_path / "c", tiny_backbone_dir, prompts, "distill.temperature=1.5", "distill.seed=1")
    assert _rows(tmp_path / "c") != _rows(tmp_path / "a")


def test_bad_inputs(tiny_backbone_dir, prompts, tmp_path, monkeypatch) -> None:
    # a missing file fails before the model loads
    with monkeypatch.context() as m:
        m.setattr(distill, "load_configured_backbone", lambda *a, **k: pytest.fail("must not load the model"))
        with pytest.raises(UserError, match="does not exist"):
            _run(tmp_path / "w0", tiny_backbone_dir, tmp_path / "missing.jsonl")
    # long prompts: skipped with a count, or left-truncated, or an error in strict mode
    skip = _run(tmp_path / "w1", tiny_backbone_dir, prompts, "data.max_prompt_tokens=12")
    manifest = read_manifest(tmp_path / "w1" / "distill")
    assert skip["records_skipped"] > 0 and skip["records"] + skip["records_skipped"] == 10
    assert manifest["counts"]["skipped"] == {"prompt longer than 12 tokens": skip["records_skipped"]}
    trunc = _run(
        tmp_path / "w2", tiny_backbone_dir, prompts, "data.max_prompt_tokens=12", "data.long_prompts=truncate"
    )
    assert trunc["records"] == 10
    for _, _ids, mask in _rows(tmp_path / "w2"):
        assert mask.index(1) <= 12  # the first prompt holds at most 12 tokens
    with pytest.raises(UserError, match=r"prompts.jsonl:\d+.*longer than 12"):
        _run(tmp_path / "w3", tiny_backbone_dir, prompts, "data.max_prompt_tokens=12", "data.strict=true")
    # malformed lines are skipped and counted in the manifest
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "the cat?"}\n{oops\n{"prompt": ""}\n')
    figures = _run(tmp_path / "w4", tiny_backbone_dir, bad)
    assert figures["records"] == 1 and figures["records_skipped"] == 2
    with pytest.raises(UserError, match="bad.jsonl:2: malformed JSON"):
        _run(tmp_path / "w5", tiny_backbone_dir, bad, "data.strict=true")


def test_cli_error_is_one_line(tmp_path, tiny_backbone_dir) -> None:
    cmd = [
        sys.executable,
        "-m",
        "medusa_train",
        *_overrides(tmp_path, tiny_backbone_dir, tmp_path / "nope.jsonl"),
    ]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "nope.jsonl does not exist" in errors[0]


def _rwkv(directory: Path) -> None:
    RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=64).save_pretrained(
        directory
    )


def _bart(directory: Path) -> None:
    BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1).save_pretrained(directory)


def _a_linear_attention_layer(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * (config["num_hidden_layers"] - 1) + ["linear_attention"]
    (directory / "config.json").write_text(json.dumps(config))


def _stateful_remote_code(directory: Path) -> None:
    add_remote_code(directory)
    code = directory / "modeling_x.py"
    code.write_text(code.read_text().replace("    pass\n", "    _is_stateful = True\n"))


_UNVERIFIABLE = {
    "rwkv": (_rwkv, (), r"RwkvForCausalLM \(rwkv\) keeps a recurrent state"),
    "bart": (_bart, (), r"BartForCausalLM \(bart\) takes no position_ids"),
    "layer-type": (
        _a_linear_attention_layer,
        (),
        r"LlamaForCausalLM \(llama\) has layers of type 'linear_attention'",
    ),
    "remote-code": (
        _stateful_remote_code,
        ("model.trust_remote_code=true",),
        r"XForCausalLM \(llama\) keeps a recurrent state",
    ),
}
"""Backbones no tree decoder verifies, as a change to a copy of the tiny backbone's folder: the
overrides they need, and the start of tree_refusal's reason."""


def _unverifiable_backbone(tiny_backbone_dir: Path, tmp_path: Path, case: str) -> Path:
    """A copy of the tiny backbone's folder (its tokenizer and weights) changed by :data:`_UNVERIFIABLE`."""
    backbone = tmp_path / f"unverifiable_{case.replace('-', '_')}"  # remote code: a module name of its own
    shutil.copytree(tiny_backbone_dir, backbone)
    _UNVERIFIABLE[case][0](backbone)
    return backbone


@pytest.mark.parametrize("engine", ["inprocess", "server"])
@pytest.mark.parametrize("case", list(_UNVERIFIABLE))
def test_a_backbone_no_tree_decoder_verifies_is_refused_before_it_loads(
    case: str, engine: str, tiny_backbone_dir, prompts, tmp_path, monkeypatch
) -> None:
    """A backbone whose heads no tree decoder could verify (stateful RWKV, positionless Bart, a layer type
    the decoders do not serve, remote code marked stateful) is refused in one line saying why and what to
    do, from its config on the meta device: before its weights load (in-process) or a server is asked
    anything, and before anything is written in workdir/distill."""
    _, extra, says = _UNVERIFIABLE[case]
    backbone = _unverifiable_backbone(tiny_backbone_dir, tmp_path, case)
    monkeypatch.setattr(
        distill, "load_configured_backbone", lambda *a, **k: pytest.fail("must not load the model")
    )
    srv = FakeOpenAI(str(backbone))
    server = ("distill.engine=server", f"distill.server.urls=[{srv.url}]") if engine == "server" else ()
    try:
        with pytest.raises(
            AttentionBackendError, match=f"^model.name_or_path={re.escape(str(backbone))}: {says}"
        ) as err:
            _run(tmp_path / "workdir", backbone, prompts, *extra, *server)
        assert srv.requests == []
    finally:
        srv.close()
    message = str(err.value)
    assert "\n" not in message and message.endswith(
        "heads trained on data distilled from it could never be verified by the tree decoders (stage=train "
        "refuses it): distill from another backbone"
    )
    assert not (tmp_path / "workdir" / "distill").exists()


def test_a_backbone_that_cannot_be_built_on_meta_is_checked_once_loaded(
    tiny_backbone_dir, prompts, tmp_path, monkeypatch, caplog
) -> None:
    """A model that cannot be built on the meta device (some remote code) is not refused for that (a debug
    line says it): the in-process engine checks the loaded model, before anything is written."""
    backbone = _unverifiable_backbone(tiny_backbone_dir, tmp_path, "layer-type")

    def no_meta(*args, **kwargs):
        raise RuntimeError("cannot run on meta tensors")

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", no_meta)
    with caplog.at_level(logging.DEBUG, logger="medusa_train.backbone"):
        with pytest.raises(
            AttentionBackendError, match=r"has layers of type 'linear_attention'.*another backbone"
        ):
            _run(tmp_path / "workdir", backbone, prompts)
    assert "cannot be built on the meta device (cannot run on meta tensors)" in caplog.text
    assert not (tmp_path / "workdir" / "distill").exists()


def test_cli_refuses_a_backbone_no_tree_decoder_verifies_in_one_line(
    tiny_backbone_dir, prompts, tmp_path
) -> None:
    backbone = _unverifiable_backbone(tiny_backbone_dir, tmp_path, "rwkv")
    result = run_cli(_overrides(tmp_path / "workdir", backbone, prompts), dict(os.environ))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "RwkvForCausalLM (rwkv) keeps a recurrent state" in errors[0]
    assert "distill from another backbone" in errors[0]
    assert not (tmp_path / "workdir" / "distill").exists()


@pytest.mark.distributed
def test_torchrun_two_ranks_equal_one_process(reference, tiny_backbone_dir, prompts, tmp_path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "medusa_train", *_overrides(tmp_path, tiny_backbone_dir, prompts),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _rows(tmp_path) == _rows(reference[0])
    manifest = read_manifest(tmp_path / "distill")
    assert manifest["world_size"] == 2 and manifest["counts"]["records"] == 10
    assert manifest["settings"] == read_manifest(reference[0] / "distill")["settings"]


@pytest.mark.parametrize("max_context", [10_000, 40])
def test_on_reply_reports_every_reply_and_each_records_end(tiny_backbone_dir, max_context) -> None:
    """The progress bar's feed: one call per generated reply, the record's end flagged exactly once
    (also when a later turn is dropped for ``max_context``), tokens summing to the masked tokens."""
    model, tok = load_backbone(str(tiny_backbone_dir), dtype="float32", device="cpu")
    renderer = ChatRenderer(tok)
    convs = [Conversation(f"r{i}", [f"tell me a story {j}?" for j in range(1 + i % 3)]) for i in range(7)]
    calls: list[tuple[str, int, bool]] = []
    eos_ids = eos_token_ids(model, tok)
    engine = ContinuousBatcher(
        model, batch_size=3, pad_id=tok.pad_token_id, eos_ids=eos_ids, max_new_tokens=MAX_NEW
    )
    out = distill_records(
        engine,
        renderer,
        convs,
        [renderer.prompt_ids(c) for c in convs],
        max_context=max_context,
        eos_ids=eos_ids,
        on_reply=lambda n, done: calls.append((n, done)),
    )
    assert len(calls) == sum(r.turns for r in out)
    assert sum(done for _, done in calls) == len(convs)
    assert sum(n for n, _ in calls) == sum(sum(r.loss_mask) for r in out)
    if max_context == 40:
        assert any(r.turns_dropped for r in out)  # the flag also comes when later turns are dropped


class _OneAtATime:
    """An :class:`Engine` that generates each request alone with ``model.generate``, newest first
    (follow-ups jump the queue, later requests wait): another order, no batching, same contract."""

    def __init__(self, model, tok, eos_ids: list[int]) -> None:
        self.model, self.tok, self.eos_ids = model, tok, eos_ids

    def run(self, requests: list[GenRequest], on_done) -> None:
        stack = list(requests)
        while stack:
            req = stack.pop()
            ids = torch.tensor([req.context])
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                eos_token_id=self.eos_ids,
                pad_token_id=self.tok.pad_token_id,
            )[0, len(req.context) :].tolist()
            end = next((i + 1 for i, t in enumerate(out) if t in self.eos_ids), len(out))
            follow = on_done(req, out[:end])
            if follow is not None:
                stack.append(follow)


def test_any_engine_drives_the_loop_to_the_same_records(tiny_backbone_dir) -> None:
    """distill_records talks to its engine only through ``Engine.run``: a different engine (unbatched,
    reversed order) gives the same greedy records as the in-process continuous batcher."""
    model, tok = load_backbone(str(tiny_backbone_dir), dtype="float32", device="cpu")
    renderer = ChatRenderer(tok)
    eos_ids = eos_token_ids(model, tok)
    words = ["cat", "dog", "mat"]
    convs = [Conversation(f"r{i}", [f"why is the {w} big?" for w in words[: 1 + i % 3]]) for i in range(6)]
    prompts = [renderer.prompt_ids(c) for c in convs]
    batched = ContinuousBatcher(
        model, batch_size=4, pad_id=tok.pad_token_id, eos_ids=eos_ids, max_new_tokens=MAX_NEW
    )
    a = distill_records(batched, renderer, convs, prompts, max_context=10_000, eos_ids=eos_ids)
    b = distill_records(
        _OneAtATime(model, tok, eos_ids), renderer, convs, prompts, max_context=10_000, eos_ids=eos_ids
    )
    assert [r.turns for r in a] == [len(c.turns) for c in convs] and sum(r.turns for r in a) > len(convs)
    assert [(r.input_ids, r.loss_mask, r.cut) for r in a] == [(r.input_ids, r.loss_mask, r.cut) for r in b]


class _NoSecondReply(_OneAtATime):
    """A text engine that cannot give any second reply exactly (``None``, as a server engine answers
    a reply that does not round-trip through the tokenizer)."""

    def run(self, requests: list[GenRequest], on_done) -> None:
        answered: set = set()

        def first_only(req: GenRequest, new):
            if req.key in answered:
                return on_done(req, None)
            answered.add(req.key)
            return on_done(req, new)

        super().run(requests, first_only)


def test_a_reply_a_text_engine_cannot_give_ends_the_record_after_the_last_reply(tiny_backbone_dir) -> None:
    """A second reply that comes back ``None``: the record ends with the first reply, as one whose
    second turn is dropped for the context limit does (not with the user turn left unanswered)."""
    model, tok = load_backbone(str(tiny_backbone_dir), dtype="float32", device="cpu")
    renderer = ChatRenderer(tok)
    eos_ids = eos_token_ids(model, tok)
    convs = [Conversation(f"r{i}", ["why is the cat big?", "and the dog?"]) for i in range(2)]
    prompts = [renderer.prompt_ids(c) for c in convs]
    full = distill_records(
        _OneAtATime(model, tok, eos_ids), renderer, convs, prompts, max_context=10_000, eos_ids=eos_ids
    )
    cut = distill_records(
        _NoSecondReply(model, tok, eos_ids), renderer, convs, prompts, max_context=10_000, eos_ids=eos_ids
    )
    for whole, r in zip(full, cut, strict=True):
        first_reply_end = len(r.input_ids)
        assert (r.turns, r.inexact) == (1, 1) and whole.turns == 2
        assert r.loss_mask[-1] == 1  # the record ends on a reply token
        assert (r.input_ids, r.loss_mask) == (
            whole.input_ids[:first_reply_end],
            whole.loss_mask[:first_reply_end],
        )
