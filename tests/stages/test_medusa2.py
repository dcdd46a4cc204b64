"""training=medusa2 end to end on CPU: train (full tuning, LoRA) -> export -> eval use the TRAINED backbone.

The workdir: the chat-template tiny Llama of tests/conftest.py (eval renders prompts with it) and the
synthetic distilled records of tests/helpers/train_workdir.py (``x_{t+1} = x_t + 1``, which the random backbone
does not know, so joint training visibly changes it). 6 optimizer steps; the in-memory training
module is captured from ``Medusa2Recipe.training_module`` to compare against what export and eval load from disk.
The last tests use the plain tests/helpers/train_workdir.py backbone with tied embeddings (checkpoints, resume;
DeepSpeed ZeRO-2 with 2 ranks and ZeRO-3 with every parameter partitioned against one plain process),
and bf16 DeepSpeed runs (untied) whose published weights must be DeepSpeed's fp32 master weights;
QLoRA (bitsandbytes 4-bit / 8-bit) under DeepSpeed over a wider untied backbone (4-bit CPU blocks
span 64 values).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from medusa_train.backbone import load_backbone, load_tokenizer, load_trained_backbone
from medusa_train.data.chat import ChatRenderer, eos_token_ids
from medusa_train.data.distilled import load_distilled, split_heldout
from medusa_train.formats import load_heads
from medusa_train.head_targets import last_hidden_state
from medusa_train.stages import eval as eval_stage
from medusa_train.stages import export, train
from medusa_train.training.recipes import Medusa2Recipe
from medusa_train.training.trainer import TrackerCallback
from tests.helpers.models import build_tiny_backbone
from tests.helpers.train_workdir import (
    launch,
    make_records,
    make_train_workdir,
    run_killed_at_step,
    train_cfg,
    train_overrides,
    write_distill,
    zero3_partitioning_everything,
)

EVAL = ("eval.acceptance_extra=false", "eval.sweep_tree_sizes=[]")  # greedy parity only: fast
TUNING = {
    # full: heads-only phase, then joint training with a linear lambda0 warm-up, logged every step
    "full": (
        "training.lm_loss=ce",
        "training.heads_only_steps=2",
        "training.lambda_warmup=linear",
        "training.lambda_warmup_steps=2",
        "training.logging_steps=1",
    ),
    "lora": ("training.backbone_tuning=lora", "training.lm_loss=kl", "training.lambda_warmup=constant"),
}


def _cfg(root: Path, tuning: str, *extra: str):
    return train_cfg(root, "training=medusa2", *TUNING[tuning], *EVAL, *extra)


IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 250, 11]])  # (1, 8)


@dataclass
class Medusa2Run:
    root: Path
    tuning: str
    module: torch.nn.Module  # the training module as training left it (backbone + heads, in memory)
    trained_logits: torch.Tensor  # (1, 8, V) on IDS of the backbone as training left it (LoRA: unmerged)
    calibrated: torch.nn.Module  # the backbone stage=train calibrated the tree on
    calibrated_logits: torch.Tensor  # (1, 8, V) its logits on IDS when the calibration began
    logs: dict[int, dict]  # what the Trainer sent to the tracker, by optimizer step (loss logs only)
    report: dict  # stage=eval's report
    generations: list[dict]  # eval/generations.jsonl

    def cfg(self, *extra: str, root: Path | None = None):
        return _cfg(root or self.root, self.tuning, *extra)


@pytest.fixture(scope="module", params=sorted(TUNING))
def run(request, tmp_path_factory) -> Medusa2Run:
    root = tmp_path_factory.mktemp(f"medusa2_{request.param}")
    build_tiny_backbone(root / "base_model")
    write_distill(root, make_records(48), root / "base_model")
    captured: dict = {}
    recorded: dict[int, dict] = {}
    build = Medusa2Recipe.training_module

    def capture_build(self, *args, **kwargs):
        captured["module"], callbacks, extra = build(self, *args, **kwargs)
        return captured["module"], callbacks, extra

    def record_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            recorded[state.global_step] = dict(logs)

    decoding = Medusa2Recipe.decoding_backbone

    def capture_trained(self, trained):
        with torch.no_grad():
            captured["trained_logits"] = trained.eval()(input_ids=IDS).logits
        return decoding(self, trained)

    calibrate = train.calibrate

    def capture_calibrate(model, *args, **kwargs):
        captured["calibrated"] = model
        with torch.no_grad():
            captured["calibrated_logits"] = model(input_ids=IDS).logits
        return calibrate(model, *args, **kwargs)

    tuning = request.param
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Medusa2Recipe, "training_module", capture_build)
        mp.setattr(TrackerCallback, "on_log", record_log)
        mp.setattr(Medusa2Recipe, "decoding_backbone", capture_trained)
        mp.setattr(train, "calibrate", capture_calibrate)
        train.run(_cfg(root, tuning))
    export.run(_cfg(root, tuning, "stage=export"))
    report = eval_stage.run(_cfg(root, tuning, "stage=eval"))
    lines = (root / "eval" / "generations.jsonl").read_text().splitlines()
    return Medusa2Run(
        root,
        tuning,
        captured["module"].eval(),
        captured["trained_logits"],
        captured["calibrated"],
        captured["calibrated_logits"],
        recorded,
        report,
        [json.loads(x) for x in lines],
    )


def _greedy_texts(model, run: Medusa2Run) -> list[str]:
    """Plain greedy ``generate`` of ``model`` on the prompts eval used (first turns), decoded as eval does."""
    cfg = run.cfg("stage=eval")
    tok = load_tokenizer(str(run.root / "base_model"))
    eos, renderer = eos_token_ids(model, tok), ChatRenderer(tok)
    texts = []
    for prompt in eval_stage.load_eval_prompts(cfg.eval):
        ids = torch.tensor([renderer.turn_prompt_ids(prompt, [])])  # (1, T)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=cfg.eval.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )
        texts.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def _original(run: Medusa2Run):
    return load_backbone(str(run.root / "base_model"))[0]


def _logits(backbone, heads, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(backbone logits (1, T, V), head logits (K, 1, T, V))``."""
    with torch.no_grad():
        h = last_hidden_state(backbone, ids, torch.ones_like(ids))  # (1, T, d)
        return backbone(input_ids=ids).logits, heads(h.to(heads.proj(0).weight.dtype))


