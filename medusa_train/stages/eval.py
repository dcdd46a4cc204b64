"""Stage `eval`: Medusa tree decoding against plain greedy `generate`, same prompts, same process.

Run as:
    python -m medusa_train stage=eval                                     # held-out embedded prompts (make eval)
    python -m medusa_train stage=eval eval.prompts=mtbench eval.path=../shared/data/mt_bench_questions.jsonl
    python -m medusa_train stage=eval eval.prompts=jsonl eval.path=prompts.jsonl eval.prompt_key=text
    python -m medusa_train stage=eval model=hf model.name_or_path=lmsys/vicuna-7b-v1.3 model.dtype=float16 \
        eval.heads_dir=path/to/heads tree=medusa63 eval.all_turns=true     # one GPU; eval is batch size 1

Steps: (1) backbone, heads (either export layout; checked against the backbone) and the tree
(`tree=calibrated|medusa63|chain|custom`); after `training=medusa2` the backbone is the one trained
with the heads (`<heads>/backbone`, a LoRA adapter merged into `model.name_or_path`) unless
`model.name_or_path` names another checkpoint than their base (see `medusa_train.stages`); (2)
prompts: held-out embedded prompts, MT-bench questions or any prompt JSONL, rendered with the
backbone's chat template (first turn, or every turn conditioned on the model's own earlier answers
with `eval.all_turns=true`); (3) one warm-up
prompt through both decoders; (4) every prompt through plain greedy `model.generate(do_sample=False)`
and Medusa greedy decoding, each call timed whole with `time.perf_counter` (same max_new_tokens,
same EOS ids); (5) tau of typical acceptance and exact sampling at `eval.temperature`; (6) per-head
top-1/top-5 accuracy (calibration.json, else held-out distilled data); (7) tau and speed-up for
calibrated trees of `eval.sweep_tree_sizes` nodes; (8) report.json, report.md, plots, generations.jsonl,
wandb, and the export's model card updated with the figures.

Metrics (DESIGN.md): tau = new tokens / verification steps, the bonus token counted (plain decoding
= 1.0); speed-up = Medusa tokens/s over plain greedy tokens/s; greedy_identical = fraction of prompts
whose Medusa greedy output equals plain greedy (must be 1.0).
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from medusa_train.errors import UserError
from medusa_train.workdir import Workdir, require

log = logging.getLogger(__name__)

CHOICES_NAME = "medusa_choices.json"
CALIBRATION_NAME = "calibration.json"
HEADS_ACC_RECORDS = 64
"""Held-out distilled records used for head accuracy when calibration.json is missing."""


@dataclass
class EvalPrompt:
    """One evaluation conversation: its user turns (only the first is used unless `eval.all_turns`)."""

    source_id: str
    turns: list[str]
    system: str | None = None


@dataclass
class Decoded:
    """One decoder call: new token ids and the wall-clock seconds of the whole call."""

    tokens: list[int]
    seconds: float
    accepted_lengths: list[int] | None = None


# ---------------------------------------------------------------------------------------------
# the stage


def run(cfg) -> dict:
    """Evaluate Medusa decoding; writes ``workdir/eval/`` and returns the report dict."""
    from tqdm.auto import tqdm

    from medusa_train.backbone import load_backbone_for_heads, resolve_device
    from medusa_train.decoding import PackedHeads, TreeBuffers
    from medusa_train.tracking import is_main_process, start_tracking

    wd = Workdir(Path(cfg.workdir))
    if not is_main_process():
        return {"skipped": "not the main process"}
    ecfg = cfg.eval
    # 1. Backbone, heads, tree.
    heads_dir = Path(ecfg.heads_dir) if ecfg.heads_dir else require(wd.heads, "trained heads", "train")
    heads = _load_heads(heads_dir)
    tree_name, choices = tree_choices(cfg.tree, heads_dir, heads.num_heads)
    prompts = load_eval_prompts(ecfg)  # before the backbone: a bad eval.path fails in a second
    device = resolve_device(cfg.model.device)
    model, tok, backbone, trained = load_backbone_for_heads(cfg.model, heads_dir, device)
    log.info(
        "eval: backbone %s%s", backbone, " (trained with the heads: training=medusa2)" if trained else ""
    )
    check_heads_match(heads, model, heads_dir, backbone)
    if not trained:  # a trained Medusa-2 backbone is the heads' own
        warn_if_other_backbone(heads_dir, model, cfg.model.name_or_path)
    lm_weight = model.get_output_embeddings().weight
    heads = heads.to(device=lm_weight.device, dtype=lm_weight.dtype)
    packed = PackedHeads(heads)
    tree = TreeBuffers.from_choices(choices).to(lm_weight.device)
    eos = eos_ids(model, tok)

    # 2. Prompts (rendered once the tokenizer is loaded).
    decode = _Decoders(model, packed, tree, eos, tok.pad_token_id)

    # 3. Warm-up (allocators, kernels, caches) on the first prompt; not timed.
    first = render(tok, prompts[0], [], 0, lm_weight.device)
    decode.plain(first, min(ecfg.max_new_tokens, 32))
    decode.medusa(first, min(ecfg.max_new_tokens, 32))

    # 4. Plain greedy vs Medusa greedy, prompt by prompt (turn by turn).
    records: list[dict] = []
    inputs: list[tuple[torch.Tensor, int]] = []  # (prompt ids, max_new_tokens) per turn, for 5. and 7.
    for p_idx, prompt in enumerate(tqdm(prompts, desc="eval", unit="prompt")):
        history: list[str] = []
        for t_idx in range(len(prompt.turns) if ecfg.all_turns else 1):
            ids = render(tok, prompt, history, t_idx, lm_weight.device)
            budget = turn_budget(model, ids.shape[1], ecfg.max_new_tokens)
            if budget <= 0:
                log.warning(
                    "prompt %s turn %d fills the context (%d tokens): skipped",
                    prompt.source_id,
                    t_idx,
                    ids.shape[1],
                )
                break
            base = decode.plain(ids, budget)
            med = decode.medusa(ids, budget)
            base_text = tok.decode(base.tokens, skip_special_tokens=True)
            records.append(
                {
                    "prompt_index": p_idx,
                    "source_id": prompt.source_id,
                    "turn": t_idx,
                    "prompt": prompt.turns[t_idx],
                    "baseline": base_text,
                    "medusa": tok.decode(med.tokens, skip_special_tokens=True),
                    "identical": base.tokens == med.tokens,
                    "tokens": len(med.tokens),
                    "steps": len(med.accepted_lengths or []),
                    "baseline_tokens": len(base.tokens),
                    "baseline_s": base.seconds,
                    "medusa_s": med.seconds,
                    "accepted_lengths": med.accepted_lengths,
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
        tree=tree_name, tree_size=len(choices), max_new_tokens=ecfg.max_new_tokens, all_turns=ecfg.all_turns
    )
    report.update(
        prompts=ecfg.prompts,
        backbone=backbone,
        heads_dir=str(heads_dir),
        num_heads=heads.num_heads,
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
    report["head_top1"] = [round(row[0], 4) for row in topk] if topk else None
    report["head_top5"] = [round(row[min(4, len(row) - 1)], 4) for row in topk] if topk else None

    # 7. Tau and speed-up against tree size (calibrated trees grown from the head accuracies).
    report["sweep"] = sweep(decode, topk, inputs, ecfg) if topk and ecfg.sweep_tree_sizes else []
    report["machine"] = machine_info(lm_weight.device)
    report["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")

    # 8. Files, plots, tracking, model card.
    out = wd.eval
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "generations.jsonl", "w") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(report_markdown(report))
    plots = write_plots(report, out / "plots")
    tracker = start_tracking(cfg.tracking, wd.root, "eval", config=asdict(cfg))
    tracker.summary(
        {k: v for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    )
    for row in report["sweep"]:
        tracker.log(
            {"sweep/tau": row["tau"], "sweep/speedup": row["speedup"], "sweep/tree_size": row["tree_size"]}
        )
    for name, path in plots.items():
        tracker.log_image(f"eval/{name}", path)
    tracker.finish()
    if (wd.export / "README.md").is_file() and _is_workdir_heads(heads_dir, wd):
        _refresh_model_card(wd, heads_dir, tree_name, len(choices))
    if report["greedy_identical"] < 1.0:
        log.error(
            "Medusa greedy output differs from plain greedy on %.0f%% of prompts: see %s",
            100 * (1 - report["greedy_identical"]),
            out / "generations.jsonl",
        )
    log.info(
        "eval: tau %.2f, speed-up %.2fx, greedy identical %.0f%%",
        report["tau"],
        report["speedup"],
        100 * report["greedy_identical"],
    )
    return report


# ---------------------------------------------------------------------------------------------
# inputs


def tree_choices(tree_cfg, heads_dir: Path, num_heads: int) -> tuple[str, list[list[int]]]:
    """The configured tree as ``(name, paths)``, checked against the number of heads.

    ``calibrated`` reads ``medusa_choices.json`` next to the heads (or one folder up, for an
    export's ``medusa/``/``vllm/`` folder).

    Raises:
        UserError: the calibrated tree is missing, or the tree is malformed or deeper than the heads.
    """
    from medusa_train.decoding import MEDUSA_63, TreeBuffers, TreeError, chain_tree, load_choices

    try:
        if tree_cfg.name == "calibrated":
            path = next(
                (p for p in (heads_dir / CHOICES_NAME, heads_dir.parent / CHOICES_NAME) if p.is_file()), None
            )
            if path is None:
                raise UserError(
                    f"no calibrated tree at {heads_dir / CHOICES_NAME}: run `python -m medusa_train stage=train` "
                    "first (it calibrates the tree), or choose tree=medusa63|chain|custom"
                )
            choices = load_choices(path)
        elif tree_cfg.name == "medusa63":
            choices = [list(p) for p in MEDUSA_63]
        elif tree_cfg.name == "chain":
            choices = chain_tree(tree_cfg.chain_depth)
        else:
            choices = [list(p) for p in tree_cfg.choices]
        TreeBuffers.from_choices(choices).check_heads(num_heads)
    except TreeError as err:
        raise UserError(f"tree={tree_cfg.name}: {err}") from None
    return tree_cfg.name, choices


def _load_heads(heads_dir: Path):
    from medusa_train.formats import load_heads
    from medusa_train.heads import HeadsFormatError

    try:
        return load_heads(heads_dir)
    except HeadsFormatError as err:
        raise UserError(
            f"cannot load Medusa heads: {err} (set eval.heads_dir= to a heads directory)"
        ) from None


def check_heads_match(heads, model, heads_dir: Path, backbone: str) -> None:
    """Raise :class:`UserError` when the heads' hidden/vocab sizes differ from the backbone's."""
    vocab, hidden = model.get_output_embeddings().weight.shape
    if (heads.hidden_size, heads.vocab_size) != (hidden, vocab):
        raise UserError(
            f"heads at {heads_dir} were trained for hidden_size={heads.hidden_size}, vocab_size={heads.vocab_size} "
            f"but backbone {backbone} has hidden_size={hidden}, vocab_size={vocab}: pass the backbone they were "
            "trained on (model.name_or_path=...) or other heads (eval.heads_dir=...)"
        )


def warn_if_other_backbone(heads_dir: Path, model, name_or_path: str) -> None:
    """Warn when stage=train recorded a different backbone fingerprint (same shapes, other weights)."""
    from medusa_train.backbone import backbone_identity
    from medusa_train.formats import read_heads_config
    from medusa_train.heads import HeadsFormatError

    try:
        recorded = read_heads_config(heads_dir).get("backbone")
    except HeadsFormatError:
        return
    if isinstance(recorded, dict) and recorded.get("fingerprint"):
        current = backbone_identity(model, name_or_path)["fingerprint"]
        if current != recorded["fingerprint"]:
            log.warning(
                "heads at %s were trained on backbone %s (fingerprint %s), evaluating on %s (%s): "
                "outputs stay exact, but tau will be lower",
                heads_dir,
                recorded.get("name_or_path"),
                recorded["fingerprint"],
                name_or_path,
                current,
            )


def load_eval_prompts(ecfg) -> list[EvalPrompt]:
    """``eval.num_prompts`` prompts from the configured source (held-out embedded, MT-bench, JSONL)."""
    if ecfg.prompts == "embedded":
        from medusa_train.data.embedded import embedded_prompts

        prompts = []
        for i, conv in enumerate(embedded_prompts("eval", ecfg.num_prompts, ecfg.seed)):
            system = next((m["content"] for m in conv if m["role"] == "system"), None)
            turns = [m["content"] for m in conv if m["role"] == "user"]
            prompts.append(EvalPrompt(f"embedded-eval:{i}", turns, system))
    else:
        from medusa_train.data.sources import read_records

        if not Path(ecfg.path).is_file():
            raise UserError(f"eval.path={ecfg.path} does not exist")
        result = read_records(
            ecfg.prompts, ecfg.path, prompt_key=ecfg.prompt_key, max_records=ecfg.num_prompts
        )
        result.log_warning(log)
        prompts = [EvalPrompt(r.source_id, list(r.turns), r.system) for r in result.records if r.turns]
    prompts = prompts[: ecfg.num_prompts]
    if not prompts:
        raise UserError(
            f"no usable evaluation prompt in eval.prompts={ecfg.prompts} {ecfg.path or ''}".rstrip()
        )
    return prompts


def render(tok, prompt: EvalPrompt, history: list[str], turn: int, device) -> torch.Tensor:
    """Turn ``turn`` of ``prompt`` after ``history`` (earlier answers) with the chat template: ``(1, T)``."""
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    for user, answer in zip(prompt.turns[:turn], history, strict=True):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": prompt.turns[turn]})
    if not tok.chat_template:
        raise UserError(
            "the backbone's tokenizer has no chat template: eval renders prompts with apply_chat_template"
        )
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]  # (1, T)
    return ids.to(device)


def eos_ids(model, tok) -> list[int]:
    """The EOS ids ``generate`` stops at (generation config + tokenizer), given to both decoders."""
    ids = model.generation_config.eos_token_id
    out = set([ids] if isinstance(ids, int) else list(ids or []))
    if tok.eos_token_id is not None:
        out.add(int(tok.eos_token_id))
    return sorted(out)


def turn_budget(model, prompt_len: int, max_new_tokens: int) -> int:
    """``max_new_tokens``, cut so that prompt + new tokens fit the model's positions (same for both decoders)."""
    from medusa_train.decoding.generate import context_limit

    limit = context_limit(model)
    return max_new_tokens if limit is None else min(max_new_tokens, limit - prompt_len)


# ---------------------------------------------------------------------------------------------
# decoding


class _Decoders:
    """Plain greedy ``generate`` and ``medusa_generate`` with the same stopping rule, timed whole."""

    def __init__(self, model, packed, tree, eos: list[int], pad_token_id: int | None) -> None:
        self.model, self.packed, self.tree, self.eos, self.pad = model, packed, tree, eos, pad_token_id
        self.device = next(model.parameters()).device

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def plain(self, ids: torch.Tensor, max_new_tokens: int) -> Decoded:
        self._sync()
        t0 = time.perf_counter()
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,  # the model's generation_config may set one: plain greedy here
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos,
            pad_token_id=self.pad if self.pad is not None else self.eos[0],
        )
        self._sync()
        seconds = time.perf_counter() - t0
        return Decoded(out[0, ids.shape[1] :].tolist(), seconds)

    @torch.inference_mode()
    def medusa(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        tree=None,
        acceptance: str = "greedy",
        ecfg=None,
        generator=None,
    ) -> Decoded:
        from medusa_train.decoding import medusa_generate

        extra = {}
        if ecfg is not None:
            extra = {
                "temperature": ecfg.temperature,
                "posterior_threshold": ecfg.posterior_threshold,
                "posterior_alpha": ecfg.posterior_alpha,
            }
        self._sync()
        t0 = time.perf_counter()
        out = medusa_generate(
            self.model,
            self.packed,
            ids,
            max_new_tokens=max_new_tokens,
            tree=self.tree if tree is None else tree,
            acceptance=acceptance,
            eos_token_id=self.eos,
            generator=generator,
            **extra,
        )
        self._sync()
        seconds = time.perf_counter() - t0
        return Decoded(out.tokens.tolist(), seconds, list(out.accepted_lengths))

    def tau_of(self, inputs: list[tuple[torch.Tensor, int]], acceptance: str, ecfg) -> float:
        """Tokens per step of ``acceptance`` at ``ecfg.temperature`` over the same prompts."""
        gen = torch.Generator(device=self.device).manual_seed(ecfg.seed)
        tokens = steps = 0
        for ids, budget in inputs:
            out = self.medusa(ids, budget, acceptance=acceptance, ecfg=ecfg, generator=gen)
            tokens += len(out.tokens)
            steps += len(out.accepted_lengths or [])
        return tokens / max(1, steps)


