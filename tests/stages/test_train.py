"""stage=train for real on CPU: tiny random Llama, synthetic distilled data, 6 optimizer steps."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from medusa_train import __version__
from medusa_train.__main__ import main
from medusa_train.backbone import load_configured_backbone, local_fingerprint
from medusa_train.data.distilled import load_distilled, split_heldout
from medusa_train.decoding import attention as attention_module
from medusa_train.decoding.attention import AttentionBackendError
from medusa_train.decoding.attention import function as attention_function
from medusa_train.decoding.attention.sdpa import sdpa_tree_attention
from medusa_train.decoding.calibrate import compute_head_accuracy
from medusa_train.errors import UserError
from medusa_train.heads import MedusaHeads
from medusa_train.stages import eval as eval_stage
from medusa_train.stages import train as train_stage
from medusa_train.stages.train import run
from medusa_train.training.trainer import MedusaTrainer
from tests.helpers.models import add_remote_code
from tests.helpers.syncs import record_syncs
from tests.helpers.train_workdir import (
    REPO,
    launch,
    make_train_workdir,
    run_killed_at_step,
    train_cfg,
    train_overrides,
    zero3_partitioning_everything,
)


def _heads_state(workdir: Path) -> dict[str, torch.Tensor]:
    return MedusaHeads.from_pretrained(workdir / "heads").heads.state_dict()


def _assert_heads_close(a: Path, b: Path, atol: float = 1e-6) -> None:
    sa, sb = _heads_state(a), _heads_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=atol, rtol=1e-5, msg=k)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """One uninterrupted online run, shared by the comparisons below."""
    root = make_train_workdir(tmp_path_factory.mktemp("ref"))
    return root, run(train_cfg(root))


def test_train_writes_heads_calibration_and_small_checkpoints(reference):
    root, result = reference
    assert result["steps"] == 6 and len(result["heldout_top1"]) == 3
    assert 0 < result["tree_size"] <= 6 and result["expected_tau"] >= 1.0
    assert all(0 <= a <= 1 for a in result["heldout_top1"] + result["train_top1"] + result["train_top5"])
    heads_dir = root / "heads"
    config = json.loads((heads_dir / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["base_model_name_or_path"] == str(root / "base_model")
    assert config["backbone"]["fingerprint"] and config["training"]["mode"] == "medusa1"
    assert config["medusa_train_version"] == __version__  # which medusa_train trained them
    calib = json.loads((heads_dir / "calibration.json").read_text())
    acc = calib["head_topk_accuracy"]
    assert len(acc) == 3 and all(len(r) == 10 and r == sorted(r) for r in acc)
    choices = json.loads((heads_dir / "medusa_choices.json").read_text())
    assert len(choices) == result["tree_size"]
    # Checkpoints hold the heads (+ optimizer/scheduler/rng), never the frozen backbone.
    ckpt = root / "train" / "checkpoint-6"
    assert all(k.startswith("heads.") for k in load_file(str(ckpt / "model.safetensors")))
    assert {"optimizer.pt", "scheduler.pt", "trainer_state.json"} <= {p.name for p in ckpt.iterdir()}
    assert not list(root.glob(".heads.tmp-*"))


def _heldout_top1(root: Path, heads: MedusaHeads, *overrides: str) -> torch.Tensor:
    """Held-out top-1 per head ``(K,)`` of ``heads`` over the run's backbone, on the held-out split."""
    cfg = train_cfg(root, *overrides)
    backbone, _ = load_configured_backbone(cfg.model, torch.device("cpu"))
    _, held = split_heldout(load_distilled(root / "distill"), cfg.data.eval_fraction)
    batches = [(torch.tensor([r["input_ids"]]), torch.tensor([r["loss_mask"]])) for r in held]
    return compute_head_accuracy(backbone, heads, batches, max_k=1)[:, 0]


def _assert_heads_learned(root: Path, result: dict, *overrides: str, margin: float = 0.3) -> None:
    """The trained heads beat their initialisation (every projection a copy of lm_head) on held-out
    records by ``margin`` for every head, and the stage reports that accuracy."""
    cfg = train_cfg(root, *overrides)
    backbone, _ = load_configured_backbone(cfg.model, torch.device("cpu"))
    init = MedusaHeads(backbone.config.hidden_size, backbone.config.vocab_size, cfg.training.num_heads, 1)
    init.init_from_lm_head(backbone.get_output_embeddings().weight.detach().float())
    before = _heldout_top1(root, init, *overrides)  # (K,)
    after = _heldout_top1(root, MedusaHeads.from_pretrained(root / "heads"), *overrides)  # (K,)
    assert (after > before + margin).all(), (before.tolist(), after.tolist())
    torch.testing.assert_close(torch.tensor(result["heldout_top1"]), after, atol=1e-3, rtol=0)


def test_the_heads_learn(reference):
    """6 steps lift held-out top-1 far above the lm_head-copy start (the data's next-but-one token
    follows from the current one; a copy of lm_head predicts the random backbone's next token)."""
    root, result = reference
    _assert_heads_learned(root, result)