def test_eval_decodes_with_the_trained_backbone(run: Medusa2Run) -> None:
    report = run.report
    assert report["backbone"] == str(run.root / "heads" / "backbone")
    assert report["greedy_identical"] == 1.0 and len(run.generations) == report["num_prompts"] == 3
    # Medusa greedy == plain greedy of the trained backbone in memory (LoRA: merged in place for the
    # calibration, as eval merges the saved adapter).
    trained = _greedy_texts(run.module.backbone, run)
    assert [g["medusa"] for g in run.generations] == trained == [g["baseline"] for g in run.generations]
    # ... and the original backbone answers otherwise: eval on it would have failed the line above.
    assert _greedy_texts(_original(run), run) != trained


def test_eval_compare_reports_every_set_of_heads_on_the_same_turns_with_its_backbone(
    run: Medusa2Run, tmp_path: Path
) -> None:
    """eval.compare: the Medusa-2 heads (with their trained backbone) and the same heads on the original
    backbone (a copy without backbone/), in one report. Each row is what evaluating that set alone
    measures (greedy tau is a function of weights and turns), and the trained backbone's drift is its
    argmax agreement / KL to the original on the held-out distilled records, counted here by hand."""
    on_original = tmp_path / "heads_on_original"
    shutil.copytree(run.root / "heads", on_original, ignore=shutil.ignore_patterns("backbone"))
    cfg = run.cfg("stage=eval", f"eval.compare=[{on_original}]")
    report = eval_stage.run(cfg)
    md = (run.root / "eval" / "report.md").read_text()
    assert "Heads compared" in md and str(on_original) in md
    main, other = report["comparison"]
    assert (main["trained"], other["trained"]) == (True, False)
    assert main["backbone"] == str(run.root / "heads" / "backbone") and other["backbone"] == str(
        run.root / "base_model"
    )
    assert main["tau"] == report["tau"] and main["greedy_identical"] == other["greedy_identical"] == 1.0
    alone = eval_stage.run(run.cfg("stage=eval", f"eval.heads_dir={on_original}"))
    assert other["tau"] == pytest.approx(alone["tau"])
    assert other["argmax_agreement"] is None and other["kl"] is None

    # The drift, counted record by record: positions whose next token is loss-masked.
    original, trained = _original(run), run.module.backbone
    _, held = split_heldout(load_distilled(run.root / "distill"), cfg.data.eval_fraction)
    agree = total = 0
    kl = 0.0
    for record in held:
        ids = torch.tensor([record["input_ids"]])  # (1, T)
        with torch.no_grad():
            lo, lt = original(input_ids=ids).logits[0], trained(input_ids=ids).logits[0]  # (T, V)
        for t in range(len(record["input_ids"]) - 1):
            if record["loss_mask"][t + 1]:
                agree += int(lo[t].argmax() == lt[t].argmax())
                p, q = lo[t].log_softmax(-1), lt[t].log_softmax(-1)
                kl += float((p.exp() * (p - q)).sum())
                total += 1
    assert total > 0 and main["drift_positions"] == total
    assert main["argmax_agreement"] == pytest.approx(agree / total)
    assert main["kl"] == pytest.approx(kl / total, rel=1e-4) and main["kl"] > 0


