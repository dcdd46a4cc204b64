"""Stage `eval`: Medusa tree decoding against plain greedy `generate`, same prompts, same process.

Run as:
    python -m medusa_train stage=eval                                     # held-out embedded prompts (make eval)
    python -m medusa_train stage=eval eval.prompts=mtbench eval.path=../shared/data/mt_bench_questions.jsonl
    python -m medusa_train stage=eval eval.prompts=jsonl eval.path=prompts.jsonl eval.prompt_key=text
    python -m medusa_train stage=eval model=hf model.name_or_path=lmsys/vicuna-7b-v1.3 model.dtype=float16 \
        eval.heads_dir=path/to/heads tree=medusa63 eval.all_turns=true     # one GPU
    python -m medusa_train stage=eval eval.batch_sizes=[1,8,32] eval.assistant_model=path/to/small-draft-lm

Steps: (1) backbone (one the tree decoders refuse, ALiBi, layers of a type they do not serve, a
recurrent state or no position ids, is refused as soon as it is loaded), heads (either export layout;
checked against the backbone) and the tree (`tree=calibrated|medusa63|chain|custom`); after
`training=medusa2` the backbone is the one trained with the heads (`<heads>/backbone`, a LoRA adapter
merged into `model.name_or_path`) unless `model.name_or_path` names another checkpoint than their base
(see `medusa_train.backbone`); (2)
prompts: held-out embedded prompts, MT-bench questions or any prompt JSONL, rendered with the
backbone's chat template (first turn, or every turn conditioned on the model's own earlier answers
with `eval.all_turns=true`); (3) warm-up: the first turns through every decoder at their full budget,
untimed; (4) every turn through plain greedy `model.generate(do_sample=False)`, Medusa greedy decoding
and the alternatives a user would pick instead, back to back in an order that rotates from turn to
turn: transformers' prompt-lookup decoding (no training) and, with `eval.assistant_model`, assisted
generation with that draft model; each call timed whole, the device synchronised (same
max_new_tokens, same EOS ids; the protocol of `medusa_train.decoding.timing`: the headline speed-up
is the median per turn, checked against what tau and the measured step costs allow);
(5) tau of typical acceptance and exact sampling at `eval.temperature`; (6) per-head
top-1/top-5 accuracy (calibration.json, else held-out distilled data); (7) tau and speed-up for
calibrated trees of `eval.sweep_tree_sizes` nodes and the evaluated tree, on the same first
`eval.sweep_prompts` turns, and the tau the head accuracies predict beside the measured one; vLLM's
view: greedy tau of the top-1 chain of the first n heads, n = 1..K (what vLLM verifies with
`num_speculative_tokens=n`); (8) plain batched `generate` vs batched Medusa at
each of `eval.batch_sizes` (with `eval.compile`, also the compiled static-cache `generate` and the
static decoder with B rows); (9) with `eval.compare`, the same turns and tree decoded with other sets
of heads, each with its own backbone, and a trained backbone's drift from `model.name_or_path`
(argmax agreement, KL on held-out distilled positions); (10) report.json, report.md, plots and
generations.jsonl, written into a staging folder and swapped into `workdir/eval` as one (they always
come from the same run), then wandb, and the export's model card updated with the figures.

Metrics (DESIGN.md, computed in `medusa_train.report`): tau = new tokens / verification steps, the
bonus token counted (plain decoding = 1.0); speed-up = Medusa tokens/s over plain greedy tokens/s;
greedy_identical = fraction of prompts whose Medusa greedy output equals plain greedy (must be 1.0).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from medusa_train.backbone import (
    backbone_drift,
    backbone_identity,
    hf_source,
    load_backbone_for_heads,
    load_configured_backbone,
    older_fingerprint,
    other_code_fingerprint,
    other_kinds,
    resolve_device,
    same_path,
)
from medusa_train.backbone_source import check_assistant_source
from medusa_train.card_inputs import calibration_files, calibration_topk, read_calibration, stored_topk
from medusa_train.data.chat import ChatRenderer, eos_token_ids
from medusa_train.data.distilled import load_distilled, split_heldout
from medusa_train.data.embedded import embedded_prompts
from medusa_train.data.sources import Conversation, eval_prompts
from medusa_train.decoding import (
    PackedHeads,
    TreeBuffers,
    chain_tree,
    compute_head_accuracy,
    medusa_generate_batch,
)
from medusa_train.decoding.attention import check_verifiable
from medusa_train.decoding.calibrate import (
    calibrate_tree,
    device_label,
    expected_tau,
    grow_tree,
    per_rank_accuracy,
    timed_attention,
)
from medusa_train.decoding.generate import context_limit
from medusa_train.decoding.timing import (
    WARMUP_TURNS,
    TimedDecoders,
    batch_table,
    interleaved,
    pair_record,
    speedup_figures,
)
from medusa_train.decoding.tree import tree_for_heads
from medusa_train.errors import DamagedArtefactError, HeadsFormatError, UserError
from medusa_train.formats import load_heads
from medusa_train.head_targets import hidden_width, language_model
from medusa_train.heads import MedusaHeads
from medusa_train.heads_layout import check_heads_option, option_refusal, read_heads_config
from medusa_train.launch import is_main
from medusa_train.report import (
    HEADS_FINGERPRINT,
    alternatives,
    calibrated_machine,
    headline_speedup,
    is_calibrated_tree,
    machine_info,
    recommend_speculative_tokens,
    report_markdown,
    summarise,
    top1_top5,
    write_model_card,
    write_plots,
)
from medusa_train.tracking import Tracker, start_tracking
from medusa_train.training.records import Records, usable_indices
from medusa_train.workdir import (
    CHOICES,
    GENERATIONS,
    MANIFEST,
    MODEL_CARD,
    PLOTS,
    PREVIOUS,
    REPORT_JSON,
    REPORT_MD,
    Workdir,
    atomic_write_json,
    atomic_write_text,
    publish_dir,
    read_json,
    remove_stale,
    require,
    staging_dir,
)

if TYPE_CHECKING:  # annotations only: bench scripts import this stage where Hydra is not installed
    from medusa_train.config import Config, EvalConfig, ModelConfig

log = logging.getLogger(__name__)

HEADS_ACC_RECORDS = 64
"""Held-out distilled records used for head accuracy when calibration.json is missing."""
CHAIN_BATCH = 16
"""Turns decoded together when eval measures vLLM's top-1 chain taus (counts only, not timed)."""
DRIFT_RECORDS = 200
"""Held-out distilled records on which eval.compare measures a trained backbone's drift."""