def test_rerun_with_same_settings_skips(reference):
    root, result = reference
    mtime = (root / "heads" / "medusa_lm_head.safetensors").stat().st_mtime_ns
    again = run(train_cfg(root))
    assert again["skipped"] and again["steps"] == result["steps"]
    # Logging, checkpointing and the batch split (same global batch) do not change the heads.
    run_only = ("training.logging_steps=1", "training.save_steps=5", "training.per_device_batch_size=2")
    again = run(train_cfg(root, *run_only, "training.gradient_accumulation_steps=2"))
    assert again["skipped"] and "recalibrated" not in again
    assert (root / "heads" / "medusa_lm_head.safetensors").stat().st_mtime_ns == mtime


def test_changed_calibration_settings_rerun_only_the_calibration(reference, tmp_path, monkeypatch):
    ref_root, ref = reference
    root = tmp_path / "wd"
    shutil.copytree(ref_root, root)
    heads = root / "heads"
    weights = (heads / "medusa_lm_head.safetensors").read_bytes()
    before = json.loads((heads / "calibration.json").read_text())
    assert before["settings"]["tree_max_nodes"] == 6  # train_overrides

    def no_training(*args, **kwargs):
        raise AssertionError("the heads were retrained")

    monkeypatch.setattr(MedusaTrainer, "train", no_training)
    result = run(train_cfg(root, "tree.max_nodes=3"))
    assert result["skipped"] and result["recalibrated"] and result["steps"] == ref["steps"]
    assert 0 < result["tree_size"] <= 3
    assert len(json.loads((heads / "medusa_choices.json").read_text())) == result["tree_size"]
    after = json.loads((heads / "calibration.json").read_text())
    assert after["settings"]["tree_max_nodes"] == 3
    assert after["head_topk_accuracy"] == before["head_topk_accuracy"]  # same heads, backbone, records
    config = json.loads((heads / "config.json").read_text())
    assert config["training_result"]["tree_size"] == result["tree_size"]
    assert config["training"] == json.loads((ref_root / "heads" / "config.json").read_text())["training"]
    assert (heads / "medusa_lm_head.safetensors").read_bytes() == weights
    assert not list(root.glob(".heads*"))
    # Nothing changed since: skipped; decoding-only tree settings (tree=medusa63) do not recalibrate.
    mtime = (heads / "calibration.json").stat().st_mtime_ns
    for overrides in (("tree.max_nodes=3",), ("tree.max_nodes=3", "tree=medusa63", "stage=train")):
        again = run(train_cfg(root, *overrides))
        assert again["skipped"] and "recalibrated" not in again
    assert (heads / "calibration.json").stat().st_mtime_ns == mtime
    # Fewer calibration records: the accuracy table is measured again too.
    result = run(train_cfg(root, "tree.max_nodes=3", "training.calibration_max_records=2"))
    assert result["recalibrated"] and json.loads((heads / "calibration.json").read_text())["records"] == 2
    # Another tolerance: the same accuracy table, the tree chosen again (the smallest within 100% - 1e-9: one node).
    result = run(
        train_cfg(root, "tree.max_nodes=3", "training.calibration_max_records=2", "tree.tolerance=0.999999")
    )
    assert result["recalibrated"] and result["tree_size"] == 1
    assert json.loads((heads / "calibration.json").read_text())["settings"]["tree_tolerance"] == 0.999999