def test_the_calibration_runs_on_the_backbone_export_ships(run: Medusa2Run) -> None:
    """The tree is timed and its accuracies measured on the model export ships and eval decodes
    with: after LoRA training the adapter merged into the weights (no peft layer left, which would
    add two matmuls per adapted linear layer), with the exported backbone's logits bit for bit;
    after full tuning the trained model itself."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = run.calibrated
    assert type(model) is type(_original(run))  # a plain causal LM, not peft's wrapper
    assert not any(isinstance(m, BaseTunerLayer) for m in model.modules())
    exported = AutoModelForCausalLM.from_pretrained(run.root / "export" / "backbone").eval()
    with torch.no_grad():
        assert torch.equal(exported(input_ids=IDS).logits, run.calibrated_logits)
    if run.tuning == "full":
        assert model is run.module.backbone


def test_export_ships_the_trained_backbone_with_identical_logits(run: Medusa2Run) -> None:
    out = run.root / "export"
    exported = AutoModelForCausalLM.from_pretrained(out / "backbone").eval()
    # the same weights, saved and loaded: bit for bit (LoRA: the adapter merged into the weights, in
    # memory by the calibration as by export)
    want_lm, want_heads = _logits(run.module.backbone, run.module.heads, IDS)
    for layout in ("medusa", "vllm"):
        got_lm, got_heads = _logits(exported, load_heads(out / layout), IDS)
        assert torch.equal(got_lm, want_lm) and torch.equal(got_heads, want_heads)
    if run.tuning == "full":
        assert torch.equal(want_lm, run.trained_logits)
    else:  # merged (W + s B A) vs the adapters applied on the side, as trained: rounding only
        torch.testing.assert_close(want_lm, run.trained_logits, atol=1e-5, rtol=0)
    original_lm, _ = _logits(_original(run), run.module.heads, IDS)
    assert (original_lm - want_lm).abs().max() > 1e-2  # training changed the backbone
    assert not (out / "backbone" / "adapter_config.json").exists()  # a plain model, LoRA merged
    # transformers 4.x consumers read RoPE and dtype from top-level keys (tests/unit/test_formats.py)
    written = json.loads((out / "backbone" / "config.json").read_text())
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"]
    assert "rope_scaling" in written and written["torch_dtype"] == written["dtype"]
    tokenizer_config = json.loads((out / "backbone" / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"  # a name transformers 4.x knows
    # Serving engines load the base named in medusa/config.json; the card names the same folder.
    config = json.loads((out / "medusa" / "config.json").read_text())
    assert config["base_model_name_or_path"] == str(out / "backbone")
    assert config["backbone"]["name_or_path"] == str(run.root / "base_model")  # where training started
    loading = (out / "README.md").read_text().split("## Loading", 1)[1]
    assert f'LLM(model="{out / "backbone"}"' in loading and f"--model_dir {out / 'backbone'} " in loading
    assert f"{run.root / 'base_model'} " not in loading and f'"{run.root / "base_model"}"' not in loading
    # model.generate(custom_generate=<export>) decodes over the shipped backbone (greedy: plain generate's
    # tokens) and refuses the backbone training started from
    out_ids = exported.generate(IDS, custom_generate=str(out), trust_remote_code=True, max_new_tokens=12)
    assert torch.equal(out_ids, exported.generate(IDS, do_sample=False, max_new_tokens=12))
    original = AutoModelForCausalLM.from_pretrained(run.root / "base_model").eval()
    with pytest.raises(ValueError, match="go with .*export/backbone"):
        original.generate(IDS, custom_generate=str(out), trust_remote_code=True, max_new_tokens=4)


def test_heads_folder_holds_the_full_model_or_the_adapter_only(run: Medusa2Run) -> None:
    saved = {p.name for p in (run.root / "heads" / "backbone").iterdir()}
    if run.tuning == "full":
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= saved
    else:
        assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= saved
        assert "model.safetensors" not in saved and "config.json" not in saved


def test_lm_loss_and_lambda0_are_logged_and_warm_up_follows_the_heads_only_phase(run: Medusa2Run) -> None:
    logged = run.logs
    if run.tuning == "full":
        # logging_steps=1, heads_only_steps=2, linear warm-up over 2 steps counted from step 2:
        # lambda0 is set before each step from (steps done - 2) / 2.
        assert "lm_loss" not in logged[1] and "lm_loss" not in logged[2]
        assert [logged[s]["lambda0"] for s in (3, 4, 5, 6)] == [0.0, 0.1, 0.2, 0.2]
        steps = (3, 4, 5, 6)
    else:  # logging_steps=2, constant lambda0, no heads-only phase
        assert sorted(logged) == [2, 4, 6] and all(logged[s]["lambda0"] == 0.2 for s in logged)
        steps = (2, 4, 6)
    assert all(logged[s]["lm_loss"] >= 0 for s in steps)
    assert all("head1/loss" in logged[s] for s in logged)


def test_moved_workdir_still_uses_the_trained_backbone_and_another_model_overrides(
    run: Medusa2Run, tmp_path: Path
) -> None:
    """A copy of the workdir (its base at a new path: same checkpoint files) still decodes with the
    trained backbone; model.name_or_path naming another checkpoint wins; an export's layout folder
    finds the exported backbone."""
    copy = tmp_path / "wd"
    shutil.copytree(run.root, copy)
    report = eval_stage.run(run.cfg("stage=eval", root=copy))
    assert report["backbone"] == str(copy / "heads" / "backbone")
    lines = [json.loads(x) for x in (copy / "eval" / "generations.jsonl").read_text().splitlines()]
    assert [g["medusa"] for g in lines] == [g["medusa"] for g in run.generations]

    other = tmp_path / "other_backbone"  # another checkpoint of the same shapes
    model = _original(run)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    shutil.copytree(run.root / "base_model", other)  # tokenizer and chat template
    model.save_pretrained(other)
    report = eval_stage.run(run.cfg("stage=eval", f"model.name_or_path={other}", root=copy))
    assert report["backbone"] == str(other) and report["greedy_identical"] == 1.0
    lines = [json.loads(x) for x in (copy / "eval" / "generations.jsonl").read_text().splitlines()]
    assert [g["medusa"] for g in lines] == _greedy_texts(model, run)

    if run.tuning == "lora":  # the merged export, read through its vLLM layout
        report = eval_stage.run(
            run.cfg("stage=eval", f"eval.heads_dir={copy / 'export' / 'vllm'}", root=copy)
        )
        assert report["backbone"] == str(copy / "export" / "backbone") and report["greedy_identical"] == 1.0
        lines = [json.loads(x) for x in (copy / "eval" / "generations.jsonl").read_text().splitlines()]
        assert [g["medusa"] for g in lines] == [g["medusa"] for g in run.generations]


def test_changed_tree_settings_recalibrate_with_the_trained_backbone(run: Medusa2Run, tmp_path: Path) -> None:
    copy = tmp_path / "wd"
    shutil.copytree(run.root, copy)
    before = json.loads((copy / "heads" / "calibration.json").read_text())
    weights = {p: p.read_bytes() for p in (copy / "heads").rglob("*.safetensors")}
    result = train.run(run.cfg("tree.max_nodes=2", root=copy))
    assert result["skipped"] and result["recalibrated"] and result["tree_size"] <= 2
    after = json.loads((copy / "heads" / "calibration.json").read_text())
    assert after["settings"]["tree_max_nodes"] == 2 and before["settings"]["tree_max_nodes"] == 6
    # Accuracy measured again on the same records: equal only if the trained backbone was used (LoRA:
    # the saved adapter merged into the loaded base, the same weights as the in-place merge after training).
    assert after["count"] == before["count"]
    assert after["head_topk_accuracy"] == before["head_topk_accuracy"]
    assert {p: p.read_bytes() for p in (copy / "heads").rglob("*.safetensors")} == weights


def test_tied_embeddings_checkpoint_and_a_killed_run_resumes(tmp_path: Path, monkeypatch) -> None:
    """Over a backbone whose lm_head is its input embedding the training module holds one tensor
    under two names (safetensors refuses that): checkpoints still save, and a run killed at step 4
    resumes from checkpoint-3 to the uninterrupted run's backbone and heads."""
    overrides = ("training=medusa2", "training.lm_loss=ce", "training.lambda_warmup=constant")
    ref = make_train_workdir(tmp_path / "ref", tie=True)
    train.run(train_cfg(ref, *overrides))
    root = make_train_workdir(tmp_path / "killed", tie=True)
    run_killed_at_step(train_cfg(root, *overrides), monkeypatch, step=4)
    assert (root / "train" / "checkpoint-3" / "trainer_state.json").is_file()
    result = train.run(train_cfg(root, *overrides))
    assert result["resumed_from"].endswith("checkpoint-3") and result["steps"] == 6
    resumed = AutoModelForCausalLM.from_pretrained(root / "heads" / "backbone")
    want = AutoModelForCausalLM.from_pretrained(ref / "heads" / "backbone")
    assert resumed.lm_head.weight.data_ptr() == resumed.model.embed_tokens.weight.data_ptr()  # still tied
    for (name, got), (_, expected) in zip(
        resumed.state_dict().items(), want.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=name)
    heads = load_heads(root / "heads").state_dict()
    for name, expected in load_heads(ref / "heads").state_dict().items():
        torch.testing.assert_close(heads[name], expected, atol=1e-5, rtol=1e-5, msg=name)


