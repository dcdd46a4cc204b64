"""What the pipeline reports: eval's figures, report.md, plots and the export's model card.

Metrics (DESIGN.md; Cai et al., arXiv:2401.10774, section 3): tau = new tokens / verification steps,
the bonus token counted (plain decoding = 1.0); speed-up = Medusa tokens/s over plain greedy
tokens/s; greedy_identical = fraction of prompts whose Medusa greedy output equals plain greedy.

- :func:`summarise` turns eval's per-turn records (``generations.jsonl``) into the headline figures;
  :func:`machine_info` says where they were timed.
- :func:`summary_table` / :func:`report_markdown` render them (``report.md``; the table is printed
  at the end of ``stage=all``); :func:`write_plots` draws ``plots/*.png`` (matplotlib, imported lazily).
- :func:`model_card` is the export's ``README.md`` (what the heads are, how they were made and
  measured, how to load them); :func:`write_model_card` rewrites it from what is on disk, so
  ``stage=eval`` can add its figures.

Plain arguments only (dicts, paths, heads): no Hydra config, no stage.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import statistics
from collections import Counter
from pathlib import Path

import torch
import transformers

from medusa_train.card_inputs import (
    NULL,
    NUMBER,
    CardInput,
    calibration_input,
    calibration_topk,
    read_checked,
)
from medusa_train.data.distilled import REGENERATE, data_key
from medusa_train.decoding.timing import speedup_figures
from medusa_train.formats import MEDUSA_CONFIG_KEYS, MEDUSA_TRAIN_VERSION, is_hub_id, load_heads
from medusa_train.heads import MedusaHeads
from medusa_train.heads_layout import LEGACY_WEIGHTS_NAME, MEDUSA, VLLM, read_heads_config
from medusa_train.workdir import (
    CALIBRATION,
    CHOICES,
    MANIFEST,
    MODEL_CARD,
    REPORT_JSON,
    TRAINED_BACKBONE,
    Workdir,
    atomic_write_text,
    published_path,
)

log = logging.getLogger(__name__)


# -- head accuracy (calibration.json, written by stage=train) -----------------------------------------
def top1_top5(topk: list[list[float]]) -> tuple[list[float], list[float]]:
    """``(top1, top5)`` per head from a cumulative top-k table ``(K, R)`` (top-R when R < 5)."""
    return [row[0] for row in topk], [row[min(4, len(row) - 1)] for row in topk]


# -- eval's figures ---------------------------------------------------------------------------------
def summarise(records: list[dict], num_prompts: int) -> dict:
    """The headline figures of the main run, computed from the per-turn records (generations.jsonl):
    the timing protocol's figures (:func:`~medusa_train.decoding.timing.speedup_figures`: the median
    per-turn speed-up as ``speedup``, its quartiles, the summed tokens/s ratio, the plausibility
    check), greedy parity and the accepted-length histogram."""
    by_prompt: dict[int, bool] = {}
    for r in records:
        by_prompt[r["prompt_index"]] = by_prompt.get(r["prompt_index"], True) and r["identical"]
    hist = Counter(length for r in records for length in r["accepted_lengths"])
    max_len = max(hist) if hist else 1
    firsts = sorted(r["first_difference"] for r in records if r.get("first_difference") is not None)
    return {
        **speedup_figures(records),
        "greedy_identical": sum(by_prompt.values()) / max(1, len(by_prompt)),
        # Where turns differ (half precision: two kernels round differently), after how many tokens.
        "first_difference": {
            "turns": len(firsts),
            "min": firsts[0],
            "median": statistics.median(firsts),  # of an even count: the mean of the middle two
            "max": firsts[-1],
        }
        if firsts
        else None,
        "num_prompts": num_prompts,
        "num_turns": len(records),
        "accepted_length_histogram": {str(n): hist.get(n, 0) for n in range(1, max_len + 1)},
    }


ALTERNATIVES = {
    "prompt_lookup": "prompt lookup",
    "assisted": "assisted generation",
    "compiled_plain": "plain greedy, static cache compiled",
    "static_medusa": "Medusa, static shapes captured",
}
"""The other speed-ups eval measures next to Medusa (record key prefix -> name in the report)."""


def alternatives(records: list[dict]) -> dict[str, dict]:
    """Tokens/s, speed-up over plain greedy (median over turns, and the summed tokens/s ratio) and the
    identical fraction of each alternative in the records.

    An alternative is there when every record has its ``<name>_tokens``, ``<name>_s`` and
    ``<name>_identical`` (stage eval's step 4 writes them next to the plain and Medusa figures).
    """
    base_tps = sum(r["baseline_tokens"] for r in records) / max(1e-9, sum(r["baseline_s"] for r in records))
    out = {}
    for name in ALTERNATIVES:
        if not records or any(f"{name}_s" not in r for r in records):
            continue
        tps = sum(r[f"{name}_tokens"] for r in records) / max(1e-9, sum(r[f"{name}_s"] for r in records))
        per_turn = [
            (r[f"{name}_tokens"] / max(1e-9, r[f"{name}_s"]))
            / max(1e-9, r["baseline_tokens"] / max(1e-9, r["baseline_s"]))
            for r in records
        ]
        out[name] = {
            "tokens_per_s": tps,
            "speedup": statistics.median(per_turn),
            "speedup_tokens_per_s": tps / base_tps if base_tps > 0 else 0.0,
            "identical": sum(bool(r[f"{name}_identical"]) for r in records) / len(records),
        }
    if "compiled_plain" in out and "static_medusa" in out:  # eval.compile: against the compiled baseline too
        # the median over turns, as every other speed-up (and batch_sizes' rows at B > 1); the
        # summed tokens/s ratio beside it
        compiled = out["compiled_plain"]["tokens_per_s"]
        out["static_medusa"]["speedup_vs_compiled"] = statistics.median(
            (r["static_medusa_tokens"] / max(1e-9, r["static_medusa_s"]))
            / max(1e-9, r["compiled_plain_tokens"] / max(1e-9, r["compiled_plain_s"]))
            for r in records
        )
        out["static_medusa"]["speedup_vs_compiled_tokens_per_s"] = (
            out["static_medusa"]["tokens_per_s"] / compiled if compiled > 0 else 0.0
        )
    return out


MARGINAL_TAU = 0.1
"""Tokens per step one more vLLM speculative token must add to be recommended (see
:func:`recommend_speculative_tokens`)."""


def recommend_speculative_tokens(chain: list[dict] | None) -> int | None:
    """The ``num_speculative_tokens`` to give vLLM, from eval's top-1 chain taus (``vllm_chain`` rows
    ``{"num_speculative_tokens": n, "tau": ...}``, n = 1..K).

    Rule: the smallest n after which one more head adds less than :data:`MARGINAL_TAU` (0.1) tokens
    per step (K when every head adds more). vLLM verifies n + 1 tokens of every request at each step,
    so a head that rarely adds a token costs verify work (compute, once batches are large) and gives
    nothing back. None without measurements.
    """
    rows = sorted(chain or [], key=lambda r: r["num_speculative_tokens"])
    if not rows:
        return None
    for row, following in zip(rows, rows[1:], strict=False):
        if following["tau"] - row["tau"] < MARGINAL_TAU:
            return int(row["num_speculative_tokens"])
    return int(rows[-1]["num_speculative_tokens"])


def machine_info(device: torch.device) -> dict:
    """Where the timings were taken."""
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


# -- report.md --------------------------------------------------------------------------------------
def calibrated_machine(label: dict | None) -> str:
    """ "<device> (<dtype>[, <attention> attention])" of a calibration's ``calibrated_for`` ("an
    unrecorded device" for none)."""
    if not label:
        return "an unrecorded device"
    attention = f", {label['attention']} attention" if "attention" in label else ""
    return f"{label['device']} ({label['dtype']}{attention})"