def test_the_calibration_times_the_tree_attention_eval_decodes_with(reference, tmp_path, monkeypatch):
    """eval.attention=triton: the calibration's timed tree forwards run the Triton kernel's entry (the
    SDPA reference stands in for its body; triton taken as installed, its interpreter as on) and
    calibration.json records it; the default's records SDPA. An attention that cannot run here is
    refused before any work, naming eval.attention."""
    ref_root, _ = reference
    assert _calibrated_for(ref_root)["attention"] == "sdpa"
    root = tmp_path / "wd"
    shutil.copytree(ref_root, root)
    nodes: list[int] = []

    def kernel(query, *args, **kwargs):
        nodes.append(query.shape[2])  # (B, Hq, M, D)
        return sdpa_tree_attention(query, *args, **kwargs)

    def no_training(*args, **kwargs):
        raise AssertionError("the heads were retrained")

    monkeypatch.setattr(MedusaTrainer, "train", no_training)
    monkeypatch.setattr(attention_module, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(attention_function, "triton_tree_attention", kernel)
    result = run(train_cfg(root, "tree.max_nodes=3", "eval.attention=triton"))  # recalibrates only
    assert result["recalibrated"] and _calibrated_for(root)["attention"] == "triton"
    timed = {int(n) for n in json.loads((root / "heads" / "calibration.json").read_text())["latency"]}
    assert set(nodes) == timed
    with pytest.raises(AttentionBackendError, match="eval.attention=cuda.*CUDA device"):
        run(train_cfg(root, "eval.attention=cuda"))
    # a kernel that cannot compute the backbone's attention: refused once it is loaded, before training
    monkeypatch.setattr(
        attention_module, "kernel_refusal", lambda model, backend: "its layers do something else"
    )
    with pytest.raises(AttentionBackendError, match="eval.attention=triton.*do something else"):
        run(train_cfg(root, "eval.attention=triton", "training.overwrite=true"))


def _calibrated_for(root: Path) -> dict:
    return json.loads((root / "heads" / "calibration.json").read_text())["tree"]["calibrated_for"]


@pytest.mark.parametrize(("cache", "damage"), [("false", "truncated"), ("true", "emptied")])
def test_killed_run_resumes_to_same_steps_and_heads(reference, tmp_path, monkeypatch, caplog, cache, damage):
    """Killed at step 5 with checkpoints at steps 2 and 4, each flushed to disk when saved: with
    checkpoint-4's optimizer.pt then cut short or emptied (a power loss, a full disk) and a newer
    folder a kill while saving left, the same command resumes from checkpoint-2 (one warning for
    each folder skipped) and ends with the uninterrupted run's steps and heads."""
    ref_root, ref = reference
    root = make_train_workdir(tmp_path)
    overrides = (f"training.cache_hidden_states={cache}", "training.save_steps=2")
    events = record_syncs(monkeypatch)
    run_killed_at_step(train_cfg(root, *overrides), monkeypatch, step=5)
    train_dir = (root / "train").resolve()
    saved = [train_dir / "checkpoint-2", train_dir / "checkpoint-4"]
    synced = {path for kind, path, _ in events if kind == "fsync"}
    assert {p for c in saved for p in [c, *c.rglob("*")]} | {train_dir} <= synced
    assert not (root / "heads").exists()
    optimizer = saved[1] / "optimizer.pt"
    optimizer.write_bytes(
        optimizer.read_bytes()[: optimizer.stat().st_size // 2] if damage == "truncated" else b""
    )
    # A kill while saving leaves a newer folder without trainer_state.json: it must be ignored.
    partial = root / "train" / "checkpoint-5"
    partial.mkdir()
    shutil.copy(saved[0] / "model.safetensors", partial / "model.safetensors")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="medusa_train.training.trainer"):
        result = run(train_cfg(root, *overrides))
    assert result["resumed_from"].endswith("checkpoint-2") and result["steps"] == ref["steps"] == 6
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ignoring checkpoint")]
    assert len(skipped) == 2 and "checkpoint-5: incomplete" in skipped[0], skipped
    assert skipped[1].startswith(
        f"ignoring checkpoint {root / 'train' / 'checkpoint-4'}: optimizer.pt is damaged"
    )
    _assert_heads_close(root, ref_root, atol=1e-5)


def test_cached_hidden_states_equal_online(reference, tmp_path, monkeypatch):
    """The cache, built by global rank 0 while every other rank waits (``local=False``: on several
    nodes too), under the long collective timeout; the heads trained from it equal online training;
    a gc pass frees what training left before calibration (without DeepSpeed too)."""
    from transformers import TrainingArguments

    waits = []
    first = TrainingArguments.main_process_first

    def recorded(self, local=True, desc="work"):
        waits.append((local, self.ddp_timeout))
        return first(self, local=local, desc=desc)

    monkeypatch.setattr(TrainingArguments, "main_process_first", recorded)
    import medusa_train.stages.train as train_stage

    collected = []
    monkeypatch.setattr(train_stage.gc, "collect", lambda *a: collected.append(1) or 0)
    ref_root, ref = reference
    root = make_train_workdir(tmp_path)
    result = run(train_cfg(root, "training.cache_hidden_states=true"))
    assert waits == [(False, 7 * 24 * 3600)]
    assert collected  # what training left is freed before calibration, without DeepSpeed too
    assert (root / "train" / "hidden_cache" / "meta.json").is_file()
    assert result["final_loss"] == pytest.approx(ref["final_loss"], abs=1e-4)
    _assert_heads_close(root, ref_root, atol=1e-5)


def test_gradient_accumulation_trains_the_heads_of_one_big_batch(reference, tmp_path):
    """2 records x 2 accumulation steps train the heads of 4 records x 1 (the global batch is the
    setting; the split is run-only): the records have different lengths, so the micro-batches hold
    different numbers of targets and a mean of their means would weigh those tokens unequally."""
    ref_root, ref = reference
    root = make_train_workdir(tmp_path)
    result = run(
        train_cfg(root, "training.per_device_batch_size=2", "training.gradient_accumulation_steps=2")
    )
    assert result["steps"] == ref["steps"] == 6
    assert result["final_loss"] == pytest.approx(ref["final_loss"], abs=1e-4)
    _assert_heads_close(root, ref_root, atol=1e-5)


@pytest.mark.parametrize("ending", ["max_steps", "time_budget"])
def test_the_result_reports_the_last_step(tmp_path, monkeypatch, ending):
    """``final_loss`` and the per-head figures are those of the last step, when it is no multiple of
    ``logging_steps`` (2): 5 steps, or a stop by the time budget after step 3 (a fake clock, 60 s a
    step). Step 3 counted no top-k (not a logging step): its log has none, and ``train_top1`` is the
    last that was counted (step 2's), not 0."""
    import medusa_train.training.trainer as trainer_module

    logged = {}
    log = MedusaTrainer.log

    def recorded(self, logs, start_time=None):
        log(self, logs, start_time)  # adds the per-head figures to ``logs``
        if "loss" in logs:
            logged[self.state.global_step] = dict(logs)

    monkeypatch.setattr(MedusaTrainer, "log", recorded)
    overrides = ["training.max_steps=5", "training.save_steps=100"]
    if ending == "time_budget":
        clock = iter(range(0, 6000, 60))
        monkeypatch.setattr(trainer_module, "time", SimpleNamespace(time=lambda: float(next(clock))))
        overrides = ["training.max_minutes=2.5", "training.save_steps=100"]
    root = make_train_workdir(tmp_path)
    result = run(train_cfg(root, *overrides, "tree.max_nodes=2"))
    last = 5 if ending == "max_steps" else 3
    assert result["steps"] == last and result["stopped_by_time_budget"] == (ending == "time_budget")
    assert sorted(logged) == [2, 4, 5] if ending == "max_steps" else [2, 3]
    assert result["final_loss"] == round(logged[last]["loss"], 5)
    counted = last if ending == "max_steps" else 2
    assert "head1/top1" in logged[counted] and ("head1/top1" in logged[last]) == (counted == last)
    assert result["train_top1"] == [logged[counted][f"head{k}/top1"] for k in (1, 2, 3)]
    assert result["train_top5"] == [logged[counted][f"head{k}/top5"] for k in (1, 2, 3)]


def test_soft_head_loss_trains_from_the_cache(tmp_path):
    """head_loss=kl from the hidden-state cache: the heads' KL to the backbone's distribution falls."""
    root = make_train_workdir(tmp_path)
    overrides = ("training.head_loss=kl", "training.cache_hidden_states=true", "training.logging_steps=1")
    result = run(train_cfg(root, *overrides, "training.max_steps=12", "training.save_steps=12"))
    assert json.loads((root / "train" / "hidden_cache" / "meta.json").read_text())["soft"] is True
    state = json.loads((root / "train" / "checkpoint-12" / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == 12 and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses
    assert result["final_loss"] == pytest.approx(losses[-1], abs=1e-4)


@pytest.mark.parametrize("cache", ["false", "true"])
def test_medusa1_trains_the_heads_of_llama4(tmp_path, cache):
    """Llama 4, whose ``get_decoder()`` is its causal LM itself (the output has logits, no
    ``last_hidden_state``): the heads train on what its LM head reads, online and from the hidden-state
    cache, learn, and the tree is calibrated on their held-out accuracy."""
    root = make_train_workdir(tmp_path, arch="llama4")
    result = run(train_cfg(root, f"training.cache_hidden_states={cache}"))
    assert result["steps"] == 6 and 0 < result["tree_size"] <= 6
    _assert_heads_learned(root, result)


def _with_chat_template(backbone_dir: Path) -> None:
    """The tokenizer in ``backbone_dir`` given a chat template, which stage=eval renders prompts with."""
    tokenizer = AutoTokenizer.from_pretrained(backbone_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(backbone_dir)


@pytest.mark.parametrize(("arch", "cache"), [("electra", "false"), ("rembert", "true")])
def test_medusa1_trains_heads_over_a_prediction_head_of_another_width(tmp_path, arch, cache):
    """ELECTRA's and RemBERT's causal LMs map the decoder's 32-wide last hidden state through a
    prediction head to 16 before their LM head. The heads read that last hidden state, online and from
    the hidden-state cache, their projections starting random (``init_from_lm_head=false``: the LM head
    reads other vectors): 32-wide heads train, learn (chance is 1/64), and stage=eval decodes with them
    what plain greedy decodes."""
    root = make_train_workdir(tmp_path, arch=arch)
    overrides = (
        "training.init_from_lm_head=false",
        f"training.cache_hidden_states={cache}",
        "training.max_steps=24",
        "training.lr=3e-2",
    )
    result = run(train_cfg(root, *overrides))
    assert result["steps"] == 24 and min(result["heldout_top1"]) > 0.4, result["heldout_top1"]
    assert MedusaHeads.from_pretrained(root / "heads").hidden_size == 32
    _with_chat_template(root / "base_model")
    assert eval_stage.run(train_cfg(root, "stage=eval", *overrides))["greedy_identical"] == 1.0


def test_medusa1_trains_heads_over_the_last_hidden_state_opt350m_projects(tmp_path):
    """OPT-350m's decoder projects its last hidden state to half the hidden size, 16 of 32 here, which
    its LM head reads: heads 16 wide, their projections copied from that LM head, train (built at the
    config's hidden_size they were refused)."""
    root = make_train_workdir(tmp_path, arch="opt350m")
    assert run(train_cfg(root))["steps"] == 6
    assert MedusaHeads.from_pretrained(root / "heads").hidden_size == 16


# -- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("recorded", "message"),
    [
        ("v2-0123456789abcdef", "distilled from another backbone"),
        # a fingerprint of an earlier medusa_train (other bytes of the files, or of a model's tensors): not
        # "another backbone", and not said to be of the files
        (
            "0123456789abcdef",
            "fingerprint an earlier medusa_train computed from other bytes than this version reads: run "
            "stage=distill with distill.overwrite=true",
        ),
    ],
)
def test_distill_from_another_backbone_is_refused(tmp_path, recorded: str, message: str):
    root = make_train_workdir(tmp_path)
    manifest = json.loads((root / "distill" / "manifest.json").read_text())
    manifest["backbone"]["fingerprint"] = recorded
    (root / "distill" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=message):
        run(train_cfg(root))
    assert not (root / "heads").exists() and not (root / "train").exists()


def test_distill_with_the_other_trust_remote_code_is_refused_as_that(tmp_path):
    """The same backbone distilled with model.trust_remote_code=true (the remote code its config.json's
    auto_map names counted in the fingerprint) and trained without it: the refusal names the setting,
    not "another backbone" named twice."""
    root = make_train_workdir(tmp_path)
    backbone = root / "base_model"
    add_remote_code(backbone)
    manifest = json.loads((root / "distill" / "manifest.json").read_text())
    manifest["backbone"]["fingerprint"] = local_fingerprint(str(backbone), trust_remote_code=True)
    (root / "distill" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError) as err:
        run(train_cfg(root))
    assert str(err.value) == (
        f"{root / 'distill'} was distilled from {backbone} with model.trust_remote_code=true and this run sets "
        "model.trust_remote_code=false (the remote code its config.json's auto_map names counts only with "
        "it): set model.trust_remote_code=true as that run did, or run stage=distill with "
        "distill.overwrite=true to distill again"
    )
    assert not (root / "heads").exists() and not (root / "train").exists()


def test_everything_held_out_is_refused(tmp_path):
    root = make_train_workdir(tmp_path, n_records=4)
    with pytest.raises(UserError, match="no training data"):
        run(train_cfg(root, "data.eval_fraction=0.999"))
    assert not (root / "heads").exists()


def test_init_heads_of_another_backbone_is_refused(tmp_path):
    root = make_train_workdir(tmp_path)
    MedusaHeads(48, 64, 3, 1).save_pretrained(tmp_path / "other_heads")
    with pytest.raises(UserError, match="another backbone"):
        run(train_cfg(root, f"training.init_heads={tmp_path / 'other_heads'}"))
    assert not (root / "heads").exists()


@pytest.mark.parametrize("damage", ["missing", "no weights", "weights cut short"])
def test_init_heads_that_cannot_load_are_refused_before_the_backbone_loads(tmp_path, monkeypatch, damage):
    """A mistyped or damaged training.init_heads was found only after the backbone had loaded (minutes
    for a large one): now in step 1, from its files' headers."""
    root = make_train_workdir(tmp_path)
    heads_dir = tmp_path / "init_heads"
    if damage != "missing":
        MedusaHeads(32, 64, 3, 1).save_pretrained(heads_dir)
        weights = heads_dir / "medusa_lm_head.safetensors"
        if damage == "no weights":
            weights.unlink()
        else:
            weights.write_bytes(weights.read_bytes()[:-8])
    loads: list = []
    monkeypatch.setattr(train_stage, "load_configured_backbone", lambda *a, **k: loads.append(a))
    with pytest.raises(UserError, match="training.init_heads: ") as err:
        run(train_cfg(root, f"training.init_heads={heads_dir}"))
    assert str(heads_dir) in str(err.value) and not loads
    assert not (root / "heads").exists() and not (root / "train").exists()


def test_a_backbone_no_tree_decoder_verifies_is_refused_before_training(tmp_path, monkeypatch):
    """A backbone that keeps a recurrent state (the tiny Llama marked stateful, as transformers marks RWKV
    and xLSTM): no tree decoder can verify its trees, so heads trained on it could never be used; it is
    refused in one line as soon as it is loaded, before any forward and before training."""
    root = make_train_workdir(tmp_path)
    forwards: list = []
    load = train_stage.load_configured_backbone

    def stateful(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        model._is_stateful = True
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
        return model, tokenizer

    monkeypatch.setattr(train_stage, "load_configured_backbone", stateful)
    with pytest.raises(
        AttentionBackendError, match=r"LlamaForCausalLM \(llama\) keeps a recurrent state"
    ) as err:
        run(train_cfg(root))
    assert "model.generate" in str(err.value) and "\n" not in str(err.value)
    assert not str(err.value).startswith("eval.attention")  # no attention setting would serve it
    assert not forwards and not (root / "heads").exists() and not (root / "train").exists()


def test_a_backbone_without_one_language_model_under_its_lm_head_is_refused_before_training(
    tmp_path, capsys, monkeypatch
):
    """The heads read the last_hidden_state of the one language model under the LM head
    (``head_targets.language_model``); a causal LM whose ``get_decoder()`` is itself and that holds two
    models has none: refused in one line, exit code 2, as soon as it is loaded, before any forward and
    before anything is written."""
    root = make_train_workdir(tmp_path)
    forwards: list = []
    load = train_stage.load_configured_backbone

    def two_models(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        model.get_decoder = lambda: model
        model.other = copy.deepcopy(model.model)
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
        return model, tokenizer

    monkeypatch.setattr(train_stage, "load_configured_backbone", two_models)
    capsys.readouterr()
    code = main(train_overrides(root, "stage=train"))
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # after the loading progress bar
    assert code == 2 and "Traceback" not in err, err
    assert line.startswith("error: LlamaForCausalLM (llama): medusa_train cannot train or score Medusa heads")
    assert "2 models inside (LlamaModel, LlamaModel)" in line and "report the architecture" in line
    assert not forwards and not (root / "heads").exists() and not (root / "train").exists()


def test_resuming_checkpoints_of_other_settings_is_refused(tmp_path):
    root = make_train_workdir(tmp_path)
    (root / "train").mkdir()
    info = {"settings": {"num_heads": 5}, "backbone": {}}
    (root / "train" / "run.json").write_text(json.dumps(info))
    with pytest.raises(UserError, match="checkpoints of another run"):
        run(train_cfg(root))


def _logits_scaled_after_lm_head(monkeypatch) -> None:
    """The Llama forward with a step after lm_head that ``head_targets.logit_map`` does not know."""
    original = LlamaForCausalLM.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.logits = out.logits * 4.0
        return out

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)


@pytest.mark.parametrize(
    ("overrides", "reader"),
    [
        (("training.head_loss=kl",), "the soft head targets of training.head_loss=kl"),
        (("training=medusa2", "training.lm_loss=ce"), "Medusa-2's LM loss (training.lm_loss=ce)"),
    ],
)
def test_a_loss_reading_logits_the_backbone_changes_unknown_after_lm_head_is_refused(
    tmp_path, capsys, monkeypatch, overrides, reader
):
    """Soft head targets and Medusa-2's LM loss read ``logit_map(lm_head(h))``; a backbone whose forward
    changes its logits in a way the map does not know is refused in one line before any training."""
    root = make_train_workdir(tmp_path)
    _logits_scaled_after_lm_head(monkeypatch)
    capsys.readouterr()
    code = main(train_overrides(root, "stage=train", *overrides))
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # after the loading progress bar
    assert code == 2 and "Traceback" not in err, err
    assert line.startswith("error: LlamaForCausalLM (llama): its forward changes its logits after lm_head")
    assert reader in line and "report the architecture" in line
    assert not (root / "heads").exists() and not (root / "train").exists()


_OVER_ELECTRA = (
    "ElectraForCausalLM (electra): its LM head reads 16-wide vectors, not its decoder's 32-wide last hidden "
    "state, the heads' input (a prediction head sits between the two), so "
)


@pytest.mark.parametrize(
    ("arch", "overrides", "line"),
    [
        (
            "electra",
            (),
            _OVER_ELECTRA
            + "training.init_from_lm_head=true (which copies it into the heads) would apply the LM "
            "head to vectors it does not read: set training.init_from_lm_head=false",
        ),
        (
            "electra",
            ("training.head_projection=shared",),
            _OVER_ELECTRA
            + "training.head_projection=shared (whose heads project with it) would apply the LM "
            "head to vectors it does not read: use training.head_projection=own",
        ),
        (
            "electra",
            ("training.init_from_lm_head=false", "training.head_loss=kl"),
            _OVER_ELECTRA
            + "the soft head targets of training.head_loss=kl would apply the LM head to vectors "
            "it does not read: train on hard targets (training.head_loss=ce)",
        ),
        (
            "modernbert_decoder",
            ("training=medusa2", "training.lm_loss=ce"),
            "ModernBertDecoderForCausalLM (modernbert-decoder): its LM head reads other vectors than its "
            "decoder's last hidden state, the heads' input (a prediction head sits between the two), so "
            "Medusa-2's LM loss (training.lm_loss=ce) would apply the LM head to vectors it does not read: "
            "train Medusa-1 heads on hard targets (training=medusa1 training.head_loss=ce)",
        ),
    ],
)
def test_what_reads_the_lm_head_over_a_prediction_head_is_refused_before_anything_is_written(
    tmp_path, capsys, arch, overrides, line
):
    """ELECTRA's LM head reads a prediction head's 16-wide output, not the 32-wide state the heads read:
    heads copied from it (the default) or projecting with it cannot be; soft targets and Medusa-2's LM
    loss read it over vectors it is not made for, there and over ModernBERT's decoder's prediction head
    (of the last hidden state's own width).
    Refused in one line, exit 2, saying what to set instead, before anything is written (a
    copy went unnoticed; the other widths failed in the heads' check or in a traceback)."""
    root = make_train_workdir(tmp_path, arch=arch)
    capsys.readouterr()
    code = main(train_overrides(root, "stage=train", *overrides))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"error: {line}"  # after the loading progress bar
    assert not (root / "heads").exists() and not (root / "train").exists()


def test_heads_copied_from_an_lm_head_over_a_prediction_head_of_their_width_train(tmp_path):
    """ModernBERT's decoder: its LM head reads a prediction head's output as wide as the last hidden
    state the heads read. Heads copied from it (the default) start there and train, as before (only
    what needs the LM head to read ``h`` itself is refused: above)."""
    root = make_train_workdir(tmp_path, arch="modernbert_decoder")
    assert main(train_overrides(root, "stage=train")) == 0
    assert (root / "heads" / "config.json").is_file()


def test_medusa2_over_a_prediction_head_of_another_width_is_refused_under_zero3(tmp_path, monkeypatch):
    """Under ZeRO-3 Medusa-2's backbone loads partitioned, where no forward checks what its LM head
    reads: ELECTRA's reads a 16-wide prediction head's output, which the LM head's partitioned weight's
    whole shape says. Refused in that one line before anything is written (a traceback in the training
    forward before)."""
    root = make_train_workdir(tmp_path, arch="electra")
    with zero3_partitioning_everything(monkeypatch), pytest.raises(UserError) as err:
        run(train_cfg(root, "training=medusa2", "deepspeed=zero3", "training.init_from_lm_head=false"))
    assert str(err.value) == (
        _OVER_ELECTRA + "Medusa-2's LM loss (training.lm_loss=ce) would apply the LM head to vectors it "
        "does not read: train Medusa-1 heads on hard targets (training=medusa1 training.head_loss=ce)"
    )
    assert not (root / "heads").exists() and not (root / "train").exists()


def test_hard_targets_train_over_logits_the_backbone_changes_after_lm_head(tmp_path, monkeypatch):
    """``training.head_loss=ce`` reads no distribution (decoding and calibration read the forward's
    logits or a top-k): the same backbone trains."""
    root = make_train_workdir(tmp_path)
    _logits_scaled_after_lm_head(monkeypatch)
    assert run(train_cfg(root, "training.max_steps=2", "training.save_steps=2"))["steps"] == 2


def test_checkpoints_of_the_finished_run_are_named_as_such(tmp_path):
    """After a run that ended (its heads published), other settings met "run with the old values to
    resume them": there was nothing to resume, and those values skip training."""
    root = make_train_workdir(tmp_path)
    old = {"num_heads": 5}
    (root / "train").mkdir()
    (root / "train" / "run.json").write_text(json.dumps({"settings": old, "backbone": {}}))
    (root / "heads").mkdir()
    (root / "heads" / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "training": old}))
    with pytest.raises(UserError, match="checkpoints of the finished run that trained the heads in") as err:
        run(train_cfg(root))
    assert "resume them" not in str(err.value) and "pass training.overwrite=true" in str(err.value)


def test_cli_offload_on_cpu_is_one_line_exit_2(tmp_path, capsys):
    root = make_train_workdir(tmp_path)
    capsys.readouterr()
    code = main(train_overrides(root, "stage=train", "deepspeed=zero3", "deepspeed.offload_optimizer=true"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "offload" in err[0]
    assert not (root / "heads").exists()


# -- multi-process -----------------------------------------------------------------------------------
@pytest.mark.distributed
def test_two_process_zero2_equals_one_process(tmp_path):
    """2 ranks x batch 2 (ZeRO-2, the ``deepspeed`` launcher) == 1 process x batch 2 x 2 accumulation
    steps: same global batch. (torchrun launches the Medusa-2 runs of test_medusa2.py; the Medusa-1 run
    under torchrun passed too and was left out for CI time.)"""
    one = make_train_workdir(tmp_path / "one")
    ref = run(train_cfg(one, "training.per_device_batch_size=2", "training.gradient_accumulation_steps=2"))
    two = tmp_path / "two"
    two.mkdir()
    make_train_workdir(two)
    shutil.rmtree(two / "distill")
    shutil.copytree(one / "distill", two / "distill")
    args = train_overrides(two, "stage=train", "deepspeed=zero2", "training.per_device_batch_size=2")
    bindir = Path(sys.executable).parent
    cmd = [str(bindir / "deepspeed"), "--num_gpus", "2", "--master_port", "29631", "--module", "medusa_train"]
    cmd += args
    launch(cmd)
    result = json.loads((two / "heads" / "config.json").read_text())["training_result"]
    assert result["steps"] == 6 and result["final_loss"] == pytest.approx(ref["final_loss"], abs=1e-4)
    _assert_heads_close(two, one, atol=1e-5)


@pytest.mark.distributed
def test_a_deepspeed_checkpoint_of_two_ranks_resumed_in_one_process_is_one_line_exit_2(tmp_path, capsys):
    """ZeRO saves its optimizer state one file per rank, and DeepSpeed loads it only on as many ranks
    (on another count it stops inside the Trainer's resume, a ZeRORuntimeException and its
    traceback): 2 ranks' checkpoint resumed in 1 process with the same global batch is refused
    before training, in one line naming both counts (no traceback), exit 2; the checkpoint is kept."""
    root = make_train_workdir(tmp_path)
    per_rank = ("stage=train", "deepspeed=zero2", "training.per_device_batch_size=2", "training.max_steps=3")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    launch(
        [torchrun, "--nproc_per_node", "2", "--master_port", "29637", "-m", "medusa_train"]
        + train_overrides(root, *per_rank)
    )
    shutil.rmtree(root / "heads")  # as a launch stopped after its checkpoint leaves the workdir
    capsys.readouterr()
    code = main(train_overrides(root, *per_rank, "training.gradient_accumulation_steps=2"))
    err = capsys.readouterr().err  # the error's line last (the backbone's loading bar before it)
    assert code == 2 and "Traceback" not in err, err
    assert "by 2 DeepSpeed rank(s) and this launch has 1" in err.strip().splitlines()[-1]
    assert (root / "train" / "checkpoint-3" / "trainer_state.json").is_file()
    assert not (root / "heads").exists()


def test_single_process_zero3_with_partitioned_heads_equals_plain(reference, tmp_path, monkeypatch):
    """No launcher needed; heads really partitioned (persistence threshold 0), gathered at the end."""
    ref_root, ref = reference
    root = make_train_workdir(tmp_path)
    with zero3_partitioning_everything(monkeypatch):
        result = run(train_cfg(root, "deepspeed=zero3"))
    assert result["steps"] == 6 and result["final_loss"] == pytest.approx(ref["final_loss"], abs=1e-4)
    _assert_heads_close(root, ref_root, atol=1e-5)


def _process_group_threads() -> int:
    """Threads of gloo process groups and their TCP store in this process (Linux: by thread name)."""
    names = []
    for task in Path("/proc/self/task").glob("*"):
        with contextlib.suppress(OSError):
            names.append((task / "comm").read_text().strip())
    return sum("gloo" in n or "tcpstore" in n for n in names)


@pytest.mark.parametrize(
    "overrides",
    [
        ("deepspeed=zero2",),
        ("deepspeed=zero3",),
        ("deepspeed=zero2", "training=medusa2"),
        ("deepspeed=zero3", "training=medusa2"),
    ],
)
def test_an_in_process_deepspeed_run_releases_its_engine(tmp_path, overrides):
    """After a ZeRO-2 / ZeRO-3 (Medusa-1, Medusa-2) stage=train in this process, DeepSpeed's engine,
    its optimizer and the (ZeRO-3: partitioned) parameters are gone: the optimizer state would
    otherwise hold memory through the stages after it (``stage=all``). The process groups' threads
    are gone as soon as the stage returns, before any gc pass of ours: a process exiting under them
    can abort after its work is done."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def alive() -> int:
        gc.collect()
        kinds = (DeepSpeedEngine, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)
        return sum(
            isinstance(o, kinds) or (isinstance(o, torch.Tensor) and hasattr(o, "ds_id"))
            for o in gc.get_objects()
        )

    before, threads = alive(), _process_group_threads()
    root = make_train_workdir(tmp_path)
    assert run(train_cfg(root, *overrides))["steps"] == 6
    if Path("/proc/self/task").is_dir():
        assert _process_group_threads() <= threads
    assert alive() == before


@pytest.mark.parametrize("quantization", ["8bit", "4bit"])
def test_quantized_frozen_backbone_trains_heads(tmp_path, quantization):
    """Medusa-1 over an 8-bit / 4-bit (nf4) bitsandbytes backbone: the distilled data of the same
    checkpoint is accepted (identity follows the files, not the load dtype) and the heads learn."""
    pytest.importorskip("bitsandbytes")
    # bitsandbytes' 4-bit CPU kernel needs every quantized row to span whole 64-value blocks
    root = make_train_workdir(tmp_path / quantization, hidden=64, kv_heads=4)
    backbone_files = {p.name: p.read_bytes() for p in (root / "base_model").iterdir() if p.is_file()}
    overrides = (f"model.quantization={quantization}", "training.max_steps=12")
    result = run(train_cfg(root, *overrides))
    assert result["steps"] == 12
    _assert_heads_learned(root, result, *overrides)
    # the frozen checkpoint on disk is untouched
    assert {p.name: p.read_bytes() for p in (root / "base_model").iterdir() if p.is_file()} == backbone_files


_DIES_AT_STEP = """
import os, signal, sys
from medusa_train.__main__ import main
from medusa_train.training.trainer import MedusaTrainer
step, original = int(sys.argv[1]), MedusaTrainer.training_step
def dies(self, *args, **kwargs):
    if self.state.global_step >= step:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, *args, **kwargs)
MedusaTrainer.training_step = dies
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_sigkill_mid_training_then_same_command_finishes(tmp_path):
    """A real SIGKILL (no cleanup runs), sent by the training process to itself once 10 optimizer
    steps are done (checkpoints every 3 steps: checkpoint-9 is the last complete one): the same
    command resumes from it and ends at the configured step count with the heads an uninterrupted
    run gets."""
    import signal

    steps = "training.max_steps=30"
    ref_root = make_train_workdir(tmp_path / "ref")
    root = make_train_workdir(tmp_path / "killed")
    args = ["stage=train", *train_overrides(root, steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [sys.executable, "-c", _DIES_AT_STEP, "10", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (root / "train" / "checkpoint-9" / "trainer_state.json").is_file()
    assert not (root / "heads").exists(), "a killed run must not leave final heads"
    cmd = [sys.executable, "-m", "medusa_train", *args]
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    config = json.loads((root / "heads" / "config.json").read_text())
    assert config["training_result"]["steps"] == 30
    assert config["training_result"]["resumed_from"].endswith("checkpoint-9")
    run(train_cfg(ref_root, steps))
    _assert_heads_close(root, ref_root, atol=1e-5)


def test_the_trainer_stays_on_the_stages_one_device():
    """One process seeing several GPUs: the Trainer is told it has one (no DataParallel, whose copies
    would read the frozen backbone left on the first GPU); a model.device the Trainer does not train
    on is refused in one line. (The GPU cases only as arguments here: no GPU.)"""
    from types import SimpleNamespace

    from medusa_train.stages.train import one_device_per_process

    args = SimpleNamespace(n_gpu=2, device=torch.device("cuda", 0))
    one_device_per_process(args, torch.device("cuda", 0))
    assert args._n_gpu == 1
    with pytest.raises(
        UserError, match="model.device=cuda:1 but stage=train in one process trains on cuda:0"
    ):
        one_device_per_process(
            SimpleNamespace(n_gpu=1, device=torch.device("cuda", 0)), torch.device("cuda", 1)
        )
    cpu = SimpleNamespace(n_gpu=0, device=torch.device("cpu"))
    one_device_per_process(cpu, torch.device("cpu"))
    assert not hasattr(cpu, "_n_gpu")


def test_the_heads_record_the_base_models_revision(tmp_path):
    """model.revision (a Hub branch, tag or commit) is recorded with the heads' backbone identity, so the
    export's card names it; the identity runs compare (run.json) stays the files' fingerprint alone."""
    root = make_train_workdir(tmp_path)
    run(train_cfg(root, "model.revision=v1.0", "training.max_steps=2", "training.save_steps=2"))
    recorded = json.loads((root / "heads" / "config.json").read_text())["backbone"]
    compared = json.loads((root / "train" / "run.json").read_text())["backbone"]
    assert recorded == {**compared, "revision": "v1.0"}