# -- DeepSpeed --------------------------------------------------------------------------------------
# Both TUNING settings (full: CE, heads-only phase, linear warm-up; LoRA: KL to the adapter-disabled
# model), LoRA without dropout (every rank draws its own masks), over the tied-embedding backbone.
# One plain process with batch 2 x 2 accumulation steps is the reference for 2 ranks x batch 2.
# Not full tuning with KL: its frozen copy's logits differ from the student's by rounding only, and
# Adam scales that noise up to lr-sized steps (lm_head entries then differ by ~5e-3 between runs).
PER_RANK = ("training.per_device_batch_size=2", "training.lora_dropout=0")


@pytest.fixture(scope="module", params=sorted(TUNING))
def plain(request, tmp_path_factory) -> tuple[str, Path, dict]:
    """``(tuning, workdir, result)`` of the reference run without DeepSpeed."""
    root = make_train_workdir(tmp_path_factory.mktemp(f"plain_{request.param}"), tie=True)
    overrides = (
        "training=medusa2",
        *TUNING[request.param],
        *PER_RANK,
        "training.gradient_accumulation_steps=2",
    )
    return request.param, root, train.run(train_cfg(root, *overrides))


def _assert_same_training(root: Path, ref: Path, tuning: str) -> None:
    """``root/heads`` (heads and trained backbone) equals ``ref/heads``, and training moved the backbone."""
    heads, want = load_heads(root / "heads").state_dict(), load_heads(ref / "heads").state_dict()
    assert heads.keys() == want.keys()
    for name, expected in want.items():
        torch.testing.assert_close(heads[name], expected, atol=1e-5, rtol=1e-5, msg=name)
    if tuning == "full":  # a loadable model: every weight, lm_head still tied to the input embedding
        got = AutoModelForCausalLM.from_pretrained(root / "heads" / "backbone")
        assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()
        got = got.state_dict()
        expected = AutoModelForCausalLM.from_pretrained(ref / "heads" / "backbone").state_dict()
        base = AutoModelForCausalLM.from_pretrained(ref / "base_model").state_dict()
        assert max(float((expected[k] - base[k]).abs().max()) for k in base) > 1e-3
    else:  # the adapter only
        got = load_file(str(root / "heads" / "backbone" / "adapter_model.safetensors"))
        expected = load_file(str(ref / "heads" / "backbone" / "adapter_model.safetensors"))
        assert max(float(t.abs().max()) for k, t in expected.items() if "lora_B" in k) > 1e-3
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-5, msg=name)