def head_topk(heads_dir: Path, wd: Workdir, cfg, model, heads) -> tuple[list[list[float]] | None, str | None]:
    """Cumulative top-k accuracy ``(K, R)`` of every head and where it came from.

    Read from ``calibration.json`` (written by stage=train) when present, else computed on the
    held-out distilled records; ``(None, None)`` when neither exists (heads from elsewhere).
    """
    for path in (heads_dir / CALIBRATION_NAME, heads_dir.parent / CALIBRATION_NAME):
        if path.is_file():
            topk = calibration_topk(json.loads(path.read_text()))
            if topk:
                return topk, str(path)
    if not (wd.distill / "manifest.json").is_file():
        return None, None
    from medusa_train.data.distilled import load_distilled, split_heldout
    from medusa_train.decoding import compute_head_accuracy

    _, held = split_heldout(load_distilled(wd.distill), cfg.data.eval_fraction)
    if len(held) == 0:
        return None, None
    device = next(model.parameters()).device
    rows = held.select(range(min(HEADS_ACC_RECORDS, len(held))))
    batches = (
        (torch.tensor([r["input_ids"]], device=device), torch.tensor([r["loss_mask"]], device=device).bool())
        for r in rows
    )
    acc = compute_head_accuracy(model, heads, batches, max_k=10)  # (K, 10)
    return acc.tolist(), f"{wd.distill} (held-out, {len(rows)} records)"