def _calibrated_for(report: dict) -> str:
    """ ", calibrated for <device> (<dtype>, <attention> attention) [in this run]" for a calibrated
    tree, else ""."""
    fit = report.get("tree_fit") or {}
    if report.get("tree") != "calibrated":
        return ""
    label = fit.get("calibrated_for")
    where = calibrated_machine(label)
    return f", calibrated for {where}" + (" in this run" if fit.get("recalibrated") else "")


def _tree_device(calibration: dict | None, report: dict | None, *, calibrated: bool) -> str:
    """Where the shipped tree was calibrated (``calibrated``: it is the calibration's tree), and the tree
    eval fitted to its own device if it differs."""
    label = ((calibration or {}).get("tree") or {}).get("calibrated_for") if calibrated else None
    text = f", calibrated for {calibrated_machine(label)}" if label else ""
    fit = (report or {}).get("tree_fit") or {}
    if fit.get("recalibrated"):
        text += (
            f"; on {calibrated_machine(fit['calibrated_for'])} eval calibrated a {len(fit.get('choices') or [])}-node "
            "tree for that device (the figures above; its paths: `tree_fit.choices` in eval/report.json)"
        )
    return text


def is_calibrated_tree(tree_name: str | None, choices: list[list[int]], calibration: dict | None) -> bool:
    """Whether the tree ``choices`` is the one ``calibration`` chose (a tree pinned at export, medusa63,
    chain or custom, ships the calibration of the heads' own tree): the same paths as its
    ``tree.choices``; a calibration.json without them: the tree's name is ``calibrated`` and its node
    count the chosen one's, where the calibration records it. The card and stage=eval's fit of the
    tree to its device (``stages/eval.py``) both match by it."""
    tree = (calibration or {}).get("tree") or {}
    if tree.get("choices") is not None:
        return _same_paths(tree["choices"], choices)
    best = (tree.get("best") or {}).get("nodes")
    return tree_name == "calibrated" and best in (None, len(choices))


def _same_paths(a: list[list[int]], b: list[list[int]]) -> bool:
    """Two trees with the same paths, in any order."""
    return sorted(map(tuple, a)) == sorted(map(tuple, b))


def _first_difference(report: dict) -> str:
    """ " (n differing turns from token a, median b)" when some turns differ from plain greedy, else ""."""
    first = report.get("first_difference")
    if not first:
        return ""
    return f" ({first['turns']} turns differ, first from token {first['min']}, median {first['median']})"