# Each tuning with one data-parallel engine: full tuning under ZeRO-2 (its partitioned gradients over the
# backbone's and the heads' parameter groups), LoRA under plain DDP (most parameters frozen). The other two
# pairings passed too and were left out for CI time; test_deepspeed_resume.py runs ZeRO-2 and ZeRO-3 with
# either tuning in one process.
TWO_PROCESS_ENGINE = {"full": "zero2", "lora": "none"}


@pytest.mark.distributed
def test_two_process_equals_one_process(plain, tmp_path: Path) -> None:
    """2 ranks x batch 2 (torchrun; ZeRO-2, or plain DDP) == 1 process x batch 2 x 2 accumulation steps."""
    tuning, ref, _ = plain
    deepspeed = TWO_PROCESS_ENGINE[tuning]
    root = make_train_workdir(tmp_path, tie=True)
    args = train_overrides(
        root, "stage=train", "training=medusa2", *TUNING[tuning], *PER_RANK, f"deepspeed={deepspeed}"
    )
    port = {"full": "29633", "lora": "29634"}[tuning]
    torchrun = Path(sys.executable).parent / "torchrun"
    launch([str(torchrun), "--nproc_per_node", "2", "--master_port", port, "-m", "medusa_train", *args])
    assert json.loads((root / "heads" / "config.json").read_text())["training_result"]["steps"] == 6
    _assert_same_training(root, ref, tuning)