def calibration_topk(calibration: dict) -> list[list[float]] | None:
    """The per-head cumulative top-k accuracy table ``(K, R)`` in a calibration.json, if any."""
    for key in ("head_topk_accuracy", "topk_accuracy", "head_accuracy", "accuracy"):
        value = calibration.get(key)
        if isinstance(value, dict):  # {"topk": [[...]], ...} or {"top1": [...], "top5": [...]}
            value = value.get("topk") or value.get("cumulative")
        if isinstance(value, list) and value and all(isinstance(row, list) and row for row in value):
            return [[float(x) for x in row] for row in value]
    return None


def head_accuracy(calibration: dict) -> tuple[list[float], list[float]] | None:
    """``(top1, top5)`` per head from a calibration.json, or None when it holds no accuracy table."""
    topk = calibration_topk(calibration)
    if not topk:
        return None
    return [row[0] for row in topk], [row[min(4, len(row) - 1)] for row in topk]


def sweep(
    decode: _Decoders, topk: list[list[float]], inputs: list[tuple[torch.Tensor, int]], ecfg
) -> list[dict]:
    """Tau and speed-up of calibrated trees of ``eval.sweep_tree_sizes`` nodes on ``eval.sweep_prompts`` turns.

    Prompt by prompt, plain greedy and every tree size run back to back, so a machine whose load
    drifts (shared CPUs) skews all of them alike.
    """
    from medusa_train.decoding import TreeBuffers, grow_tree, per_rank_accuracy

    trees, expected = grow_tree(per_rank_accuracy(torch.tensor(topk)), max(ecfg.sweep_tree_sizes))
    sizes = sorted({int(s) for s in ecfg.sweep_tree_sizes if 0 < int(s) <= len(trees)})
    if len(sizes) < len(set(ecfg.sweep_tree_sizes)):
        log.warning(
            "sweep: the heads' top-k table gives trees of at most %d nodes; larger sizes skipped", len(trees)
        )
    log.info("tree-size sweep: %s nodes on %d turns", sizes, min(ecfg.sweep_prompts, len(inputs)))
    built = {size: TreeBuffers.from_choices(trees[size - 1]).to(decode.device) for size in sizes}
    for tree in built.values():  # warm-up: each tree's first use
        decode.medusa(inputs[0][0], min(inputs[0][1], 8), tree=tree)
    base_tokens, base_s = 0, 0.0
    totals = {size: [0, 0, 0.0] for size in sizes}  # tokens, steps, seconds
    for ids, budget in inputs[: ecfg.sweep_prompts]:
        base = decode.plain(ids, budget)
        base_tokens, base_s = base_tokens + len(base.tokens), base_s + base.seconds
        for size, tree in built.items():
            out = decode.medusa(ids, budget, tree=tree)
            totals[size][0] += len(out.tokens)
            totals[size][1] += len(out.accepted_lengths or [])
            totals[size][2] += out.seconds
    base_tps = base_tokens / max(1e-9, base_s)
    rows = []
    for size, (tokens, steps, seconds) in totals.items():
        tps = tokens / max(1e-9, seconds)
        rows.append(
            {
                "tree_size": size,
                "expected_tau": round(float(expected[size - 1]), 4),
                "tau": tokens / max(1, steps),
                "tokens_per_s": tps,
                "tokens_per_s_baseline": base_tps,
                "speedup": tps / base_tps if base_tps > 0 else 0.0,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------
# report


def summarise(records: list[dict], num_prompts: int) -> dict:
    """The headline figures of the main run, computed from the per-turn records (generations.jsonl)."""
    tokens = sum(r["tokens"] for r in records)
    steps = sum(r["steps"] for r in records)
    base_tokens = sum(r["baseline_tokens"] for r in records)
    base_s = sum(r["baseline_s"] for r in records)
    med_s = sum(r["medusa_s"] for r in records)
    tps_base = base_tokens / max(1e-9, base_s)
    tps_med = tokens / max(1e-9, med_s)
    by_prompt: dict[int, bool] = {}
    for r in records:
        by_prompt[r["prompt_index"]] = by_prompt.get(r["prompt_index"], True) and r["identical"]
    hist = Counter(length for r in records for length in r["accepted_lengths"])
    max_len = max(hist) if hist else 1
    return {
        "tau": tokens / max(1, steps),
        "speedup": tps_med / tps_base if tps_base > 0 else 0.0,
        "tokens_per_s_baseline": tps_base,
        "tokens_per_s_medusa": tps_med,
        "greedy_identical": sum(by_prompt.values()) / max(1, len(by_prompt)),
        "num_prompts": num_prompts,
        "num_turns": len(records),
        "new_tokens_medusa": tokens,
        "new_tokens_baseline": base_tokens,
        "steps": steps,
        "seconds_baseline": base_s,
        "seconds_medusa": med_s,
        "accepted_length_histogram": {str(n): hist.get(n, 0) for n in range(1, max_len + 1)},
    }


def machine_info(device: torch.device) -> dict:
    """Where the timings were taken."""
    import os

    import transformers

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
    return info


def _fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def summary_table(report: dict) -> str:
    """The headline figures as a Markdown table (printed at the end of stage=all)."""
    temp = report.get("temperature")
    acc1, acc5 = report.get("head_top1"), report.get("head_top5")
    rows = [
        ("prompts (turns)", f"{report['num_prompts']} ({report.get('num_turns', report['num_prompts'])})"),
        ("tree", f"{report.get('tree', '?')}, {report['tree_size']} nodes"),
        ("tau, greedy (tokens/step)", _fmt(report["tau"])),
        ("plain greedy tokens/s", _fmt(report["tokens_per_s_baseline"], ".1f")),
        ("Medusa greedy tokens/s", _fmt(report["tokens_per_s_medusa"], ".1f")),
        ("speed-up", f"{report['speedup']:.2f}x"),
        ("greedy output identical", f"{report['greedy_identical']:.0%}"),
        (f"tau, typical (T={temp})", _fmt(report.get("tau_typical"))),
        (f"tau, sample (T={temp})", _fmt(report.get("tau_sample"))),
        ("head top-1", " / ".join(f"{a:.2f}" for a in acc1) if acc1 else "n/a"),
        ("head top-5", " / ".join(f"{a:.2f}" for a in acc5) if acc5 else "n/a"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
    return "\n".join(lines)


def report_markdown(report: dict) -> str:
    """report.md: the summary table, the tree-size sweep, the accepted-length histogram, the machine."""
    lines = [
        "# Medusa evaluation",
        "",
        f"{report['date']}, backbone `{report.get('backbone')}`, heads `{report.get('heads_dir')}`.",
        "",
    ]
    lines += [summary_table(report), ""]
    if report.get("sweep"):
        lines += [
            "## Tree size",
            "",
            "| nodes | expected tau | tau | tokens/s | speed-up |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['tree_size']} | {r['expected_tau']:.2f} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x |"
            for r in report["sweep"]
        ]
        lines.append("")
    hist = report["accepted_length_histogram"]
    lines += ["## Tokens per step", "", "| tokens | steps |", "|---|---|"]
    lines += [f"| {n} | {c} |" for n, c in hist.items()]
    lines += ["", "## Machine", ""] + [f"- {k}: {v}" for k, v in report["machine"].items()]
    return "\n".join(lines) + "\n"


def write_plots(report: dict, directory: Path) -> dict[str, Path]:
    """PNG figures: accepted-length histogram, per-head accuracy, tau and speed-up vs tree size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    hist = report["accepted_length_histogram"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([int(n) for n in hist], list(hist.values()), color="tab:blue")
    ax.set(
        xlabel="tokens gained per step (bonus included)",
        ylabel="steps",
        title=f"accepted lengths, tau = {report['tau']:.2f}",
    )
    paths["accepted_lengths"] = _save(fig, directory / "accepted_lengths.png")

    if report.get("head_top1"):
        k = range(1, len(report["head_top1"]) + 1)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(k, report["head_top1"], "o-", label="top-1")
        ax.plot(k, report["head_top5"], "s-", label="top-5")
        ax.set(
            xlabel="head k (predicts t+k+1)",
            ylabel="held-out accuracy",
            ylim=(0, 1.02),
            title="head accuracy",
        )
        ax.set_xticks(list(k))
        ax.legend()
        paths["head_accuracy"] = _save(fig, directory / "head_accuracy.png")

    if report.get("sweep"):
        sizes = [r["tree_size"] for r in report["sweep"]]
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        ax.plot(sizes, [r["tau"] for r in report["sweep"]], "o-", color="tab:blue", label="tau (measured)")
        ax.plot(
            sizes, [r["expected_tau"] for r in report["sweep"]], ":", color="tab:blue", label="tau (expected)"
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.set(xlabel="tree nodes", ylabel="tokens per step")
        ax2 = ax.twinx()
        ax2.plot(sizes, [r["speedup"] for r in report["sweep"]], "s--", color="tab:red", label="speed-up")
        ax2.set_ylabel("speed-up over plain greedy")
        handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], loc="best")
        ax.set_title("tau and speed-up vs tree size")
        paths["tree_size"] = _save(fig, directory / "tree_size.png")
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _is_workdir_heads(heads_dir: Path, wd: Workdir) -> bool:
    """True when the evaluated heads are this workdir's (workdir/heads or inside workdir/export)."""
    resolved, export = heads_dir.resolve(), wd.export.resolve()
    return resolved == wd.heads.resolve() or resolved == export or export in resolved.parents


def _refresh_model_card(wd: Workdir, heads_dir: Path, tree_name: str, tree_size: int) -> None:
    """Add the measured figures to ``workdir/export/README.md`` (export runs before eval in stage=all)."""
    from medusa_train.stages.export import write_model_card

    try:
        write_model_card(wd.export, heads_dir=heads_dir, wd=wd, tree_name=tree_name, tree_size=tree_size)
    except Exception as err:  # the card is a convenience: never fail an evaluation over it
        log.warning("could not update %s: %s", wd.export / "README.md", err)