def run(cfg: Config) -> dict:
    """Evaluate Medusa decoding; writes ``workdir/eval/`` and returns the report dict."""
    wd = Workdir(Path(cfg.workdir))
    if not is_main():
        return {"skipped": "not the main process"}
    ecfg = cfg.eval
    # 1. Heads, tree, prompts, the heads compared, the draft model's path and device (a mistake in any
    # fails in a second), then the wandb run: one wandb refuses (tracking=online without `wandb login`)
    # fails here, before the backbone loads and the turns decode; closed as failed if anything after raises.
    if ecfg.heads_dir:
        heads_dir = check_heads_option("eval.heads_dir", ecfg.heads_dir)
        heads = _load_heads(heads_dir, "eval.heads_dir")
    else:
        heads_dir = require(wd.heads, "trained heads", "train")
        heads = _load_heads(heads_dir)
    fingerprint = heads.fingerprint()  # as read: the model card states these figures only for these heads
    choices = tree_for_heads(cfg.tree, heads_dir, heads)
    stored_topk(heads_dir)  # every calibration.json read in 1. and 6.: a damaged one fails here
    prompts = load_eval_prompts(ecfg)
    for entry in ecfg.compare:  # decoded in 9., after the main run: a wrong one must not wait for that
        _compare_dir(entry)
    if ecfg.assistant_model:  # loaded after the backbone: a missing directory must not wait for that
        check_assistant_source(ecfg.assistant_model)
    device = resolve_device(cfg.model.device)
    with start_tracking(cfg.tracking, wd.root, "eval", config=asdict(cfg)) as tracker:
        return _evaluate(cfg, wd, tracker, heads_dir, heads, fingerprint, choices, prompts, device)


