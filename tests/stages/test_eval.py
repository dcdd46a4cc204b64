"""stage=eval on a tiny random backbone: report consistent with generations, greedy parity, plots, errors."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import constants
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_train.backbone import TENSORS_PREFIX, local_fingerprint
from medusa_train.config import ModelConfig
from medusa_train.decoding import attention as attention_module
from medusa_train.decoding.attention import function as attention_function
from medusa_train.decoding.attention.sdpa import sdpa_tree_attention
from medusa_train.decoding.calibrate import grow_tree, per_rank_accuracy
from medusa_train.decoding.timing import Decoded
from medusa_train.errors import ConfigError, UserError
from medusa_train.formats import save_vllm
from medusa_train.heads import MedusaHeads
from medusa_train.report import recommend_speculative_tokens, summary_table
from medusa_train.stages import eval as eval_stage
from medusa_train.stages import export
from tests.helpers.models import add_remote_code, build_tiny_backbone
from tests.helpers.tiny_workdir import TOPK, make_workdir, tiny_cfg

REPORT_KEYS = {
    "tau", "speedup", "tokens_per_s_baseline", "tokens_per_s_medusa", "greedy_identical", "head_top1",
    "head_top5", "tau_typical", "tau_sample", "tree_size", "num_prompts", "accepted_length_histogram",
    "sweep", "machine", "date", "alternatives", "batch_sizes",
}  # fmt: skip


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    workdir = make_workdir(tmp_path_factory.mktemp("eval"))
    export.run(tiny_cfg(workdir, "stage=export"))
    return workdir, eval_stage.run(tiny_cfg(workdir, "stage=eval"))


def test_report_is_consistent_with_generations(evaluated: tuple[Path, dict]) -> None:
    workdir, report = evaluated
    out = workdir / "eval"
    on_disk = json.loads((out / "report.json").read_text())
    assert REPORT_KEYS <= set(on_disk)
    assert on_disk["tau"] == pytest.approx(report["tau"])
    lines = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(lines) == report["num_prompts"] == 3  # debug=fast: 3 prompts, first turn only
    assert report["tau"] == pytest.approx(sum(r["tokens"] for r in lines) / sum(r["steps"] for r in lines))
    assert all(r["identical"] and r["baseline"] == r["medusa"] for r in lines)
    assert report["greedy_identical"] == 1.0
    assert all(sum(r["accepted_lengths"]) == r["tokens"] for r in lines)
    hist = report["accepted_length_histogram"]
    assert sum(hist.values()) == sum(r["steps"] for r in lines)
    assert sum(int(n) * c for n, c in hist.items()) == sum(r["tokens"] for r in lines)
    assert 1.0 <= report["tau"] <= 4.0  # at most depth (3) + 1
    tps_base = sum(r["baseline_tokens"] for r in lines) / sum(r["baseline_s"] for r in lines)
    assert report["tokens_per_s_baseline"] == pytest.approx(tps_base)
    summed = report["tokens_per_s_medusa"] / report["tokens_per_s_baseline"]
    assert report["speedup_tokens_per_s"] == pytest.approx(summed)
    # The headline is the median of the per-turn speed-ups (each kept in generations.jsonl), not the summed ratio.
    assert report["speedup"] == pytest.approx(statistics.median(r["speedup"] for r in lines))
    assert report["speedup_q25"] <= report["speedup"] <= report["speedup_q75"]
    assert report["speedup_plausible"] is (report["speedup"] <= report["speedup_ceiling"])
    assert report["tree_size"] == 5 and report["tree"] == "calibrated"
    # Random heads on the tiny backbone accept nothing: far below what calibration.json predicts, said once.
    assert report["expected_tau"] > 2 and report["tau_note"].startswith(
        "measured tau 1.00 is more than 15% below"
    )
    assert report["head_top1"] == [0.8, 0.6, 0.4] and report["head_top5"] == [0.95, 0.85, 0.7]
    assert report["tau_typical"] >= 1.0 and report["tau_sample"] >= 1.0
    # The calibrated sizes asked for and the evaluated 5-node tree, on the same turns (debug=fast: the first 2).
    assert [(row["tree_size"], row["main"]) for row in report["sweep"]] == [(1, False), (4, False), (5, True)]
    assert {row["turns"] for row in report["sweep"]} == {2} and report["sweep_fastest"] in (1, 4, 5)
    assert report["sweep"][0]["expected_tau"] == pytest.approx(1.8)
    assert report["machine"]["torch"] and report["machine"]["threads"] >= 1
    # vLLM's view: the top-1 chain of the first n heads, greedy, so the same tokens as plain greedy
    chain = report["vllm_chain"]
    assert [row["num_speculative_tokens"] for row in chain] == [1, 2, 3]
    assert all(row["tokens"] == sum(r["baseline_tokens"] for r in lines) for row in chain)
    assert all(1.0 <= row["tau"] <= row["num_speculative_tokens"] + 1 for row in chain)
    assert report["vllm_num_speculative_tokens"] == recommend_speculative_tokens(chain)


def test_alternatives_and_batch_sizes(evaluated: tuple[Path, dict]) -> None:
    """Prompt lookup on every turn (identical outputs), and the batch-size table (debug=fast: [1, 3])."""
    workdir, report = evaluated
    lines = [json.loads(line) for line in (workdir / "eval" / "generations.jsonl").read_text().splitlines()]
    lookup = report["alternatives"]["prompt_lookup"]
    assert set(report["alternatives"]) == {"prompt_lookup"}  # no eval.assistant_model
    assert lookup["identical"] == 1.0 and all(r["prompt_lookup_identical"] for r in lines)
    tps = sum(r["prompt_lookup_tokens"] for r in lines) / sum(r["prompt_lookup_s"] for r in lines)
    assert lookup["tokens_per_s"] == pytest.approx(tps)
    assert lookup["speedup_tokens_per_s"] == pytest.approx(tps / report["tokens_per_s_baseline"])
    per_turn = [
        (r["prompt_lookup_tokens"] / r["prompt_lookup_s"]) / (r["baseline_tokens"] / r["baseline_s"])
        for r in lines
    ]
    assert lookup["speedup"] == pytest.approx(statistics.median(per_turn))
    assert lookup["setting"] == "10 tokens"
    one, three = report["batch_sizes"]
    assert one["batch_size"] == 1 and one["speedup"] == report["speedup"] and one["tau"] == report["tau"]
    assert three["batch_size"] == 3 and three["turns"] == 3 and three["identical"] == 1.0
    assert 1.0 <= three["tau"] <= 4.0 and three["tokens_per_s_baseline"] > 0
    assert three["speedup_tokens_per_s"] == pytest.approx(
        three["tokens_per_s_medusa"] / three["tokens_per_s_baseline"]
    )
    assert three["speedup"] == pytest.approx(three["speedup_tokens_per_s"])  # one group: its own speed-up
    md = (workdir / "eval" / "report.md").read_text()
    assert "## Batch size" in md and "| 3 | 3 |" in md and "| prompt lookup (10 tokens) |" in md
    assert (workdir / "eval" / "plots" / "batch_size.png").stat().st_size > 1000


class _TreeRecorder:
    """What :func:`eval_stage.sweep` needs of ``TimedDecoders``, decoding nothing: every Medusa call
    records the paths of its tree."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.trees: list[list[tuple[int, ...]]] = []

    @contextlib.contextmanager
    def warming_up(self):
        yield

    def plain(self, ids: torch.Tensor, budget: int) -> Decoded:
        return Decoded([0] * budget, 1.0)

    def medusa(self, ids: torch.Tensor, budget: int, tree) -> Decoded:
        self.trees.append(sorted(tree.choices))
        return Decoded([0] * budget, 0.5, [2] * (budget // 2), 0.0, budget // 2)


def test_the_sweep_grows_its_trees_from_the_calibrations_ranks() -> None:
    """With tree.topk=2 the calibration grows trees from each head's first two candidates; the sweep's
    calibrated tree of a size is that tree (here the evaluated one: one row, marked main), not one
    with third candidates in it."""
    ranks = 2
    trees, taus = grow_tree(per_rank_accuracy(torch.tensor(TOPK)[:, :ranks]), 8)
    calibrated = trees[-1]
    decode = _TreeRecorder()
    ecfg = SimpleNamespace(sweep_tree_sizes=[8], sweep_prompts=1)
    rows = eval_stage.sweep(decode, TOPK, [(torch.zeros(1, 3, dtype=torch.long), 4)], ecfg, calibrated, ranks)
    assert [(row["tree_size"], row["main"]) for row in rows] == [(8, True)]
    assert rows[0]["expected_tau"] == pytest.approx(taus[-1], abs=1e-4)
    assert all(max(path) < ranks for tree in decode.trees for path in tree)
    assert sorted(map(tuple, calibrated)) in decode.trees


def test_head_accuracy_without_calibration_scores_truncated_records_as_training_did(tmp_path: Path) -> None:
    """No calibration.json: the heads are scored on held-out records truncated to training.max_seq_len
    (the window they were trained and calibrated on; positions past it were never trained), not on whole
    records."""
    from medusa_train.data.distilled import load_distilled, split_heldout
    from medusa_train.decoding.calibrate import compute_head_accuracy
    from medusa_train.workdir import Workdir
    from tests.helpers.train_workdir import make_train_workdir, train_cfg

    root = make_train_workdir(tmp_path / "wd")  # records of 12 to 40 tokens
    max_len = 14
    cfg = train_cfg(root, f"training.max_seq_len={max_len}")
    model = LlamaForCausalLM.from_pretrained(root / "base_model").eval()
    torch.manual_seed(0)
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, 3, 1)
    heads.init_from_lm_head(model.get_output_embeddings().weight)

    topk, source = eval_stage.head_topk(root / "heads", Workdir(root), cfg, model, heads)

    _, held = split_heldout(load_distilled(root / "distill"), cfg.data.eval_fraction)
    assert len(held) > 0 and max(len(r["input_ids"]) for r in held) > max_len
    batches = [
        (torch.tensor([r["input_ids"][:max_len]]), torch.tensor([r["loss_mask"][:max_len]]).bool())
        for r in held
    ]
    want = compute_head_accuracy(model, heads, batches, max_k=10)  # (K, 10)
    assert source.endswith(f"(held-out, {len(held)} records)")
    torch.testing.assert_close(torch.tensor(topk), want)


def test_outputs_table_plots_and_model_card(evaluated: tuple[Path, dict]) -> None:
    workdir, report = evaluated
    out = workdir / "eval"
    table = summary_table(report)
    assert table in (out / "report.md").read_text()
    assert "| speed-up (median over turns, quartiles)" in table and "100%" in table
    assert "Note: measured tau 1.00" in table  # the gap to the expected tau, said under the table
    md = (out / "report.md").read_text()
    assert "on the first 2 of the 3 turns" in md and "| 5 * |" in md  # the sweep's turns, the evaluated tree
    for name in ("accepted_lengths", "head_accuracy", "tree_size"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000
    card = (workdir / "export" / "README.md").read_text()
    assert f"**{report['tau']:.2f}**" in card  # stage=eval added its figures to the export's card
    n = report["vllm_num_speculative_tokens"]
    assert "## vLLM: the top-1 chain" in (out / "report.md").read_text()
    assert f"| {n} (recommended) |" in card and f'"num_speculative_tokens": {n}}}\'' in card
    assert f"vllm serve {workdir / 'base_model'} --speculative-config" in card


def test_vllm_layout_chain_tree_and_all_turns(tmp_path: Path, evaluated: tuple[Path, dict]) -> None:
    workdir, _ = evaluated
    questions = tmp_path / "question.jsonl"
    rows = [
        {"question_id": i, "category": "x", "turns": [f"Tell me about cats {i}.", "Shorter."]}
        for i in range(2)
    ]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_cfg(
        workdir,
        "stage=eval",
        f"eval.heads_dir={workdir / 'export' / 'vllm'}",
        "tree=chain",
        "tree.chain_depth=2",
        "eval.prompts=mtbench",
        f"eval.path={questions}",
        "eval.all_turns=true",
        "eval.acceptance_extra=false",
        "eval.sweep_tree_sizes=[]",
    )
    report = eval_stage.run(cfg)
    assert report["num_prompts"] == 2 and report["num_turns"] == 4
    assert report["greedy_identical"] == 1.0 and report["tree_size"] == 2
    assert report["tau_typical"] is None and report["sweep"] == []


def test_errors_name_the_fix(tmp_path: Path, evaluated: tuple[Path, dict]) -> None:
    workdir, _ = evaluated
    with pytest.raises(UserError, match="stage=train"):
        eval_stage.run(tiny_cfg(tmp_path / "empty", "stage=eval"))
    no_tree = make_workdir(tmp_path / "no_tree", choices=False)
    with pytest.raises(UserError, match="stage=train"):
        eval_stage.run(tiny_cfg(no_tree, "stage=eval"))
    wrong = tmp_path / "wrong_heads"
    save_vllm(MedusaHeads(hidden_size=8, vocab_size=50, num_heads=3), wrong)
    with pytest.raises(UserError, match="hidden_size=8"):
        eval_stage.run(
            tiny_cfg(workdir, "stage=eval", f"eval.heads_dir={wrong}", "tree=chain", "tree.chain_depth=2")
        )
    with pytest.raises(UserError, match="not a Medusa heads directory|no config.json"):
        eval_stage.run(tiny_cfg(workdir, "stage=eval", f"eval.heads_dir={tmp_path}"))


def test_assistant_model_and_its_errors(tmp_path: Path, evaluated: tuple[Path, dict]) -> None:
    """eval.assistant_model: assisted generation with a draft (here the backbone itself) in the report."""
    workdir, _ = evaluated
    quick = ["eval.acceptance_extra=false", "eval.sweep_tree_sizes=[]", "eval.batch_sizes=[]"]
    report = eval_stage.run(
        tiny_cfg(workdir, "stage=eval", f"eval.assistant_model={workdir / 'base_model'}", *quick)
    )
    assisted = report["alternatives"]["assisted"]
    assert assisted["identical"] == 1.0 and assisted["tokens_per_s"] > 0
    assert assisted["setting"] == str(workdir / "base_model") and report["batch_sizes"] == []
    assert "| assisted generation (" in (workdir / "eval" / "report.md").read_text()
    with pytest.raises(UserError, match="eval.assistant_model=.*does not exist"):
        eval_stage.run(tiny_cfg(workdir, "stage=eval", f"eval.assistant_model={tmp_path / 'none'}", *quick))
    other = tmp_path / "other_vocab"
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=77, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    ).save_pretrained(other)
    with pytest.raises(UserError, match="vocabulary of 77 tokens"):
        eval_stage.run(tiny_cfg(workdir, "stage=eval", f"eval.assistant_model={other}", *quick))
    with pytest.raises(ConfigError, match="eval.batch_sizes"):
        tiny_cfg(workdir, "stage=eval", "eval.batch_sizes=[4,0]")


def test_the_model_card_names_the_exported_tree_whatever_tree_eval_measured(tmp_path: Path) -> None:
    """eval with another tree= than the export's: the card's tree stays the exported one (its name and
    node count, as medusa_choices.json), and the figures say which tree they were measured with."""
    workdir = make_workdir(tmp_path / "wd")
    export.run(tiny_cfg(workdir, "stage=export"))  # the calibrated 5-node tree
    exported = json.loads((workdir / "export" / "medusa_choices.json").read_text())
    quick = ["eval.acceptance_extra=false", "eval.sweep_tree_sizes=[]", "eval.batch_sizes=[]"]
    eval_stage.run(tiny_cfg(workdir, "stage=eval", "tree=chain", "tree.chain_depth=2", *quick))
    card = (workdir / "export" / "README.md").read_text()
    assert len(exported) == 5 and "Tree: `calibrated`, 5 nodes, in `medusa_choices.json`" in card
    assert "Tree: `chain`" not in card
    assert "- measured with tree `chain` (2 nodes), not the exported tree below" in card
    export.run(tiny_cfg(workdir, "stage=export"))  # the export's own card, from that report
    assert (workdir / "export" / "README.md").read_text() == card
    # eval of the exported tree: its figures, no such line
    eval_stage.run(tiny_cfg(workdir, "stage=eval", "eval.fit_tree=false", *quick))
    card = (workdir / "export" / "README.md").read_text()
    assert (
        "Tree: `calibrated`, 5 nodes, in `medusa_choices.json`" in card and "- measured with tree" not in card
    )


@pytest.mark.parametrize("spelt", ["missing", "empty dir", "file"])
def test_an_assistant_model_path_that_is_no_model_fails_before_the_backbone_loads(
    tmp_path: Path, monkeypatch, spelt: str
) -> None:
    """eval.assistant_model naming a local path with no model is one line naming the option, before loading."""
    workdir = make_workdir(tmp_path / "wd")
    draft = tmp_path / "draft"
    if spelt == "empty dir":
        draft.mkdir()
    elif spelt == "file":
        draft.write_text("{}")

    def no_load(*args, **kwargs):
        raise AssertionError("the backbone loaded before eval.assistant_model was checked")

    monkeypatch.setattr(eval_stage, "load_backbone_for_heads", no_load)
    reason = (
        "does not exist"
        if spelt == "missing"
        else r"is not a Hugging Face model directory \(no config.json\)"
    )
    with pytest.raises(UserError, match=rf"^eval.assistant_model={draft} {reason}: "):
        eval_stage.run(tiny_cfg(workdir, "stage=eval", f"eval.assistant_model={draft}"))


def _with_a_linear_attention_layer(model: LlamaForCausalLM) -> None:
    layers = model.config.num_hidden_layers
    model.config.layer_types = ["full_attention"] * (layers - 1) + ["linear_attention"]


def _marked_stateful(model: LlamaForCausalLM) -> None:
    model._is_stateful = True


@pytest.mark.parametrize(
    ("unservable", "says"),
    [
        (
            _with_a_linear_attention_layer,
            r"layers of type 'linear_attention' .*full, sliding-window or chunked",
        ),
        (_marked_stateful, r"LlamaForCausalLM \(llama\) keeps a recurrent state .*cannot verify trees"),
    ],
    ids=["layer-type", "stateful"],
)
def test_a_backbone_the_decoders_cannot_serve_is_refused_once_loaded(
    tmp_path: Path, monkeypatch, unservable, says: str
) -> None:
    """A backbone the tree decoders do not serve (here the tiny Llama's config naming a linear-attention
    layer, or the model marked stateful as transformers marks RWKV) is one line saying why as soon as it
    is loaded: before the backbone check fingerprints its weights and before any forward."""
    workdir = make_workdir(tmp_path / "wd")
    forwards: list = []
    load = eval_stage.load_backbone_for_heads

    def unserved(*args, **kwargs):
        model, *rest = load(*args, **kwargs)
        unservable(model)
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
        return (model, *rest)

    def no_check(*args, **kwargs):
        raise AssertionError("the backbone was checked before the decoders' refusal")

    monkeypatch.setattr(eval_stage, "load_backbone_for_heads", unserved)
    monkeypatch.setattr(eval_stage, "warn_if_other_backbone", no_check)
    with pytest.raises(UserError, match=says) as err:
        eval_stage.run(tiny_cfg(workdir, "stage=eval"))
    assert "model.generate" in str(err.value) and "\n" not in str(err.value)
    assert not forwards


def test_heads_a_backbone_cannot_score_are_refused_before_any_turn_decodes(
    tmp_path: Path, monkeypatch
) -> None:
    """Without a calibration.json, eval scores the heads on held-out distilled records through the one
    language model under the LM head (``head_targets.language_model``); a backbone with none (its own
    ``get_decoder()``, holding two models) is refused in one line once loaded, before any forward (it
    was refused after every turn had decoded)."""
    workdir = make_workdir(tmp_path / "wd", calibration=False)
    (workdir / "distill").mkdir()
    (workdir / "distill" / "manifest.json").write_text("{}")  # scored on held-out records: refused first
    forwards: list = []
    load = eval_stage.load_backbone_for_heads

    def two_models(*args, **kwargs):
        model, *rest = load(*args, **kwargs)
        model.get_decoder = lambda: model
        model.other = copy.deepcopy(model.model)
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
        return (model, *rest)

    monkeypatch.setattr(eval_stage, "load_backbone_for_heads", two_models)
    with pytest.raises(UserError, match=r"^LlamaForCausalLM \(llama\): .* 2 models inside") as err:
        eval_stage.run(tiny_cfg(workdir, "stage=eval"))
    assert "\n" not in str(err.value) and not forwards and not (workdir / "eval").exists()


def test_a_tree_calibrated_on_another_device_is_calibrated_again(tmp_path: Path) -> None:
    workdir = make_workdir(tmp_path / "wd")
    calibration = workdir / "heads" / "calibration.json"
    stored = json.loads(calibration.read_text())
    stored["tree"]["calibrated_for"] = {"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16"}
    calibration.write_text(json.dumps(stored))
    export.run(tiny_cfg(workdir, "stage=export"))
    report = eval_stage.run(
        tiny_cfg(workdir, "stage=eval", "eval.sweep_tree_sizes=[]", "eval.batch_sizes=[1]")
    )
    fit = report["tree_fit"]
    assert fit["recalibrated"] and fit["previous"]["device"] == "NVIDIA H100 80GB HBM3"
    assert fit["calibrated_for"] == fit["device"] and fit["device"]["dtype"] == "float32"
    assert report["greedy_identical"] == 1.0
    assert "in this run" in (workdir / "eval" / "report.md").read_text()
    card = (workdir / "export" / "README.md").read_text()
    assert "Tree: `calibrated`, 5 nodes, in `medusa_choices.json`, calibrated for NVIDIA H100" in card
    assert f"eval calibrated a {len(fit['choices'])}-node tree" in card
    kept = eval_stage.run(
        tiny_cfg(
            workdir, "stage=eval", "eval.fit_tree=false", "eval.sweep_tree_sizes=[]", "eval.batch_sizes=[1]"
        )
    )
    assert not kept["tree_fit"]["recalibrated"] and kept["tree_size"] == 5


def test_a_tree_timed_with_another_attention_is_calibrated_again(tmp_path: Path, caplog, monkeypatch) -> None:
    """The latency curve depends on the tree attention timed: a stored tree timed with another one than
    eval.attention takes here is calibrated again with eval.attention (eval.fit_tree=false keeps it,
    with a warning); one timed with it is kept. Triton here: the kernel's entry with the SDPA reference
    for its body (triton taken as installed, its interpreter as on)."""
    workdir = make_workdir(tmp_path / "wd")
    heads_dir = workdir / "heads"
    calibration = heads_dir / "calibration.json"
    stored = json.loads(calibration.read_text())
    assert stored["tree"]["calibrated_for"]["attention"] == "sdpa"
    model = LlamaForCausalLM.from_pretrained(workdir / "base_model")
    choices = json.loads((heads_dir / "medusa_choices.json").read_text())
    kept, fit = eval_stage.fit_tree_to_device(tiny_cfg(workdir, "stage=eval"), heads_dir, model, choices)
    assert not fit["recalibrated"] and kept == choices
    del stored["tree"]["calibrated_for"]["attention"]  # a calibration.json of before: timed on SDPA
    calibration.write_text(json.dumps(stored))
    kept, fit = eval_stage.fit_tree_to_device(tiny_cfg(workdir, "stage=eval"), heads_dir, model, choices)
    assert not fit["recalibrated"] and kept == choices
    stored["tree"]["calibrated_for"]["attention"] = "triton"
    calibration.write_text(json.dumps(stored))
    for attention in ("sdpa", "auto"):  # auto takes SDPA on a CPU
        cfg = tiny_cfg(workdir, "stage=eval", f"eval.attention={attention}")
        _, fit = eval_stage.fit_tree_to_device(cfg, heads_dir, model, choices)
        assert fit["recalibrated"] and fit["previous"]["attention"] == "triton"
        assert fit["calibrated_for"] == fit["device"] and fit["device"]["attention"] == "sdpa"
    cfg = tiny_cfg(workdir, "stage=eval", "eval.fit_tree=false")
    with caplog.at_level(logging.WARNING, logger=eval_stage.log.name):
        kept, fit = eval_stage.fit_tree_to_device(cfg, heads_dir, model, choices)
    assert not fit["recalibrated"] and kept == choices
    assert "triton attention" in caplog.text and "eval.fit_tree=false keeps it" in caplog.text
    nodes: list[int] = []
    monkeypatch.setattr(attention_module, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(
        attention_function,
        "triton_tree_attention",
        lambda query, *args, **kwargs: (
            nodes.append(query.shape[2]) or sdpa_tree_attention(query, *args, **kwargs)
        ),
    )
    stored["tree"]["calibrated_for"]["attention"] = "sdpa"
    calibration.write_text(json.dumps(stored))
    cfg = tiny_cfg(workdir, "stage=eval", "eval.attention=triton")
    _, fit = eval_stage.fit_tree_to_device(cfg, heads_dir, model, choices)
    assert fit["recalibrated"] and fit["calibrated_for"]["attention"] == "triton" and nodes


def test_a_calibration_of_another_tree_neither_labels_nor_refits_the_stored_one(
    tmp_path: Path, caplog
) -> None:
    """The calibration speaks for the stored tree only when it chose it, matched as the export's card
    matches them: the same paths as its tree.choices (in any order), or in a calibration.json without
    them the chosen node count. One of another tree (an export of a pinned tree ships the heads' own)
    keeps the stored tree as it is, calibrated for nothing recorded, with one warning line, whether it
    names this device (not the tree's label) or another one (no refit: nothing says where the stored
    tree was fitted)."""
    workdir = make_workdir(tmp_path / "wd")
    heads_dir = workdir / "heads"
    calibration = heads_dir / "calibration.json"
    stored = json.loads(calibration.read_text())
    here = stored["tree"]["calibrated_for"]
    model = LlamaForCausalLM.from_pretrained(workdir / "base_model")
    choices = json.loads((heads_dir / "medusa_choices.json").read_text())
    cfg = tiny_cfg(workdir, "stage=eval")

    def fit(tree: dict) -> tuple[list[list[int]], dict, list[str]]:
        calibration.write_text(json.dumps({**stored, "tree": tree}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=eval_stage.log.name):
            kept, info = eval_stage.fit_tree_to_device(cfg, heads_dir, model, choices)
        return kept, info, [r.getMessage() for r in caplog.records if r.name == eval_stage.log.name]

    other = [[0], [1], [2]]
    for label in (here, {"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "attention": "sdpa"}):
        for tree in ({"choices": other}, {"best": {"nodes": len(choices) + 1}}):
            kept, info, warnings = fit({**tree, "calibrated_for": label})
            assert kept == choices and info["calibrated_for"] is None and not info["recalibrated"]
            assert len(warnings) == 1 and f"{calibration} was calibrated for another tree" in warnings[0]
            assert f"the {len(choices)}-node tree in {heads_dir / 'medusa_choices.json'}" in warnings[0]
    for tree in ({"choices": choices[::-1]}, {"best": {"nodes": len(choices)}}, {}):  # its own tree
        kept, info, warnings = fit({**tree, "calibrated_for": here})
        assert kept == choices and info["calibrated_for"] == here and warnings == []
    _, info, warnings = fit({"choices": choices, "calibrated_for": {**here, "dtype": "bfloat16"}})
    assert info["recalibrated"] and warnings == []  # its own tree, fitted to another dtype: refitted


@pytest.mark.slow
def test_compile_reports_both_baselines(evaluated: tuple[Path, dict]) -> None:
    """eval.compile: compiled plain greedy and the static decoder, greedy-identical, with the speed-up
    against both baselines (compiles on CPU: minutes)."""
    workdir, _ = evaluated
    quick = ["eval.acceptance_extra=false", "eval.sweep_tree_sizes=[]", "eval.batch_sizes=[]"]
    report = eval_stage.run(
        tiny_cfg(workdir, "stage=eval", "eval.compile=true", "eval.num_prompts=3", *quick)
    )
    alt = report["alternatives"]
    assert alt["compiled_plain"]["identical"] == 1.0 and alt["static_medusa"]["identical"] == 1.0
    assert alt["static_medusa"]["speedup_vs_compiled"] > 0
    assert alt["static_medusa"]["setting"].startswith("compile, sdpa attention; ")
    assert alt["static_medusa"]["attention"] and set(alt["static_medusa"]["attention"].values()) == {"sdpa"}
    assert "| Medusa, static shapes captured (" in (workdir / "eval" / "report.md").read_text()


def test_the_static_rows_setting_names_the_attention_of_its_decoders() -> None:
    """The static decoder's alternatives row names the tree attention it ran: one name, or each with
    its capacities where auto took a kernel at some capacities only (a captured step from 2,048 keys)."""
    assert eval_stage.static_setting("cuda_graph", {512: "sdpa"}, 1.234) == (
        "cuda_graph, sdpa attention; 1.23x compiled plain"
    )
    assert eval_stage.static_setting("cuda_graph", {4096: "triton", 512: "sdpa", 2048: "triton"}, 2.0) == (
        "cuda_graph, sdpa attention at 512 columns, triton attention at 2048/4096 columns; 2.00x compiled plain"
    )


def test_previous_report_is_kept_and_demo_prompts_are_named(evaluated: tuple[Path, dict]) -> None:
    """A rerun keeps the last report in eval/previous/ (one run of history); with model=hf and the
    embedded prompts, the report says they are the demo's."""
    workdir, _ = evaluated
    before = (workdir / "eval" / "report.json").read_text()
    quick = ["eval.acceptance_extra=false", "eval.sweep_tree_sizes=[]", "eval.batch_sizes=[]"]
    report = eval_stage.run(tiny_cfg(workdir, "stage=eval", *quick))
    previous = workdir / "eval" / "previous"
    assert (previous / "report.json").read_text() == before and (previous / "generations.jsonl").is_file()
    assert not (previous / "previous").exists()
    assert report["prompts_note"].startswith("the prompts are the embedded demo's held-out conversations")
    assert "eval.prompts=mtbench|jsonl" in summary_table(report)


def test_the_backbone_check_fingerprints_the_pinned_revision(
    tmp_path: Path, tiny_backbone_dir: Path, monkeypatch, caplog
) -> None:
    """Heads trained on a Hub id at a pinned commit and evaluated at that commit are on their own
    backbone, though the id's main branch has moved on to other weights: no warning. Evaluated at
    main, they are not (warned)."""
    pinned, main = "a" * 40, "b" * 40
    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(tiny_backbone_dir, repo / "snapshots" / pinned)
    build_tiny_backbone(repo / "snapshots" / main, seed=1)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(main)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # nothing here may reach the Hub
    model = LlamaForCausalLM.from_pretrained(tiny_backbone_dir)
    heads = MedusaHeads(32, model.get_output_embeddings().weight.shape[0], 2, 1)
    trained_on = {
        "name_or_path": "acme/tiny",
        "fingerprint": local_fingerprint(str(repo / "snapshots" / pinned)),
    }
    heads.save_pretrained(tmp_path / "heads", extra_config={"backbone": trained_on})
    with caplog.at_level(logging.WARNING, logger=eval_stage.__name__):
        eval_stage.warn_if_other_backbone(
            tmp_path / "heads", model, ModelConfig("acme/tiny", revision=pinned)
        )
        assert not caplog.records
        eval_stage.warn_if_other_backbone(tmp_path / "heads", model, ModelConfig("acme/tiny"))
    assert [r.getMessage() for r in caplog.records] == [
        f"heads at {tmp_path / 'heads'} were trained on backbone acme/tiny (fingerprint "
        f"{trained_on['fingerprint']}), evaluating on acme/tiny ({local_fingerprint(str(repo / 'snapshots' / main))}): "
        "outputs stay exact, but tau will be lower"
    ]
    caplog.clear()
    old = {**trained_on, "fingerprint": "0123abcd" * 4}  # recorded by an earlier medusa_train
    heads.save_pretrained(tmp_path / "old-heads", extra_config={"backbone": old})
    with caplog.at_level(logging.WARNING, logger=eval_stage.__name__):
        eval_stage.warn_if_other_backbone(
            tmp_path / "old-heads", model, ModelConfig("acme/tiny", revision=pinned)
        )
    assert [r.getMessage() for r in caplog.records] == [
        f"heads at {tmp_path / 'old-heads'} carry a backbone fingerprint of an earlier medusa_train, which "
        "cannot say whether they were trained on acme/tiny's weights: if tau is low, train them on it again"
    ]


def test_the_backbone_check_counts_remote_code_as_model_trust_remote_code_says(
    tmp_path: Path, tiny_backbone_dir: Path, caplog
) -> None:
    """A model whose config.json has an ``auto_map``: its code is part of the backbone's fingerprint
    only with ``model.trust_remote_code`` (without it transformers never runs it). Heads trained with
    it, evaluated with it: no warning; evaluated without it (another class computes the model): warned,
    naming the setting, as evaluated with it after training without it."""
    backbone = tmp_path / "remote"
    shutil.copytree(tiny_backbone_dir, backbone)
    add_remote_code(backbone)
    model = LlamaForCausalLM.from_pretrained(backbone)
    heads = MedusaHeads(32, model.get_output_embeddings().weight.shape[0], 2, 1)
    trained_on = {
        "name_or_path": str(backbone),
        "fingerprint": local_fingerprint(str(backbone), trust_remote_code=True),
    }
    heads.save_pretrained(tmp_path / "heads", extra_config={"backbone": trained_on})
    with caplog.at_level(logging.WARNING, logger=eval_stage.__name__):
        eval_stage.warn_if_other_backbone(
            tmp_path / "heads", model, ModelConfig(str(backbone), trust_remote_code=True)
        )
        assert not caplog.records
        eval_stage.warn_if_other_backbone(tmp_path / "heads", model, ModelConfig(str(backbone)))
        heads.save_pretrained(
            tmp_path / "plain_heads",
            extra_config={"backbone": {**trained_on, "fingerprint": local_fingerprint(str(backbone))}},
        )
        eval_stage.warn_if_other_backbone(
            tmp_path / "plain_heads", model, ModelConfig(str(backbone), trust_remote_code=True)
        )
    assert [r.getMessage().split(" loaded with ")[1] for r in caplog.records] == [
        "model.trust_remote_code=true, evaluating with false (another class may compute the model): outputs "
        "stay exact, but tau may be lower; set model.trust_remote_code=true as training did",
        "model.trust_remote_code=false, evaluating with true (another class may compute the model): outputs "
        "stay exact, but tau may be lower; set model.trust_remote_code=false as training did",
    ]


def test_the_backbone_check_passes_over_a_fingerprint_of_the_other_kind(
    tmp_path: Path, tiny_backbone_dir: Path, monkeypatch, caplog
) -> None:
    """Heads that recorded a model built in memory (its tensors' fingerprint) evaluated on a model
    loaded from files, or the other way round: the two kinds compare nothing, so the name decides (no
    warning under the same name, the warning under another)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # acme/tiny has no files here
    model = LlamaForCausalLM.from_pretrained(tiny_backbone_dir)
    heads = MedusaHeads(32, model.get_output_embeddings().weight.shape[0], 2, 1)
    tensors = {"name_or_path": str(tiny_backbone_dir), "fingerprint": TENSORS_PREFIX + "0123456789abcdef"}
    files = {"name_or_path": "acme/tiny", "fingerprint": local_fingerprint(str(tiny_backbone_dir))}
    other = {**tensors, "name_or_path": "acme/other"}
    for name, trained_on in (("tensors", tensors), ("files", files), ("other", other)):
        heads.save_pretrained(tmp_path / name, extra_config={"backbone": trained_on})
    with caplog.at_level(logging.WARNING, logger=eval_stage.__name__):
        eval_stage.warn_if_other_backbone(tmp_path / "tensors", model, ModelConfig(str(tiny_backbone_dir)))
        eval_stage.warn_if_other_backbone(tmp_path / "files", model, ModelConfig("acme/tiny"))
        assert not caplog.records
        eval_stage.warn_if_other_backbone(tmp_path / "other", model, ModelConfig(str(tiny_backbone_dir)))
    assert [r.getMessage() for r in caplog.records] == [
        f"heads at {tmp_path / 'other'} were trained on backbone acme/other (fingerprint "
        f"{other['fingerprint']}), evaluating on {tiny_backbone_dir} ({files['fingerprint']}): "
        "outputs stay exact, but tau will be lower"
    ]