def test_single_process_zero3_with_everything_partitioned_equals_plain(
    plain, tmp_path: Path, monkeypatch
) -> None:
    """ZeRO-3 shards the backbone too, from its load on: the LM loss still reads the whole lm_head,
    and heads/backbone holds the consolidated trained weights; the calibration after training uses
    them as well."""
    tuning, ref, ref_result = plain
    root = make_train_workdir(tmp_path, tie=True)
    overrides = ("training=medusa2", *TUNING[tuning], *PER_RANK, "training.gradient_accumulation_steps=2")
    with zero3_partitioning_everything(monkeypatch):
        result = train.run(train_cfg(root, *overrides, "deepspeed=zero3"))
    assert result["steps"] == 6 and result["final_loss"] == pytest.approx(ref_result["final_loss"], abs=1e-4)
    # counted whole, not as the (empty) partitions the backbone loads as
    assert result["backbone_trainable_params"] == ref_result["backbone_trainable_params"]
    _assert_same_training(root, ref, tuning)
    calibration, ref_calibration = (
        json.loads((r / "heads" / "calibration.json").read_text()) for r in (root, ref)
    )
    assert calibration["count"] == ref_calibration["count"]
    torch.testing.assert_close(
        torch.tensor(calibration["head_topk_accuracy"]),
        torch.tensor(ref_calibration["head_topk_accuracy"]),
        atol=1.0 / min(ref_calibration["count"]),  # one hit: the heads agree to 1e-5, not bit for bit
        rtol=0,
    )
    # Recalibrated (other tree settings) under ZeRO-3 too: on the whole trained backbone, not on the
    # partitioned base the stage loads first (a LoRA adapter cannot merge into that).
    with zero3_partitioning_everything(monkeypatch):
        again = train.run(train_cfg(root, *overrides, "deepspeed=zero3", "tree.max_nodes=4"))
    assert again["recalibrated"] and again["heldout_top1"] == result["heldout_top1"]


class _Loaded(Exception):
    """Stops stage=train right after its backbone loaded."""