def _evaluate(
    cfg: Config,
    wd: Workdir,
    tracker: Tracker,
    heads_dir: Path,
    heads: MedusaHeads,
    fingerprint: str,
    choices: list[list[int]],
    prompts: list[Conversation],
    device: torch.device,
) -> dict:
    """Steps 1 (the backbone) to 10 of the module docstring, on what :func:`run` read and checked."""
    ecfg = cfg.eval
    model, tok, backbone, trained = load_backbone_for_heads(cfg.model, heads_dir, device)
    log.info(
        "eval: backbone %s%s", backbone, " (trained with the heads: training=medusa2)" if trained else ""
    )
    check_verifiable(model)  # a model the decoders refuse (tree_refusal): refused now
    if stored_topk(heads_dir) is None and (wd.distill / MANIFEST).is_file():
        # 6. scores the heads through it: a model with none is refused now, not once 3.-5. have decoded
        language_model(model)
    check_heads_match(heads, model, heads_dir, backbone)
    if not trained:  # a trained Medusa-2 backbone is the heads' own
        warn_if_other_backbone(heads_dir, model, cfg.model)
    lm_weight = model.get_output_embeddings().weight
    heads = heads.to(device=lm_weight.device, dtype=lm_weight.dtype)
    named = choices  # the tree `tree=` names; the model card compares it with the exported one
    choices, tree_fit = fit_tree_to_device(cfg, heads_dir, model, choices)
    packed = PackedHeads(heads)
    tree = TreeBuffers.from_choices(choices).to(lm_weight.device)
    decode = TimedDecoders(
        model, packed, tree, eos_token_ids(model, tok), tok.pad_token_id, attention=ecfg.attention
    )
    # The alternatives, each a plain `generate` with one more argument (greedy: outputs must match).
    others: dict[str, dict] = {"prompt_lookup": {"prompt_lookup_num_tokens": ecfg.prompt_lookup_tokens}}
    if ecfg.assistant_model:
        others["assisted"] = {"assistant_model": load_assistant(ecfg.assistant_model, model)}
    if ecfg.compile:  # the compiled baseline; Medusa's static decoder runs next to it in 3. and 4.
        others["compiled_plain"] = decode.compiled_generate_args()

    # 2. Prompts (loaded in 1.), rendered with the backbone's chat template, turn by turn.
    if not tok.chat_template:
        raise UserError(
            "the backbone's tokenizer has no chat template: eval renders prompts with apply_chat_template"
        )
    renderer = ChatRenderer(tok)

    def render(prompt: Conversation, history: list[str]) -> torch.Tensor:
        return torch.tensor([renderer.turn_prompt_ids(prompt, history)], device=lm_weight.device)  # (1, T)

    # 3. Warm-up: every decoder on the first turns at their full budget (the shapes timed in 4.); untimed.
    for prompt in prompts[:WARMUP_TURNS]:
        ids = render(prompt, [])
        budget = turn_budget(model, ids.shape[1], ecfg.max_new_tokens)
        if budget > 0:
            with decode.warming_up():
                decode.plain(ids, budget)
                decode.medusa(ids, budget)
                for extra in others.values():
                    decode.plain(ids, budget, **extra)
                if ecfg.compile:
                    decode.medusa_static(ids, budget)
    if ecfg.compile:  # every first turn's shapes compiled and captured before anything is timed
        firsts = [render(prompt, []) for prompt in prompts]
        budgets = [turn_budget(model, ids.shape[1], ecfg.max_new_tokens) for ids in firsts]
        decode.warm_up_compiled(
            [(i, b) for i, b in zip(firsts, budgets, strict=True) if b > 0], others["compiled_plain"]
        )

    # 4. Plain greedy, Medusa greedy and the alternatives, prompt by prompt (turn by turn).
    records: list[dict] = []
    inputs: list[tuple[torch.Tensor, int]] = []  # (prompt ids, max_new_tokens) per turn, for 5. and 7.
    for p_idx, prompt in enumerate(tqdm(prompts, desc="eval", unit="prompt")):
        history: list[str] = []
        for t_idx in range(len(prompt.turns) if ecfg.all_turns else 1):
            ids = render(prompt, history)  # (1, T): turn t_idx after the model's own earlier answers
            budget = turn_budget(model, ids.shape[1], ecfg.max_new_tokens)
            if budget <= 0:
                log.warning(
                    "prompt %s turn %d fills the context (%d tokens): skipped",
                    prompt.source_id,
                    t_idx,
                    ids.shape[1],
                )
                break
            calls = [partial(decode.plain, ids, budget), partial(decode.medusa, ids, budget)]
            calls += [partial(decode.plain, ids, budget, **extra) for extra in others.values()]
            if ecfg.compile:
                calls.append(partial(decode.medusa_static, ids, budget))
            base, med, *alt_out = interleaved(len(records), calls)  # the order rotates turn by turn
            alt = dict(zip([*others, "static_medusa"] if ecfg.compile else others, alt_out, strict=True))
            base_text = tok.decode(base.tokens, skip_special_tokens=True)
            records.append(
                {
                    "prompt_index": p_idx,
                    "source_id": prompt.source_id,
                    "turn": t_idx,
                    "prompt": prompt.turns[t_idx],
                    "baseline": base_text,
                    "medusa": tok.decode(med.tokens, skip_special_tokens=True),
                    **pair_record(base, med),
                    **{f"{name}_tokens": len(out.tokens) for name, out in alt.items()},
                    **{f"{name}_s": out.seconds for name, out in alt.items()},
                    **{f"{name}_identical": out.tokens == base.tokens for name, out in alt.items()},
                }
            )
            inputs.append((ids, budget))
            history.append(base_text)
    if not records:
        raise UserError(
            "no evaluation prompt fits the model's context: use shorter prompts or a smaller eval.max_new_tokens"
        )

    report = summarise(records, num_prompts=len({r["prompt_index"] for r in records}))
    report.update(
        tree=cfg.tree.name,
        tree_size=len(choices),
        tree_choices=named,
        tree_fit=tree_fit,
        max_new_tokens=ecfg.max_new_tokens,
        all_turns=ecfg.all_turns,
    )
    report.update(
        prompts=ecfg.prompts,
        backbone=backbone,
        heads_dir=str(heads_dir),
        num_heads=heads.num_heads,
        head_projection=heads.head_projection,
        draft_vocab_size=heads.draft_vocab_size,
    )
    report[HEADS_FINGERPRINT] = fingerprint
    report["prompts_note"] = (
        "the prompts are the embedded demo's held-out conversations, not your model's domain: pass "
        "eval.prompts=mtbench|jsonl eval.path=<file> to measure on your own"
        if ecfg.prompts == "embedded" and not cfg.model.embedded
        else None
    )

    # 5. Tau of typical acceptance and exact sampling (distribution-level rules: tau only).
    report["temperature"] = ecfg.temperature
    if ecfg.acceptance_extra:
        log.info(
            "tau of typical acceptance and exact sampling at T=%s (%d turns each)",
            ecfg.temperature,
            len(inputs),
        )
    for rule in ("typical", "sample"):
        report[f"tau_{rule}"] = decode.tau_of(inputs, rule, ecfg) if ecfg.acceptance_extra else None

    # 6. Per-head accuracy.
    topk, source = head_topk(heads_dir, wd, cfg, model, heads)
    report["head_accuracy_source"] = source
    top1, top5 = top1_top5(topk) if topk else (None, None)
    report["head_top1"] = [round(a, 4) for a in top1] if top1 else None
    report["head_top5"] = [round(a, 4) for a in top5] if top5 else None

    # 7. Tau and speed-up against tree size (calibrated trees grown from the head accuracies).
    report["sweep"] = (
        sweep(decode, topk, inputs, ecfg, choices, cfg.tree.topk) if topk and ecfg.sweep_tree_sizes else []
    )
    report.update(tau_check(report, topk, choices))

    # 7b. vLLM's view: greedy tau of the top-1 chain of the first n heads, n = 1..K, same turns.
    report["vllm_chain"] = vllm_chain(
        model, packed, inputs, heads.num_heads, eos_token_ids(model, tok), ecfg.max_new_tokens
    )
    report["vllm_num_speculative_tokens"] = recommend_speculative_tokens(report["vllm_chain"])

    # 8. The alternatives (from 4.) and speed-up against batch size.
    report["alternatives"] = alternatives(records)
    report["alternatives"]["prompt_lookup"]["setting"] = f"{ecfg.prompt_lookup_tokens} tokens"
    if ecfg.assistant_model:
        report["alternatives"]["assisted"]["setting"] = ecfg.assistant_model
    if ecfg.compile:
        report["alternatives"]["compiled_plain"]["setting"] = "cache_implementation=static"
        static = report["alternatives"]["static_medusa"]
        # auto resolves at each static capacity with a captured step's threshold: possibly not the
        # attention the tree was calibrated with (the eager decoders' at tree.latency_context)
        static["attention"] = {str(c): a for c, a in sorted(decode.static_attention.items())}
        static["setting"] = static_setting(
            decode.static_capture, decode.static_attention, static["speedup_vs_compiled"]
        )
    report["batch_sizes"] = batch_table(
        decode, inputs, ecfg.batch_sizes, report, others["compiled_plain"] if ecfg.compile else None
    )

    # 9. Other heads (eval.compare), each with its own backbone, on the same turns and tree.
    report["comparison"] = []
    if ecfg.compare:
        main = {"name": str(heads_dir), "heads_dir": str(heads_dir), "backbone": backbone, "trained": trained}
        main.update(
            {k: report[k] for k in ("tau", "speedup", "greedy_identical")}, head_top1=report["head_top1"]
        )
        del decode, packed
        report["comparison"] = compare_heads(cfg, wd, main, model, inputs, choices, tok)
    report["machine"] = machine_info(lm_weight.device)
    report["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")

    # 10. Files and plots, published together; tracking; model card.
    out = wd.eval
    remove_stale(out)
    tmp = staging_dir(out)
    try:
        atomic_write_text(tmp / GENERATIONS, "".join(json.dumps(rec) + "\n" for rec in records))
        atomic_write_json(tmp / REPORT_JSON, report)
        atomic_write_text(tmp / REPORT_MD, report_markdown(report))
        plots = {name: out / PLOTS / path.name for name, path in write_plots(report, tmp / PLOTS).items()}
        kept = keep_previous(out, tmp)
        publish_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    tracker.summary(
        {k: v for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    )
    tracker.summary(
        {
            f"{name}/{k}": v
            for name, row in report["alternatives"].items()
            for k, v in row.items()
            if k != "setting"
        }
    )
    # A row per tree size and per batch size, each family plotted against its own x (the rows' wandb
    # step is only their order)
    tracker.define_axis("sweep", "tree_size")
    tracker.define_axis("batch", "batch_size")
    for row in report["sweep"]:
        tracker.log(
            {"sweep/tau": row["tau"], "sweep/speedup": row["speedup"], "sweep/tree_size": row["tree_size"]}
        )
    for row in report["batch_sizes"]:
        tracker.log({f"batch/{k}": v for k, v in row.items()})
    for name, path in plots.items():
        tracker.log_image(f"eval/{name}", path)
    tracker.finish()
    if (wd.export / MODEL_CARD).is_file() and _is_workdir_heads(heads_dir, wd):
        _refresh_model_card(wd, heads_dir)
    if report["greedy_identical"] < 1.0:
        log.error(
            "Medusa greedy output differs from plain greedy on %.0f%% of prompts: see %s",
            100 * (1 - report["greedy_identical"]),
            out / GENERATIONS,
        )
    if kept is not None:
        log.info("eval: the previous report (%s) is kept in %s", kept, out / PREVIOUS)
    for key in ("speedup_note", "tau_note", "prompts_note"):
        if report[key]:
            log.warning("eval: %s", report[key])
    log.info(
        "eval: tau %.2f, speed-up %s (median over %d turns), greedy identical %.0f%%",
        report["tau"],
        headline_speedup(report),
        report["num_turns"],
        100 * report["greedy_identical"],
    )
    return report


# ---------------------------------------------------------------------------------------------
# inputs


def _load_heads(heads_dir: Path, option: str | None = None):
    """The heads in ``heads_dir``: those ``option`` names (``eval.heads_dir``, an ``eval.compare``
    entry), refused in its words (:func:`~medusa_train.heads_layout.option_refusal`), or else the
    workdir's, which stage=train writes again when damaged."""
    try:
        return load_heads(heads_dir)
    except HeadsFormatError as err:
        if option is not None:
            raise option_refusal(option, err) from None
        raise UserError(
            f"cannot load Medusa heads: {err} (run `python -m medusa_train stage=train training.overwrite=true` "
            "to write them again, or set eval.heads_dir=)"
        ) from None


def check_heads_match(heads, model, heads_dir: Path, backbone: str) -> None:
    """Raise :class:`UserError` when the heads do not fit the backbone (hidden/vocab sizes, a token map
    outside its vocabulary, shared heads without an lm_head to use); bind shared heads to its lm_head."""
    vocab, hidden = model.get_output_embeddings().weight.shape[0], hidden_width(model)
    if (heads.hidden_size, heads.vocab_size) != (hidden, vocab):
        raise UserError(
            f"heads at {heads_dir} were trained for hidden_size={heads.hidden_size}, vocab_size={heads.vocab_size} "
            f"but backbone {backbone} has hidden_size={hidden}, vocab_size={vocab}: pass the backbone they were "
            "trained on (model.name_or_path=...) or other heads (eval.heads_dir=...)"
        )
    try:
        heads.attach(model)
    except HeadsFormatError as err:
        raise UserError(f"heads at {heads_dir} do not fit backbone {backbone}: {err}") from None


def warn_if_other_backbone(heads_dir: Path, model, model_cfg: ModelConfig) -> None:
    """Warn when stage=train recorded a different backbone fingerprint (same shapes, other weights).
    A fingerprint of a model's tensors (a model built in memory) and one of files compare nothing:
    heads recorded with one kind and evaluated on the same name with the other pass.

    ``model`` is ``model.name_or_path`` at ``model.revision``, fingerprinted as stage=train did: a Hub
    id's files are those of that revision's snapshot (a pinned commit is read from the cache without
    asking the Hub), not of whatever its main branch points to.
    """
    try:
        recorded = read_heads_config(heads_dir).get("backbone")
    except HeadsFormatError:
        return
    if isinstance(recorded, dict) and recorded.get("fingerprint"):
        name_or_path = model_cfg.name_or_path
        current = backbone_identity(
            model, name_or_path, model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code
        )["fingerprint"]
        if older_fingerprint(recorded["fingerprint"], current):  # differs whatever the weights
            log.warning(
                "heads at %s carry a backbone fingerprint of an earlier medusa_train, which cannot say "
                "whether they were trained on %s's weights: if tau is low, train them on it again",
                heads_dir,
                name_or_path,
            )
        elif current != recorded["fingerprint"] and not (
            # one of a model's tensors and one of files compare nothing: the name decides
            other_kinds(recorded["fingerprint"], current)
            and same_path(name_or_path, str(recorded.get("name_or_path")))
        ):
            trust = model_cfg.trust_remote_code
            if same_path(name_or_path, str(recorded.get("name_or_path"))) and recorded[
                "fingerprint"
            ] == other_code_fingerprint(name_or_path, model_cfg.revision, trust_remote_code=trust):
                log.warning(
                    "heads at %s were trained on %s loaded with model.trust_remote_code=%s, evaluating "
                    "with %s (another class may compute the model): outputs stay exact, but tau may be "
                    "lower; set model.trust_remote_code=%s as training did",
                    heads_dir,
                    name_or_path,
                    str(not trust).lower(),
                    str(trust).lower(),
                    str(not trust).lower(),
                )
                return
            log.warning(
                "heads at %s were trained on backbone %s (fingerprint %s), evaluating on %s (%s): "
                "outputs stay exact, but tau will be lower",
                heads_dir,
                recorded.get("name_or_path"),
                recorded["fingerprint"],
                name_or_path,
                current,
            )


def load_eval_prompts(ecfg: EvalConfig) -> list[Conversation]:
    """``eval.num_prompts`` prompts from the configured source (held-out embedded, MT-bench, JSONL)."""
    if ecfg.prompts != "embedded":
        prompts, result = eval_prompts(ecfg.prompts, ecfg.path, ecfg.prompt_key, ecfg.num_prompts)
        result.log_warning(log, strict_option=None)  # eval skips bad prompts, no setting refuses them
        return prompts
    prompts = []
    for i, conv in enumerate(embedded_prompts("eval", ecfg.num_prompts, ecfg.seed)):
        system = next((m["content"] for m in conv if m["role"] == "system"), None)
        turns = [m["content"] for m in conv if m["role"] == "user"]
        prompts.append(Conversation(f"embedded-eval:{i}", turns, system))
    return prompts[: ecfg.num_prompts]


def keep_previous(out: Path, staging: Path) -> str | None:
    """Copy the report in ``out`` (the last run's files, not its own ``previous/``) into ``staging/previous``,
    so publishing ``staging`` keeps one run of history; returns the kept report's date, or None."""
    if not (out / REPORT_JSON).is_file():
        return None
    shutil.copytree(out, staging / PREVIOUS, ignore=lambda d, names: [PREVIOUS] if Path(d) == out else [])
    try:
        date = read_json(out / REPORT_JSON, repair="").get("date")
    except DamagedArtefactError:
        date = None
    return str(date or "undated")


def turn_budget(model, prompt_len: int, max_new_tokens: int) -> int:
    """``max_new_tokens``, cut so that prompt + new tokens fit the model's positions (same for both decoders)."""
    limit = context_limit(model)
    return max_new_tokens if limit is None else min(max_new_tokens, limit - prompt_len)


# ---------------------------------------------------------------------------------------------
# decoding


def fit_tree_to_device(
    cfg: Config, heads_dir: Path, model, choices: list[list[int]]
) -> tuple[list[list[int]], dict]:
    """The tree for this run's device: with ``tree=calibrated``, the stored tree if calibration.json says
    it was calibrated on this device and dtype with the tree attention ``eval.attention`` takes at the
    stored curve's context (:func:`~medusa_train.decoding.calibrate.timed_attention`), else one
    calibrated here from the stored head accuracies and a latency curve measured now with
    ``eval.attention`` (``eval.fit_tree=false`` keeps the stored tree).

    A calibration.json that chose another tree than ``choices`` (an export of a pinned tree ships the
    heads' own calibration; matched as the export's card matches it:
    :func:`~medusa_train.report.is_calibrated_tree`) says nothing of where ``choices`` was fitted: the
    stored tree is kept as it is, as without a calibration.json, with one warning line.

    Raises:
        DamagedArtefactError: calibration.json is damaged (:func:`read_calibration`).

    Returns:
        The tree's paths and ``{"device", "calibrated_for", "recalibrated", ...}`` for the report.
    """
    stored: dict = {}
    if cfg.tree.name == "calibrated":
        found = calibration_files(heads_dir)
        stored = read_calibration(found[0]) if found else {}
        if stored and not is_calibrated_tree(cfg.tree.name, choices, stored):
            tree_file = next(
                (p for p in (heads_dir / CHOICES, heads_dir.parent / CHOICES) if p.is_file()), None
            )
            log.warning(
                "eval: %s was calibrated for another tree than the %d-node tree in %s: that tree is "
                "evaluated as it is, neither labelled with the calibration's device nor fitted to this one",
                found[0],
                len(choices),
                tree_file,
            )
            stored = {}
    stored_tree = stored.get("tree") or {}
    context = stored_tree.get("context_len", cfg.tree.latency_context)
    timed = timed_attention(cfg.eval.attention, next(model.parameters()).device, context, model)
    here = device_label(model, timed)
    info: dict = {"device": here, "calibrated_for": None, "recalibrated": False}
    if cfg.tree.name != "calibrated":
        info["pinned"] = cfg.tree.name
        return choices, info
    info["calibrated_for"] = stored_tree.get("calibrated_for")
    if info["calibrated_for"] and "attention" not in info["calibrated_for"]:
        # written before calibration.json recorded the attention: every curve then was timed on SDPA
        info["calibrated_for"] = {**info["calibrated_for"], "attention": "sdpa"}
    topk = calibration_topk(stored) if stored else None
    if not topk or info["calibrated_for"] == here:
        return choices, info
    if not cfg.eval.fit_tree:
        log.warning(
            "eval: the tree was calibrated for %s and this run decodes on %s: eval.fit_tree=false keeps it",
            calibrated_machine(info["calibrated_for"]),
            calibrated_machine(here),
        )
        return choices, info
    log.info(
        "eval: the tree was calibrated for %s, this run is on %s: calibrating it again here",
        calibrated_machine(info["calibrated_for"]),
        calibrated_machine(here),
    )
    acc = torch.tensor(topk)  # (K, R)
    result = calibrate_tree(
        model,
        acc,
        cfg.tree.max_nodes,
        min(cfg.tree.topk, acc.shape[1]),
        cfg.tree.latency_context,
        attention=cfg.eval.attention,
        tolerance=cfg.tree.tolerance,
    )
    info.update(
        recalibrated=True,
        previous=info["calibrated_for"],
        calibrated_for=result["calibrated_for"],
        previous_size=len(choices),
        expected_tau=round(result["best"]["expected_tau"], 4),
        latency_context=result["context_len"],
        choices=result["choices"],
    )
    return result["choices"], info


def static_setting(capture: str, attention: dict[int, str], vs_compiled: float) -> str:
    """The static decoder's row setting in the alternatives: its capture, the tree attention of its
    decoders (``{capacity: attention}``; per capacity where they differ) and its speed-up over the
    compiled plain baseline."""
    caps_of: dict[str, list[int]] = {}
    for capacity, name in sorted(attention.items()):
        caps_of.setdefault(name, []).append(capacity)
    if len(caps_of) == 1:
        used = f"{next(iter(caps_of))} attention"
    else:
        used = ", ".join(
            f"{name} attention at {'/'.join(map(str, caps))} columns" for name, caps in caps_of.items()
        )
    return f"{capture}, {used}; {vs_compiled:.2f}x compiled plain"


def head_topk(
    heads_dir: Path, wd: Workdir, cfg: Config, model, heads
) -> tuple[list[list[float]] | None, str | None]:
    """Cumulative top-k accuracy ``(K, R)`` of every head and where it came from.

    Read from ``calibration.json`` (written by stage=train) when present, else computed on this
    workdir's held-out distilled records truncated to ``training.max_seq_len``, as the calibration
    reads them (also for heads from elsewhere, ``eval.heads_dir``: held-out text of this backbone all
    the same, but not necessarily what those heads were trained beside); ``(None, None)`` when neither
    exists.
    """
    stored = stored_topk(heads_dir)
    if stored is not None:
        return stored[0], str(stored[1])
    if not (wd.distill / MANIFEST).is_file():
        return None, None
    _, held_ds = split_heldout(load_distilled(wd.distill), cfg.data.eval_fraction)
    # Truncated as training and its calibration read them: a head never trained past max_seq_len.
    max_len = cfg.training.max_seq_len
    held = Records(held_ds, usable_indices(held_ds, max_len), max_len)
    if len(held) == 0:
        return None, None
    device = next(model.parameters()).device
    rows = [held[i] for i in range(min(HEADS_ACC_RECORDS, len(held)))]
    batches = (
        (torch.tensor([r["input_ids"]], device=device), torch.tensor([r["loss_mask"]], device=device).bool())
        for r in rows
    )
    acc = compute_head_accuracy(model, heads, batches, max_k=10)  # (K, 10)
    return acc.tolist(), f"{wd.distill} (held-out, {len(rows)} records)"


def sweep(
    decode: TimedDecoders,
    topk: list[list[float]],
    inputs: list[tuple[torch.Tensor, int]],
    ecfg,
    choices: list[list[int]],
    ranks: int,
) -> list[dict]:
    """Tau and speed-up of calibrated trees of ``eval.sweep_tree_sizes`` nodes and of the evaluated
    tree (``choices``, its row marked ``main``) on the first ``eval.sweep_prompts`` turns of the main run.

    The trees are grown as the calibration grows them, from the first ``ranks`` (``tree.topk``)
    candidates of each head, so a calibrated tree of a swept size is that row's tree; the evaluated
    tree's expected tau counts every rank of ``topk`` (a pinned tree may use more).

    The timing protocol of :mod:`medusa_train.decoding.timing`: every tree warmed up on the first
    turns, then per turn plain greedy and every tree back to back in an order that rotates from turn
    to turn; each row's speed-up is the median over turns of its tokens/s over that turn's plain tokens/s.
    """
    acc = per_rank_accuracy(torch.tensor(topk))  # (K, R)
    trees, expected = grow_tree(acc[:, :ranks], max(ecfg.sweep_tree_sizes))
    sizes = sorted({int(s) for s in ecfg.sweep_tree_sizes if 0 < int(s) <= len(trees)})
    if len(sizes) < len(set(ecfg.sweep_tree_sizes)):
        log.warning(
            "sweep: the heads' top-k table gives trees of at most %d nodes; larger sizes skipped", len(trees)
        )
    turns = inputs[: ecfg.sweep_prompts]
    log.info("tree-size sweep: %s nodes and the evaluated tree on %d turns", sizes, len(turns))
    main = sorted(map(tuple, choices))
    specs = [(size, trees[size - 1], float(expected[size - 1])) for size in sizes]
    if not any(sorted(map(tuple, tree)) == main for _, tree, _ in specs):
        specs.append((len(choices), choices, expected_tau(acc, choices)))
    built = [TreeBuffers.from_choices(tree).to(decode.device) for _, tree, _ in specs]
    with decode.warming_up():  # each tree's shapes, untimed
        for ids, budget in turns[:WARMUP_TURNS]:
            for tree in built:
                decode.medusa(ids, budget, tree=tree)
    records: list[list[dict]] = [[] for _ in specs]
    for t, (ids, budget) in enumerate(turns):
        calls = [partial(decode.plain, ids, budget)]
        calls += [partial(decode.medusa, ids, budget, tree=tree) for tree in built]
        base, *outs = interleaved(t, calls)
        for per_tree, out in zip(records, outs, strict=True):
            per_tree.append(pair_record(base, out))
    rows = []
    for (size, tree, exp), per_tree in zip(specs, records, strict=True):
        figures = speedup_figures(per_tree)
        rows.append(
            {
                "tree_size": size,
                "main": sorted(map(tuple, tree)) == main,
                "expected_tau": round(exp, 4),
                "tau": figures["tau"],
                "tokens_per_s": figures["tokens_per_s_medusa"],
                "tokens_per_s_baseline": figures["tokens_per_s_baseline"],
                **{k: figures[k] for k in SWEEP_ROW_FIGURES},
                "turns": len(turns),
            }
        )
    return sorted(rows, key=lambda r: (r["tree_size"], not r["main"]))


SWEEP_ROW_FIGURES = ("speedup", "speedup_q25", "speedup_q75", "speedup_tokens_per_s", "speedup_plausible")
"""The :func:`~medusa_train.decoding.timing.speedup_figures` a row of the tree-size sweep keeps."""


TAU_MARGIN = 0.15
"""Relative gap between the tau the head accuracies predict for the evaluated tree and the measured
tau above which the report says so."""


def tau_check(report: dict, topk: list[list[float]] | None, choices: list[list[int]]) -> dict:
    """The tau the head accuracies predict for the evaluated tree (``expected_tau``), the sweep's
    fastest tree size (``sweep_fastest``), and a one-line ``tau_note`` when the measured tau is more
    than :data:`TAU_MARGIN` away from the expected one."""
    if not topk:
        return {"expected_tau": None, "sweep_fastest": None, "tau_note": None}
    expected = expected_tau(per_rank_accuracy(torch.tensor(topk)), choices)
    fastest = max(report["sweep"], key=lambda r: r["speedup"]) if report["sweep"] else None
    note = None
    if abs(report["tau"] - expected) > TAU_MARGIN * expected:
        note = (
            f"measured tau {report['tau']:.2f} is more than {TAU_MARGIN:.0%} "
            f"{'below' if report['tau'] < expected else 'above'} the {expected:.2f} that the head accuracies "
            f"({report.get('head_accuracy_source')}) predict for this {len(choices)}-node tree: the prompts are "
            "not like the held-out data the heads were measured on"
        )
        if fastest is not None:
            note += (
                f"; the sweep found the {fastest['tree_size']}-node tree fastest "
                f"({fastest['speedup']:.2f}x, tau {fastest['tau']:.2f})"
            )
    return {
        "expected_tau": round(expected, 4),
        "sweep_fastest": fastest["tree_size"] if fastest else None,
        "tau_note": note,
    }


def vllm_chain(
    model,
    packed: PackedHeads,
    inputs: list[tuple[torch.Tensor, int]],
    num_heads: int,
    eos: list[int],
    max_new_tokens: int,
) -> list[dict]:
    """Greedy tau of the top-1 chain of the first n heads on every turn of ``inputs``, n = 1..K.

    That chain is what vLLM's Medusa proposer verifies with ``num_speculative_tokens=n`` (each head's
    argmax, no tree); tau is pooled over the turns (new tokens / steps), as vLLM pools acceptance
    over requests. Counts only, no timing, so the turns go through the batched decoder,
    ``CHAIN_BATCH`` at a time (each row stops at ``max_new_tokens`` or the context limit, as
    :func:`turn_budget` cut it).
    """
    device = next(model.parameters()).device
    prompts = [ids for ids, _ in inputs]
    rows = []
    for n in range(1, num_heads + 1):
        tree = TreeBuffers.from_choices(chain_tree(n)).to(device)
        tokens = steps = 0
        for start in range(0, len(prompts), CHAIN_BATCH):
            out = medusa_generate_batch(
                model,
                packed,
                prompts[start : start + CHAIN_BATCH],
                max_new_tokens=max_new_tokens,
                tree=tree,
                eos_token_id=eos,
                pad_token_id=eos[0] if eos else 0,
            )
            tokens += out.num_tokens
            steps += sum(row.num_steps for row in out.rows)
        rows.append(
            {"num_speculative_tokens": n, "tau": tokens / max(1, steps), "tokens": tokens, "steps": steps}
        )
    log.info("vLLM top-1 chain tau for n = 1..%d: %s", num_heads, ", ".join(f"{r['tau']:.2f}" for r in rows))
    return rows


def load_assistant(name_or_path: str, model) -> torch.nn.Module:
    """The draft model for assisted generation, on the backbone's device and dtype, same vocabulary."""
    weight = model.get_output_embeddings().weight
    try:
        draft = AutoModelForCausalLM.from_pretrained(hf_source(name_or_path), dtype=weight.dtype)
    except (OSError, ValueError) as err:
        raise UserError(
            f"eval.assistant_model={name_or_path} cannot be loaded ({err}): give a Hugging Face causal LM "
            "name or directory, or eval.assistant_model=null"
        ) from None
    vocab = draft.get_output_embeddings().weight.shape[0]
    if vocab != weight.shape[0]:
        raise UserError(
            f"eval.assistant_model={name_or_path} has a vocabulary of {vocab} tokens, the backbone {weight.shape[0]}: "
            "assisted generation needs a draft model with the backbone's tokenizer"
        )
    return draft.to(weight.device).eval()


# ---------------------------------------------------------------------------------------------
# several sets of heads


def compare_heads(cfg: Config, wd: Workdir, main: dict, model, inputs, choices, tok) -> list[dict]:
    """One row per set of heads: ``main`` (measured above with ``model``), then each of ``eval.compare``.

    Each set decodes the same turns (``inputs``: the rendered prompts and budgets of the main run)
    with the same tree, plain greedy and Medusa back to back per turn, with the backbone that goes
    with it (``load_backbone_for_heads``: a Medusa-2 set's trained backbone). A trained backbone's
    drift is measured against ``model.name_or_path`` on the held-out distilled records.
    """
    device = next(model.parameters()).device
    drift_batches = _drift_batches(wd, cfg)
    original = None if main["trained"] else model  # the backbone as configured, loaded at most once
    rows = []
    for entry in [None, *cfg.eval.compare]:
        if entry is None:
            row, candidate = dict(main), model
        else:
            heads_dir = _compare_dir(entry)
            heads = _load_heads(heads_dir, "eval.compare")
            other, other_tok, backbone, trained = load_backbone_for_heads(cfg.model, heads_dir, device)
            check_heads_match(heads, other, heads_dir, backbone)
            if other_tok.get_vocab() != tok.get_vocab():
                raise UserError(
                    f"eval.compare: {entry} comes with another tokenizer than {main['backbone']}: the sets "
                    "compared must decode the same token ids"
                )
            row = {"name": entry, "heads_dir": str(heads_dir), "backbone": backbone, "trained": trained}
            row.update(
                _decode_turns(
                    other,
                    heads,
                    choices,
                    inputs,
                    eos_token_ids(other, tok),
                    tok.pad_token_id,
                    cfg.eval.attention,
                )
            )
            topk, _ = head_topk(heads_dir, wd, cfg, other, heads)
            row["head_top1"] = [round(a, 4) for a in top1_top5(topk)[0]] if topk else None
            candidate = other
        row.update(argmax_agreement=None, kl=None, drift_positions=0)
        if row["trained"] and drift_batches:
            if original is None:
                original, _ = load_configured_backbone(cfg.model, device)
            drift = backbone_drift(original, candidate, drift_batches)
            row.update(
                argmax_agreement=drift["argmax_agreement"], kl=drift["kl"], drift_positions=drift["positions"]
            )
        log.info(
            "eval.compare: %s: tau %.2f, speed-up %.2fx, identical %.0f%%%s",
            row["name"],
            row["tau"],
            row["speedup"],
            100 * row["greedy_identical"],
            f", argmax agreement {row['argmax_agreement']:.4f}, KL {row['kl']:.4f}"
            if row["argmax_agreement"] is not None
            else "",
        )
        rows.append(row)
        del candidate
    return rows


def _compare_dir(entry: str) -> Path:
    """An ``eval.compare`` entry's heads folder (:func:`~medusa_train.heads_layout.check_heads_option`),
    with no damaged calibration.json (:func:`~medusa_train.card_inputs.stored_topk`)."""
    heads_dir = check_heads_option("eval.compare", entry)
    stored_topk(heads_dir)  # their calibration.json, read in 9.: a damaged one fails now
    return heads_dir


def _decode_turns(
    model, heads, choices, inputs, eos: list[int], pad: int | None, attention: str = "sdpa"
) -> dict:
    """Plain greedy and Medusa greedy on every turn of ``inputs``: tau, speed-up, identical outputs."""
    weight = model.get_output_embeddings().weight
    packed = PackedHeads(heads.to(device=weight.device, dtype=weight.dtype))
    tree = TreeBuffers.from_choices(choices).to(weight.device)
    decode = TimedDecoders(model, packed, tree, eos, pad, attention=attention)
    with decode.warming_up():  # not timed
        for ids, budget in inputs[:WARMUP_TURNS]:
            decode.plain(ids, budget)
            decode.medusa(ids, budget)
    records = []
    for i, (ids, budget) in enumerate(inputs):
        base, med = interleaved(i, [partial(decode.plain, ids, budget), partial(decode.medusa, ids, budget)])
        records.append({"prompt_index": i, **pair_record(base, med)})
    figures = summarise(records, num_prompts=len(records))
    return {k: figures[k] for k in ("tau", "speedup", "greedy_identical")}


def _drift_batches(wd: Workdir, cfg: Config) -> list[dict]:
    """Held-out distilled records (at most ``DRIFT_RECORDS``), one per batch; [] without distilled data."""
    if not (wd.distill / MANIFEST).is_file():
        return []
    _, held = split_heldout(load_distilled(wd.distill), cfg.data.eval_fraction)
    batches = []
    for r in held.select(range(min(DRIFT_RECORDS, len(held)))):
        ids = torch.tensor([r["input_ids"][: cfg.training.max_seq_len]])  # (1, T)
        mask = torch.tensor([r["loss_mask"][: cfg.training.max_seq_len]])  # (1, T)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask})
    return batches


def _is_workdir_heads(heads_dir: Path, wd: Workdir) -> bool:
    """True when the evaluated heads are this workdir's (workdir/heads or inside workdir/export)."""
    resolved, export = heads_dir.resolve(), wd.export.resolve()
    return resolved == wd.heads.resolve() or resolved == export or export in resolved.parents


def _refresh_model_card(wd: Workdir, heads_dir: Path) -> None:
    """Add the measured figures to ``workdir/export/README.md`` (export runs before eval in stage=all)."""
    try:
        write_model_card(wd.export, heads_dir=heads_dir, wd=wd)
    except Exception as err:  # the card is a convenience: never fail an evaluation over it
        log.warning("could not update %s: %s", wd.export / MODEL_CARD, err)