def summary_table(report: dict) -> str:
    """The headline figures as a Markdown table (printed at the end of stage=all)."""
    temp = report.get("temperature")
    acc1, acc5 = report.get("head_top1"), report.get("head_top5")
    rows = [
        ("prompts (turns)", f"{report['num_prompts']} ({report.get('num_turns', report['num_prompts'])})"),
        ("tree", f"{report.get('tree', '?')}, {report['tree_size']} nodes{_calibrated_for(report)}"),
        ("tau, greedy (tokens/step)", _fmt(report["tau"])),
        ("tau expected from head accuracy", _fmt(report.get("expected_tau"))),
        ("plain greedy tokens/s", _fmt(report["tokens_per_s_baseline"], ".1f")),
        ("Medusa greedy tokens/s", _fmt(report["tokens_per_s_medusa"], ".1f")),
        ("speed-up (median over turns, quartiles)", headline_speedup(report)),
        (
            "speed-up of summed tokens/s",
            _fmt(report.get("speedup_tokens_per_s"), ".2f") + "x"
            if report.get("speedup_tokens_per_s") is not None
            else "n/a",
        ),
        ("greedy output identical", f"{report['greedy_identical']:.0%}{_first_difference(report)}"),
        (f"tau, typical (T={temp})", _fmt(report.get("tau_typical"))),
        (f"tau, sample (T={temp})", _fmt(report.get("tau_sample"))),
        ("head top-1", " / ".join(f"{a:.2f}" for a in acc1) if acc1 else "n/a"),
        ("head top-5", " / ".join(f"{a:.2f}" for a in acc5) if acc5 else "n/a"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
    lines += [
        f"\nNote: {report[key]}" for key in ("speedup_note", "tau_note", "prompts_note") if report.get(key)
    ]
    return "\n".join(lines)


def headline_speedup(report: dict) -> str:
    """The headline speed-up with its spread, or why it is not shown (the figures stay in report.json)."""
    if report.get("speedup_plausible") is False:
        return "not shown: above what tau and the step costs allow (see the note; figures in report.json)"
    spread = f" ({report['speedup_q25']:.2f}-{report['speedup_q75']:.2f})" if "speedup_q25" in report else ""
    return f"{report['speedup']:.2f}x{spread}"


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
        turns = report["sweep"][0].get("turns", "?")
        lines += [
            "## Tree size",
            "",
            f"Calibrated trees and the evaluated one (*) on the first {turns} of the {report.get('num_turns')} "
            "turns above; speed-up: median over those turns (quartiles).",
            "",
            "| nodes | expected tau | tau | tokens/s | speed-up |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['tree_size']}{' *' if r.get('main') else ''} | {r['expected_tau']:.2f} | {r['tau']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {_speedup_cell(r)} |"
            for r in report["sweep"]
        ]
        lines.append("")
    if report.get("alternatives"):
        lines += [
            "## Medusa and the alternatives (same turns, batch size 1)",
            "",
            "| method | tokens/s | speed-up | output identical to plain greedy |",
            "|---|---|---|---|",
            f"| plain greedy `generate` | {report['tokens_per_s_baseline']:.1f} | 1.00x | - |",
            f"| Medusa ({report['tree_size']}-node tree) | {report['tokens_per_s_medusa']:.1f} | "
            f"{_speedup_cell(report)} | {report['greedy_identical']:.0%} |",
        ]
        lines += [
            f"| {ALTERNATIVES[name]} ({row.get('setting', '')}) | {row['tokens_per_s']:.1f} | "
            f"{row['speedup']:.2f}x | {row['identical']:.0%} |"
            for name, row in report["alternatives"].items()
        ]
        lines.append("")
    if report.get("batch_sizes"):
        lines += [
            "## Batch size",
            "",
            "Plain batched `generate` (left padding) vs batched Medusa on the same turns in groups of B; "
            "speed-up: median over groups (quartiles).",
            "",
            "| batch | turns | plain tokens/s | Medusa tokens/s | speed-up | tau | rows identical |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['batch_size']} | {r['turns']} | {r['tokens_per_s_baseline']:.1f} | {r['tokens_per_s_medusa']:.1f} "
            f"| {_speedup_cell(r)} | {r['tau']:.2f} | {r['identical']:.0%} |"
            for r in report["batch_sizes"]
        ]
        lines.append("")
        if "static_speedup" in report["batch_sizes"][0]:  # eval.compile
            lines += [
                "Compiled, same groups: transformers' static-cache `generate` with B rows (left padding) and "
                "Medusa's static decoder with B rows; speed-ups over plain batched `generate`, and the static "
                "decoder's over the compiled `generate` (medians over groups).",
                "",
                "| batch | compiled plain tokens/s | speed-up | rows identical "
                "| static Medusa tokens/s | speed-up | rows identical | static vs compiled |",
                "|---|---|---|---|---|---|---|---|",
            ]
            lines += [
                f"| {r['batch_size']} | {r['compiled_tokens_per_s']:.1f} | {r['compiled_speedup']:.2f}x "
                f"| {r['compiled_identical']:.0%} | {r['static_tokens_per_s']:.1f} | {r['static_speedup']:.2f}x "
                f"| {r['static_identical']:.0%} | {r['static_speedup_vs_compiled']:.2f}x |"
                for r in report["batch_sizes"]
            ]
            lines.append("")
    if report.get("vllm_chain"):
        lines += ["## vLLM: the top-1 chain", "", vllm_chain_table(report["vllm_chain"]), ""]
    if report.get("comparison"):
        lines += ["## Heads compared (same turns, same tree)", "", comparison_table(report["comparison"]), ""]
    hist = report["accepted_length_histogram"]
    lines += ["## Tokens per step", "", "| tokens | steps |", "|---|---|"]
    lines += [f"| {n} | {c} |" for n, c in hist.items()]
    lines += ["", "## Machine", ""] + [f"- {k}: {v}" for k, v in report["machine"].items()]
    return "\n".join(lines) + "\n"


def vllm_chain_table(chain: list[dict]) -> str:
    """eval's greedy tau of the top-1 chain of the first n heads (what vLLM's Medusa proposer verifies
    with ``num_speculative_tokens=n``) as Markdown, with the recommended n."""
    best = recommend_speculative_tokens(chain)
    lines = [
        "vLLM's Medusa proposer drafts the argmax of each of the first n heads and verifies that chain "
        "(no tree). Greedy tau of that chain on the same turns, pooled (new tokens / steps):",
        "",
        "| num_speculative_tokens | tau | gain over n - 1 |",
        "|---|---|---|",
    ]
    previous = 1.0  # plain decoding
    for row in sorted(chain, key=lambda r: r["num_speculative_tokens"]):
        n = row["num_speculative_tokens"]
        mark = " (recommended)" if n == best else ""
        lines.append(f"| {n}{mark} | {row['tau']:.2f} | {row['tau'] - previous:+.2f} |")
        previous = row["tau"]
    lines += [
        "",
        f"Recommended: `num_speculative_tokens={best}`, the smallest n after which one more head adds "
        f"less than {MARGINAL_TAU} tokens per step.",
    ]
    return "\n".join(lines)


def _speedup_cell(row: dict) -> str:
    """A table row's speed-up with its quartiles; flagged when above what its tau allows."""
    cell = f"{row['speedup']:.2f}x"
    if "speedup_q25" in row:
        cell += f" ({row['speedup_q25']:.2f}-{row['speedup_q75']:.2f})"
    return cell + (" (implausible: host disturbed)" if row.get("speedup_plausible") is False else "")


def comparison_table(rows: list[dict]) -> str:
    """eval.compare's sets of heads as a Markdown table (the first row is the evaluated heads)."""
    lines = [
        "| heads | backbone | tau | speed-up | identical | head top-1 | argmax agreement | KL (nats) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        top1 = " / ".join(f"{a:.3f}" for a in r["head_top1"]) if r.get("head_top1") else "n/a"
        backbone = f"trained: `{r['backbone']}`" if r["trained"] else f"`{r['backbone']}`"
        lines.append(
            f"| `{r['name']}` | {backbone} | {r['tau']:.2f} | {r['speedup']:.2f}x | {r['greedy_identical']:.0%} | "
            f"{top1} | {_fmt(r.get('argmax_agreement'), '.4f')} | {_fmt(r.get('kl'), '.4f')} |"
        )
    return "\n".join(lines)


# -- plots ----------------------------------------------------------------------------------------
def write_plots(report: dict, directory: Path) -> dict[str, Path]:
    """PNG figures: accepted-length histogram, per-head accuracy, tau and speed-up vs tree size.

    Returns:
        ``{name: path}`` of the figures written into ``directory`` (created if missing).
    """
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

    if report.get("batch_sizes"):
        rows = report["batch_sizes"]
        sizes = [r["batch_size"] for r in rows]
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        ax.plot(sizes, [r["speedup"] for r in rows], "o-", color="tab:red", label="speed-up")
        if "static_speedup" in rows[0]:  # eval.compile
            ax.plot(
                sizes,
                [r["static_speedup"] for r in rows],
                "D-",
                color="tab:purple",
                label="static Medusa speed-up",
            )
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.set(xlabel="batch size", ylabel="Medusa over plain batched generate", ylim=(0, None))
        ax2 = ax.twinx()
        ax2.plot(
            sizes, [r["tokens_per_s_baseline"] for r in rows], "s--", color="tab:grey", label="plain tokens/s"
        )
        ax2.plot(
            sizes, [r["tokens_per_s_medusa"] for r in rows], "^--", color="tab:blue", label="Medusa tokens/s"
        )
        ax2.set_ylabel("tokens/s (all rows)")
        handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], loc="best")
        ax.set_title("speed-up vs batch size")
        paths["batch_size"] = _save(fig, directory / "batch_size.png")
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the export's model card ----------------------------------------------------------------------
def write_model_card(export_dir: Path, *, heads_dir: Path, wd: Workdir) -> None:
    """Rewrite ``export_dir/README.md`` (atomically) from what is on disk now; used by stage=eval.

    Reads the exported heads and tree, ``wd``'s distill manifest and eval report, and the export's
    calibration (else the one next to ``heads_dir``); each only when it belongs to the exported heads
    (:func:`belonging`). The tree is the exported one whatever tree eval measured: its name is the
    report's when eval measured these paths, else the one the card gave it.
    """
    layouts = [fmt for fmt in (MEDUSA, VLLM) if (export_dir / fmt).is_dir()]
    source = export_dir / layouts[0]
    backbone = export_dir / TRAINED_BACKBONE
    heads = load_heads(source)
    heads_config = read_heads_config(export_dir / MEDUSA if MEDUSA in layouts else heads_dir)
    if MEDUSA not in layouts:  # vllm/config.json says who the heads are (their training: heads_dir's)
        recorded = read_heads_config(source)
        heads_config = {**heads_config, **{k: recorded[k] for k in PROVENANCE_KEYS if k in recorded}}
    fingerprints = {heads.fingerprint(), heads_config.get(HEADS_FINGERPRINT)} - {None}
    manifest, report = belonging(
        fingerprints,
        heads_config,
        read_json(wd.distill / MANIFEST, MANIFEST_INPUT),
        read_json(wd.eval / REPORT_JSON, REPORT_INPUT),
    )
    calibration = read_json(export_dir / CALIBRATION, calibration_input(export_dir))
    if calibration is None and report is not None:  # eval measured these heads: their calibration is theirs
        calibration = read_json(heads_dir / CALIBRATION, calibration_input(heads_dir))
    choices = json.loads((export_dir / CHOICES).read_text())
    tree_name = (
        report.get("tree") if report is not None and not measured_another_tree(report, choices) else None
    )
    # else the export's card is the one record of the shipped tree's name
    tree_name = tree_name or _card_tree_name(export_dir / MODEL_CARD, len(choices))
    card = model_card(
        heads=heads,
        heads_config=heads_config,
        formats=layouts,
        tree_name=tree_name,
        choices=choices,
        manifest=manifest,
        calibration=calibration,
        report=report,
        backbone=str(published_path(export_dir) / TRAINED_BACKBONE) if backbone.is_dir() else None,
        export_dir=published_path(export_dir),
        pickle=(export_dir / MEDUSA / LEGACY_WEIGHTS_NAME).is_file(),
    )
    atomic_write_text(export_dir / MODEL_CARD, card)


def measured_another_tree(report: dict, choices: list[list[int]]) -> bool:
    """Whether eval's ``report`` was measured with another tree than ``choices`` (the exported paths):
    the paths its ``tree=`` named (``tree_choices``), else, in a report without them, its node count."""
    measured = report.get("tree_choices")
    if measured is None:
        size = (report.get("tree_fit") or {}).get("previous_size", report.get("tree_size"))
        return size != len(choices)
    return not _same_paths(measured, choices)


def _card_tree_name(card: Path, size: int) -> str | None:
    """The tree's name on the card at ``card`` (its "Tree: `name`, N nodes" line) when N is ``size``."""
    try:
        found = re.search(r"^Tree: `([^`]+)`, (\d+) nodes", card.read_text(), re.MULTILINE)
    except OSError:
        return None
    return found[1] if found and int(found[2]) == size else None


def _projection_note(heads) -> str:
    """One sentence on a shared or truncated head projection (nothing for ``own``)."""
    if heads.head_projection == "shared":
        return (
            " Every head reuses the base model's lm_head (`head_projection: shared`): the heads store "
            "only their residual blocks (vLLM: `original_lm_head`, one `lm_heads.0.weight`)."
        )
    if heads.head_projection == "truncated":
        return (
            f" Every head projects onto a draft vocabulary of {heads.draft_vocab_size} tokens "
            "(`head_projection: truncated`, `token_map` in the weights; vLLM: `truncated_vocab_size`); "
            "candidates are mapped back to full-vocabulary ids."
        )
    return ""


HEADS_FINGERPRINT = "heads_fingerprint"
"""Key of the heads' :meth:`~medusa_train.heads.MedusaHeads.fingerprint` in eval's report.json and in
the exported medusa/config.json (the source heads', before an ``export.dtype`` cast)."""
PROVENANCE_KEYS = (HEADS_FINGERPRINT, "backbone", MEDUSA_TRAIN_VERSION)
"""The heads' config.json keys that say which heads they are, on which backbone and by which medusa_train
trained: the export's vllm/config.json carries these (vLLM keeps them and reads none)."""


def belonging(
    fingerprints: set[str], heads_config: dict, manifest: dict | None, report: dict | None
) -> tuple[dict | None, dict | None]:
    """The distill manifest and the eval report, each kept only when it describes these heads.

    The manifest belongs when the heads' recorded training key names its data
    (``config.json["training"]["distill"]`` equals :func:`~medusa_train.data.distilled.data_key`);
    the report when it was measured on heads with one of ``fingerprints``. Heads from elsewhere
    (``export.heads_dir``, another workdir) thus never get this workdir's tau or data on their card.
    """
    training = heads_config.get("training")
    recorded = training.get("distill") if isinstance(training, dict) else None
    if manifest is not None and recorded != data_key(manifest):
        manifest = None
    if report is not None and report.get(HEADS_FINGERPRINT) not in fingerprints:
        report = None
    return manifest, report


def model_card(
    *,
    heads: MedusaHeads,
    heads_config: dict,
    formats: list[str],
    tree_name: str | None,
    choices: list[list[int]],
    manifest: dict | None,
    calibration: dict | None,
    report: dict | None,
    backbone: str | None = None,
    export_dir: Path | None = None,
    pickle: bool = False,
) -> str:
    """The export's README.md: what the heads are, how they were made and measured, how to load them
    with each engine, and the traps of those engines' loaders (docs/pipeline.md, "What each engine's
    loader reads").

    ``tree_name``, ``choices``: the exported tree (``medusa_choices.json``) and its ``tree=`` name, if
    known; ``report``'s figures measured with another tree say which.
    ``backbone``: the exported Medusa-2 backbone (the base model to load with the heads), if any.
    ``export_dir``: where the export lives (its final place), for the loading commands.
    ``pickle``: the medusa layout has ``medusa_lm_head.pt`` (``export.write_pickle``).
    """
    base = (
        backbone
        or heads.base_model_name_or_path
        or heads_config.get("base_model_name_or_path")
        or "<base model>"
    )
    # the Hub revision the heads were trained on: loading the base by name alone takes its default branch
    revision = base_revision(heads_config, manifest)
    at = f" at revision `{revision}`" if revision and not backbone and is_hub_id(base) else ""
    k = heads.num_heads
    tree_size = len(choices)
    lines = _front_matter(base, heads_config, backbone)
    lines += [
        f"# Medusa heads for `{base}`{at}",
        "",
        f"{k} Medusa heads (Cai et al., arXiv:2401.10774), {heads.num_layers} residual block(s) each, "
        f"hidden size {heads.hidden_size}, vocabulary {heads.vocab_size}, dtype {str(heads.dtype).removeprefix('torch.')}. "
        "Head k reads the base model's last hidden state and predicts token t+k+1; a tree of their "
        "candidates is verified in one forward pass of the base model." + _projection_note(heads),
        "",
        f"Fingerprint of these heads' tensors: `{heads.fingerprint()}` (stage=eval records the one it measured).",
        "",
        "## Base model",
        "",
    ]
    identity = heads_config.get("backbone")
    pad = ""
    if backbone:  # Medusa-2: the shipped backbone first, then the one training started from
        tuning = (heads_config.get("training") or {}).get("backbone_tuning", "full")
        merged = ", LoRA adapter merged" if tuning in ("lora", "qlora") else ""
        lines += [
            f"- `{base}`: trained together with the heads (Medusa-2, backbone_tuning `{tuning}`{merged}) and "
            "exported in `backbone/`; the heads match this backbone, not the original",
            "- started from:",
        ]
        pad = "  "
    else:
        lines.append(f"- `{base}`{at}")
    started = {**identity} if isinstance(identity, dict) else {}
    if revision:
        started["revision"] = revision
    lines += [f"{pad}- {key}: `{value}`" for key, value in started.items()]
    if base != "<base model>":  # what `base_model_name_or_path` is, so a reader knows if it travels
        pinned = (
            f", from its default branch: the heads were trained on revision `{revision}`, which the "
            "commands below pass where the engine takes one"
            if at
            else ""
        )
        where = (
            f"a Hugging Face Hub id: every engine downloads it by that name{pinned}"
            if is_hub_id(base)
            else "an absolute path on the machine that exported: serving elsewhere, copy that folder "
            "along and point `base_model_name_or_path` in `medusa/config.json` (and the commands "
            "below) at the copy"
        )
        lines += ["", f"`base_model_name_or_path` (in `medusa/config.json`) is {where}."]
    if backbone:
        lines += [
            "",
            "`backbone/config.json` also carries `rope_theta`, `rope_scaling` and `torch_dtype` (transformers 5 "
            "keeps them only in `rope_parameters` and `dtype`), and its tokenizer files the names "
            "transformers 4.x and tokenizers < 0.20 read, so consumers on transformers 4.x (FasterDecoding, "
            "TensorRT-LLM's converter, older vLLM/TGI) load the same model instead of silently falling back "
            "to rope_theta 10000.",
        ]
    lines += ["", "## Data", ""]
    if manifest:  # the sections of distill/manifest.json a reader wants; all of it if none is there
        picked = {
            key: manifest[key] for key in ("data", "generation", "counts", "created") if key in manifest
        }
        lines += _bullets(picked or manifest)
    else:
        lines.append(
            "- not known: no distill manifest of the data these heads were trained on is at hand "
            "(heads trained elsewhere, or the workdir's data was distilled again since)"
        )
    training = {
        key: v
        for key, v in heads_config.items()
        if key not in MEDUSA_CONFIG_KEYS and key not in ("backbone", HEADS_FINGERPRINT)
    }
    lines += ["", "## Training", ""]
    lines += _bullets(training) if training else ["- (no training settings recorded in config.json)"]
    lines += ["", "## Measured", ""]
    topk = calibration_topk(calibration)
    if topk:
        acc = top1_top5(topk)
        lines += ["| head | predicts | top-1 | top-5 |", "|---|---|---|---|"]
        lines += [
            f"| {i + 1} | t+{i + 2} | {t1:.3f} | {t5:.3f} |"
            for i, (t1, t5) in enumerate(zip(*acc, strict=True))
        ]
        lines += ["", "Held-out self-distilled data (`calibration.json`)."]
    else:
        lines.append("- head accuracy: not measured (no calibration.json)")
    if report:
        lines += [
            "",
            f"- tau (tokens per verification step, greedy, {report.get('tree_size')}-node tree): **{report.get('tau', 0):.2f}**",
            f"- speed-up over plain greedy `generate` (median over turns): **{headline_speedup(report)}** "
            f"({report.get('tokens_per_s_medusa', 0):.1f} vs {report.get('tokens_per_s_baseline', 0):.1f} tokens/s, "
            f"{report.get('num_prompts')} prompts, {(report.get('machine') or {}).get('device', 'this machine')})",
            f"- Medusa greedy output identical to plain greedy: {report.get('greedy_identical', 0):.0%} of prompts",
        ]
        if measured_another_tree(report, choices):
            lines.append(
                f"- measured with tree `{report.get('tree', '?')}` ({report.get('tree_size')} nodes), not the "
                f"exported tree below: run `python -m medusa_train stage=eval` with the exported tree to "
                "measure it"
            )
    else:
        lines.append(
            "- tau / speed-up: not measured for these heads: run `python -m medusa_train stage=eval` "
            "on them (it updates this card)"
        )
    chain = (report or {}).get("vllm_chain")
    if chain:
        lines += ["", "### vLLM", "", vllm_chain_table(chain)]
    calibrated = is_calibrated_tree(tree_name, choices, calibration)
    lines += [
        "",
        f"Tree: {f'`{tree_name}`, ' if tree_name else ''}{tree_size} nodes, in `medusa_choices.json`"
        f"{_tree_device(calibration, report, calibrated=calibrated)}.",
        "",
    ]
    ex = str(export_dir) if export_dir is not None else "export"
    lines += _files(formats, backbone is not None)
    pin = revision if at else None
    lines += _decode_with_generate(base, ex, backbone is not None, revision=pin)
    lines += _usage(
        base,
        heads,
        formats,
        tree_size=tree_size,
        export_dir=ex,
        pickle=pickle,
        speculative_tokens=recommend_speculative_tokens(chain),
        revision=pin,
    )
    return "\n".join(lines) + "\n"


def base_revision(heads_config: dict, manifest: dict | None) -> str | None:
    """The Hub revision (``model.revision``) of the base model the heads were trained on: recorded with
    them (``config.json["backbone"]["revision"]``), else the one their distilled data's manifest names
    (``manifest`` belongs to the heads: training refuses data of other checkpoint files). None: the
    default branch, or a local base."""
    identity = heads_config.get("backbone")
    revision = identity.get("revision") if isinstance(identity, dict) else None
    if revision is None and manifest is not None:
        source = (manifest.get("quick_settings") or {}).get("backbone_source") or {}
        revision = source.get("revision")
    return str(revision) if revision else None


HUB_TAGS = ("custom_generate", "medusa", "speculative-decoding", "medusa_train")
"""The card's Hub tags (``custom_generate``: how the Hub lists repositories with a
``custom_generate/generate.py``)."""


def _front_matter(base: str, heads_config: dict, backbone: str | None) -> list[str]:
    """The card's YAML metadata: library, pipeline, tags, the base model when it is a Hub id, and a
    license line for the user to fill in. Values are written as JSON strings (valid YAML)."""
    identity = heads_config.get("backbone")
    started = identity.get("name_or_path") if isinstance(identity, dict) else None
    hub = next((name for name in (base, started) if name and is_hub_id(name)), None)
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    if hub is not None:
        lines.append(f"base_model: {json.dumps(hub)}")
    lines += ["tags:"] + [f"- {tag}" for tag in HUB_TAGS]
    if backbone:
        lines.append("- medusa-2")
    lines += [
        "# license: apache-2.0  # set the heads' license (usually the base model's) before publishing",
        "---",
        "",
    ]
    return lines


def _files(formats: list[str], shipped_backbone: bool) -> list[str]:
    """The "Files" section: what each folder of the export is for."""
    out = ["## Files", ""]
    if MEDUSA in formats:
        out.append(
            "- `medusa/`: the heads in FasterDecoding's layout (`config.json` + `medusa_lm_head.safetensors`), "
            "read by TGI, TensorRT-LLM's converter, FasterDecoding and medusa_train"
        )
    if VLLM in formats:
        out.append(
            "- `vllm/`: the same heads in vLLM's `MedusaModel` layout (`config.json` + `model.safetensors`)"
        )
    out += [
        "- `custom_generate/`: `generate.py` + `requirements.txt`, the tree decoder behind "
        "`model.generate(custom_generate=...)` (below)",
        "- `medusa_choices.json`: the tree of candidate paths the decoders verify (stage=export's `tree=`)",
        "- `calibration.json` (when present): per-head top-k accuracy and the tree-size table of stage=train",
    ]
    if shipped_backbone:
        out.append(
            "- `backbone/`: the base model trained together with the heads (Medusa-2): load this one, "
            "not the model it started from"
        )
    return out + [""]


def _decode_with_generate(
    base: str, export_dir: str, shipped_backbone: bool, *, revision: str | None = None
) -> list[str]:
    """The copy-paste ``model.generate(custom_generate=...)`` example (``revision``: of the base)."""
    at = f', revision="{revision}"' if revision else ""
    which = " (the `backbone/` of this export: the heads were trained with it)" if shipped_backbone else ""
    return [
        "## Decode with `model.generate`",
        "",
        f"With transformers and medusa_train installed, load the base model{which} and pass this folder (or its "
        "Hub id) as `custom_generate`: greedy output is identical to plain `generate`; `do_sample=True` samples "
        "exactly; the generation config's temperature, top-k, top-p, min-p, repetition penalty and minimum "
        'lengths apply as in `generate`; `medusa_acceptance="typical"` uses Medusa\'s typical acceptance; '
        "a left-padded batch works. "
        '`cache_implementation="static"` runs the static-shape tree decoder (its step captured as one CUDA graph on a GPU); '
        "the tree is verified with the tree attention it was calibrated with where that differs from "
        '`medusa_attention="auto"` (the tree-attention kernels where they measured faster), else with auto.',
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model, tok = AutoModelForCausalLM.from_pretrained("{base}"{at}), AutoTokenizer.from_pretrained("{base}"{at})',
        f'out = model.generate(**tok("Hello", return_tensors="pt"), custom_generate="{export_dir}", '
        "trust_remote_code=True, max_new_tokens=64)",
        "print(tok.decode(out[0], skip_special_tokens=True))",
        "```",
        "",
    ]


def _usage(
    base: str,
    heads: MedusaHeads,
    formats: list[str],
    *,
    tree_size: int,
    export_dir: str,
    pickle: bool,
    speculative_tokens: int | None = None,
    revision: str | None = None,
) -> list[str]:
    """The "Loading" section: one snippet per engine, with the traps of that engine's loader.

    ``speculative_tokens``: the recommended vLLM ``num_speculative_tokens`` (eval's chain taus); None: K.
    ``revision``: the base model's Hub revision, passed where an engine's command takes one.
    """
    k, layers, ex = heads.num_heads, heads.num_layers, export_dir
    at = f" at revision `{revision}`" if revision else ""
    out = ["## Loading", "", f"This export is `{ex}`; the base model is `{base}`{at}.", ""]
    if VLLM in formats:
        n = speculative_tokens or k
        why = (
            f"`num_speculative_tokens={n}` is the recommendation from the measured chain taus above"
            if speculative_tokens
            else f"`num_speculative_tokens={k}` uses every head (not measured: `python -m medusa_train "
            "stage=eval` measures the chain of each n and recommends one)"
        )
        spec = json.dumps({"method": "medusa", "model": f"{ex}/vllm", "num_speculative_tokens": n})
        out += [
            f"**vLLM** (`vllm/`). vLLM's Medusa proposer drafts the chain of each head's top-1 token; the tree "
            f"is not used. `num_speculative_tokens` is the number of heads vLLM builds: at most {k} (more "
            f"fails to load: weights not initialized from the checkpoint); {why}.",
            "",
            "```bash",
            f"vllm serve {base}{f' --revision {revision}' if revision else ''} --speculative-config '{spec}'",
            "```",
            "",
            "```python",
            "from vllm import LLM",
            f'llm = LLM(model="{base}"{f", revision={json.dumps(revision)}" if revision else ""}, speculative_config={spec})',
            "```",
            "",
        ]
    if MEDUSA not in formats:
        return out
    # Shared heads have no projection of their own: TGI's MedusaHeadV2 (one block per head) and
    # FasterDecoding's legacy MedusaModel project with the base model's lm_head; TensorRT-LLM's converter
    # and FasterDecoding's MedusaModel read a projection per head (docs/pipeline.md).
    shared = heads.head_projection == "shared"
    tgi_serves = not shared or layers == 1
    serve_instead = ", ".join(
        (["TGI"] if tgi_serves else []) + ["vLLM"] + ([] if shared else ["TensorRT-LLM"])
    )
    out += [
        "**TGI** (`medusa/`). TGI sees `medusa_num_heads` in `medusa/config.json`, serves the model named by "
        f"`base_model_name_or_path` and reads `medusa_lm_head.safetensors`; `--speculate` may be at most {k} "
        "(the default). Do not add an `architectures` key to `medusa/config.json`: TGI then serves without "
        "Medusa, without an error. The chat template comes from the model folder, which has none: pass the "
        "base model's `tokenizer_config.json` (a local file) for `/v1/chat/completions`."
        + (
            ""
            if not shared
            else " These heads have no projection of their own: TGI serves them with `MedusaHeadV2`, which "
            "projects with the base model's lm_head."
            if tgi_serves
            else f" These heads have no projection of their own, and TGI's `MedusaHeadV2`, which serves such "
            f"heads, takes one residual block per head: TGI refuses these {layers}-block heads."
        ),
        "",
    ]
    if tgi_serves:
        out += [
            "```bash",
            f"text-generation-launcher --model-id {ex}/medusa"
            + ("" if is_hub_id(base) else f" --tokenizer-config-path {base}/tokenizer_config.json"),
            "```",
            "",
        ]
    if shared:
        out += [
            "**TensorRT-LLM** (`medusa/`). Its converter reads a vocabulary projection per head "
            "(`{h}.{L}.weight`), which these heads do not have: it cannot convert them.",
            "",
        ]
    else:
        out += [
            "**TensorRT-LLM** (`medusa/`, TensorRT-LLM's `examples/medusa`). Pass `--num_medusa_heads`: the "
            "converter's default (4) wins over `medusa/config.json`; `--max_medusa_token_len` (default 63) "
            f"must cover the tree's {tree_size} nodes."
            + (
                " The converter reads `medusa_lm_head.pt` when it is there (the same tensors)."
                if pickle
                else ""
            ),
            "",
            "```bash",
            f"python convert_checkpoint.py --model_dir {base} --medusa_model_dir {ex}/medusa --num_medusa_heads {k} "
            f"--max_medusa_token_len {max(63, tree_size)} --output_dir ckpt",
            "trtllm-build --checkpoint_dir ckpt --speculative_decoding_mode medusa --output_dir engine",
            f'python ../run.py --engine_dir engine --medusa_choices="$(cat {ex}/medusa_choices.json)" --temperature 1.0 ...',
            "```",
            "",
        ]
    out += [
        "**FasterDecoding Medusa** (`medusa/`). "
        + (
            "Its loader opens only `medusa_lm_head.pt`, which this export has (`export.write_pickle=true`): "
            "it is a pickle, and loading a pickle can run code, so load only exports you trust."
            if pickle
            else "Its loader opens only `medusa_lm_head.pt`, which this export does not have: re-run "
            "`python -m medusa_train stage=export export.write_pickle=true` (it writes that file, a pickle: "
            "loading it can run code)."
        )
        + (
            " These heads have no projection of their own: load them with "
            "`medusa.model.medusa_model_legacy.MedusaModel`, which projects every head with the base model's "
            "lm_head (`medusa.model.medusa_model.MedusaModel` builds a projection per head and, loading "
            "non-strictly, leaves each one random without a word)."
            if shared
            else ""
        )
        + " Its traps:",
        "",
    ]
    if not shared:  # the legacy MedusaModel builds as many heads as medusa_num_heads says
        out.append(
            "- it builds 5 heads whatever `medusa_num_heads` says and loads the weights non-strictly, without a "
            "word: "
            + (
                f"here {'head 5 stays' if k == 4 else f'heads {k + 1}..5 stay'} random. Always pass "
                f"`medusa_choices` from `medusa_choices.json` (depth <= {k}); its default trees reach depth 5 "
                "and would draft from a random head (greedy output is unchanged, fewer tokens are accepted)."
                if k < 5
                else f"here {'head 6 is' if k == 6 else f'heads 6..{k} are'} dropped; use trees of depth <= 5."
                if k > 5
                else "with 5 heads, as here, every head loads."
            )
        )
    if layers > 1:
        out.append(
            f"- its heads repeat one residual block {layers} times (the last block's weights serve every "
            f"block), so these heads compute something else there: serve them with {serve_instead} or "
            "medusa_train instead."
        )
    out += [
        "- it supports Llama base models only."
        if shared
        else "- it supports Llama and Mistral base models only.",
        "",
        "```python",
        "import json",
        "import torch",
        f"from medusa.model.{'medusa_model_legacy' if shared else 'medusa_model'} import MedusaModel",
        "",
        f'model = MedusaModel.from_pretrained("{ex}/medusa", torch_dtype=torch.float16, device_map="auto")',
        f'choices = json.load(open("{ex}/medusa_choices.json"))',
        'ids = model.get_tokenizer()(prompt, return_tensors="pt").input_ids.to(model.base_model.device)',
        "for out in model.medusa_generate(ids, temperature=0.0, medusa_choices=choices):",
        '    print(out["text"])',
        "```",
        "",
        f"**medusa_train** (either layout): `python -m medusa_train stage=eval eval.heads_dir={ex}/medusa`, or",
        "`medusa_train.formats.load_heads(dir)` + `medusa_train.decoding.medusa_generate(model, heads, ids, tree=choices, ...)`.",
        "",
    ]
    return out


def _bullets(d: dict, depth: int = 0) -> list[str]:
    """Scalars and short lists as a bullet list, nested dicts indented; long lists summarised, nulls left out."""
    out = []
    for key, value in d.items():
        if value is None or value == {}:
            continue
        pad = "  " * depth
        if isinstance(value, dict):
            out.append(f"{pad}- {key}:")
            out += _bullets(value, depth + 1)
        elif isinstance(value, list) and len(value) > 8:
            out.append(f"{pad}- {key}: ({len(value)} entries)")
        else:
            out.append(f"{pad}- {key}: `{value}`")
    return out


# -- the JSON files the card reads (calibration.json's: card_inputs) -----------------------------------
def _quartile_pair(report: dict) -> str | None:
    """The speed-up's quartiles come as a pair (the card prints the spread between them)."""
    present = [key for key in ("speedup_q25", "speedup_q75") if key in report]
    if len(present) == 1:
        other = "speedup_q75" if present[0] == "speedup_q25" else "speedup_q25"
        return f"has '{present[0]}' without '{other}'"
    return None


REPORT_INPUT = CardInput(
    {
        HEADS_FINGERPRINT: (str, NULL),
        "tau": NUMBER,
        "speedup!": NUMBER,
        "speedup_q25": NUMBER,
        "speedup_q75": NUMBER,
        "tokens_per_s_medusa": NUMBER,
        "tokens_per_s_baseline": NUMBER,
        "greedy_identical": NUMBER,
        "machine": (dict, NULL),
        "tree_choices": (list, NULL),
        "tree_choices[]": (list,),
        "tree_choices[][]": (int,),
        "tree_fit": (dict, NULL),
        "tree_fit.choices": (list, NULL),
        "tree_fit.calibrated_for": (dict, NULL),
        "tree_fit.calibrated_for.device!": (str,),
        "tree_fit.calibrated_for.dtype!": (str,),
        "tree_fit.calibrated_for.attention": (str,),
        "vllm_chain": (list, NULL),
        "vllm_chain[]": (dict,),
        "vllm_chain[].num_speculative_tokens!": (int,),
        "vllm_chain[].tau!": NUMBER,
    },
    "run `python -m medusa_train stage=eval` to measure the heads again",
    _quartile_pair,
)
"""stage=eval's report.json: tau, speed-up, the trees measured, vLLM's chain."""

MANIFEST_INPUT = CardInput(
    {
        "quick_settings": (dict, NULL),
        "quick_settings.backbone_source": (dict, NULL),
        "quick_settings.backbone_source.revision": (str, NULL),
    },
    REGENERATE,
)
"""stage=distill's manifest.json: the base model's revision (the card shows its other sections
whatever they hold)."""


def read_json(
    path: Path, expected: CardInput, *, consequence: str = "the model card is written without it"
) -> dict | None:
    """The JSON object in ``path`` as the card reads it; None when it is missing or damaged.

    Damaged: unreadable, not valid JSON (nesting too deep included), or
    :func:`~medusa_train.card_inputs.shape_problem` (:func:`~medusa_train.card_inputs.read_checked`).
    The card is written without a damaged file (as without a missing one: an export never fails over
    eval's or distill's records), and a warning line names the file, what is wrong,
    ``expected.repair`` and ``consequence`` (what goes on without the file).
    """
    data, problem = read_checked(path, expected)
    if problem is not None:
        log.warning("%s is damaged (%s): %s; %s", path, problem, expected.repair, consequence)
    return data