@pytest.mark.parametrize(("mode", "partitioned"), [("medusa2", True), ("medusa1", False)])
def test_zero3_loads_a_backbone_that_trains_partitioned(
    tmp_path: Path, monkeypatch, mode: str, partitioned: bool
) -> None:
    """Under ZeRO-3 Medusa-2's backbone is built partitioned as it loads (transformers' ``zero.Init``),
    so no rank holds the whole model: right after loading, every parameter is an empty partition of
    its whole size, holding the checkpoint's values once gathered. Medusa-1's frozen backbone runs
    outside the engine and loads whole. (The run is stopped there: the tests above train from such a
    load under ZeRO-3.)"""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    root = make_train_workdir(tmp_path, tie=True)
    want = AutoModelForCausalLM.from_pretrained(root / "base_model").state_dict()
    load, seen = train.load_configured_backbone, {}

    def stop_after_loading(*args, **kwargs):
        model, _ = load(*args, **kwargs)
        params = dict(model.named_parameters())
        seen["numel"] = {name: (p.numel(), getattr(p, "ds_numel", p.numel())) for name, p in params.items()}
        with GatheredParameters(list(params.values())):
            seen["state"] = {name: p.detach().clone() for name, p in params.items()}
        raise _Loaded

    monkeypatch.setattr(train, "load_configured_backbone", stop_after_loading)
    with zero3_partitioning_everything(monkeypatch), pytest.raises(_Loaded):
        train.run(train_cfg(root, f"training={mode}", "deepspeed=zero3"))
    for name, (held, whole) in seen["numel"].items():
        assert whole == want[name].numel() and held == (0 if partitioned else whole), name
    for name, tensor in seen["state"].items():
        assert torch.equal(tensor, want[name]), name


QLORA = ("training.backbone_tuning=qlora", "training.lm_loss=kl", "training.lambda_warmup=constant")
"""QLoRA as LoRA is tested (KL to the adapter-disabled model), over ``model.quantization`` (4bit|8bit)."""
IDS_64 = torch.tensor([[5, 17, 3, 40, 42, 7, 60, 11]])  # (1, 8): tokens of the 64-token vocabulary


@pytest.fixture(scope="module")
def plain_qlora(tmp_path_factory) -> Path:
    """The workdir of a 4-bit QLoRA run without DeepSpeed (batch 2 x 2 accumulation steps)."""
    pytest.importorskip("bitsandbytes")
    root = make_train_workdir(tmp_path_factory.mktemp("plain_qlora"), hidden=64, kv_heads=4)
    overrides = (*QLORA, "model.quantization=4bit", *PER_RANK, "training.gradient_accumulation_steps=2")
    train.run(train_cfg(root, "training=medusa2", *overrides))
    return root


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_qlora_deepspeed_run_killed_and_resumed_equals_plain(
    plain_qlora, tmp_path: Path, monkeypatch, zero: str
) -> None:
    """4-bit QLoRA under DeepSpeed (ZeRO-3 with every parameter, the packed 4-bit weights too,
    partitioned), killed at step 4: it resumes from checkpoint-3 (DeepSpeed loads the module's
    checkpoint strictly, bitsandbytes' saved quantization statistics included) and publishes the
    heads and adapter of the uninterrupted run without DeepSpeed."""
    root = make_train_workdir(tmp_path, hidden=64, kv_heads=4)
    overrides = (
        "training=medusa2",
        *QLORA,
        "model.quantization=4bit",
        *PER_RANK,
        "training.gradient_accumulation_steps=2",
    )
    partitioned = zero3_partitioning_everything(monkeypatch) if zero == "zero3" else contextlib.nullcontext()
    with partitioned:
        cfg = train_cfg(root, *overrides, f"deepspeed={zero}")
        run_killed_at_step(cfg, monkeypatch, step=4)
        result = train.run(cfg)
    assert result["resumed_from"].endswith("checkpoint-3") and result["steps"] == 6
    _assert_same_training(root, plain_qlora, "qlora")


FAST_BF16 = ("training.max_steps=3", "training.save_steps=10", "tree.max_nodes=1", "tree.latency_context=4")
"""3 steps (full tuning: 1 joint step after the heads-only phase), no checkpoint, the smallest tree to
time: bf16 matmuls are slow on a CPU."""


def _bf16_on_cpu(monkeypatch) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """DeepSpeed and the Trainer in bf16 on this CPU, as the stage runs them on a GPU with
    ``model.dtype=bfloat16`` (on a CPU it keeps mixed precision off). Returns what each trainable
    parameter was when the engine was released, read through DeepSpeed's own API:
    ``{name: (fp32 master, dtype of the module's copy)}``, filled during the run."""
    seen: dict[str, tuple[torch.Tensor, torch.dtype]] = {}
    config, arguments, release = train.deepspeed_config, train.TrainingArguments, train.release_engine

    def bf16_config(*args, **kwargs):
        return {**config(*args, **kwargs), "bf16": {"enabled": True}}

    def recording_release(trainer, zero3: bool) -> None:
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in trainer.model.named_parameters():
            if param.requires_grad:
                seen[name] = (safe_get_full_fp32_param(param).detach().cpu().clone(), param.dtype)
        release(trainer, zero3)

    monkeypatch.setattr(train, "deepspeed_config", bf16_config)
    monkeypatch.setattr(train, "TrainingArguments", lambda *a, **kw: arguments(*a, **{**kw, "bf16": True}))
    monkeypatch.setattr(train, "release_engine", recording_release)
    return seen


@pytest.mark.parametrize(
    ("tuning", "zero", "quantization"),
    [
        ("lora", "zero2", "none"),
        ("full", "zero3", "none"),
        ("qlora", "zero2", "8bit"),
        ("qlora", "zero3", "4bit"),
    ],
)
def test_bf16_deepspeed_publishes_the_fp32_master_weights(
    tmp_path: Path, monkeypatch, tuning, zero, quantization
) -> None:
    """Under bf16 DeepSpeed trains a bf16 copy of the module and keeps fp32 master weights: the heads
    and a LoRA/QLoRA adapter (fp32 without DeepSpeed) are published as those masters bit for bit, not
    their bf16 rounding; a fully tuned bf16 backbone stays bf16, the rounding of its masters (as
    without DeepSpeed, where it trains in place). QLoRA: DeepSpeed leaves the 8-bit / 4-bit weights
    alone and casts the fp32 norms and embeddings (bf16 as loaded) back to bf16 losslessly, so the
    model the tree is calibrated on is the published adapter merged into a freshly loaded base (what
    eval decodes with), bit for bit."""
    if quantization != "none":
        pytest.importorskip("bitsandbytes")
    quantized = {"hidden": 64, "kv_heads": 4} if quantization != "none" else {}  # 4-bit CPU blocks: 64 values
    root = make_train_workdir(tmp_path, **quantized)
    masters = _bf16_on_cpu(monkeypatch)
    calibrated: dict[str, torch.Tensor] = {}
    calibrate = train.calibrate

    def capture_calibrate(model, *args, **kwargs):
        with torch.no_grad():
            calibrated["logits"] = model(input_ids=IDS_64).logits
        return calibrate(model, *args, **kwargs)

    monkeypatch.setattr(train, "calibrate", capture_calibrate)
    tuned = QLORA if tuning == "qlora" else TUNING[tuning]
    overrides = (
        "training=medusa2",
        *tuned,
        f"model.quantization={quantization}",
        "model.dtype=bfloat16",
        f"deepspeed={zero}",
        *FAST_BF16,
    )
    cfg = train_cfg(root, *overrides)
    assert train.run(cfg)["steps"] == 3

    def assert_masters(published: dict[str, torch.Tensor], prefix: str, rename=lambda k: k) -> None:
        assert published
        finer = False  # some master is not a bf16 value: its rounding fails the equality below
        for key, tensor in published.items():
            master, trained_as = masters[prefix + rename(key)]
            assert trained_as == torch.bfloat16 and tensor.dtype == torch.float32, key
            assert torch.equal(tensor, master), key
            finer = finer or not torch.equal(master.bfloat16().float(), master)
        assert finer

    heads = load_file(str(root / "heads" / "medusa_lm_head.safetensors"))
    assert_masters({k: v for k, v in heads.items() if k != "token_map"}, "heads.heads.")
    backbone = root / "heads" / "backbone"
    if tuning in ("lora", "qlora"):  # peft drops the adapter's name from the saved keys
        adapter = load_file(str(backbone / "adapter_model.safetensors"))
        assert_masters(adapter, "backbone.", lambda k: k.replace(".weight", ".default.weight"))
        fresh = load_trained_backbone(cfg.model, backbone, torch.device("cpu"))
        with torch.no_grad():
            assert torch.equal(calibrated["logits"], fresh(input_ids=IDS_64).logits)
    else:
        saved = load_file(str(backbone / "model.safetensors"))
        for key, tensor in saved.items():
            master, trained_as = masters[f"backbone.{key}"]
            assert trained_as == tensor.dtype == torch.bfloat16, key
            assert torch.equal(tensor, master.bfloat16()), key
