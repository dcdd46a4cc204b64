"""How steady the tree calibration's choice is: trained heads calibrated again and again on this machine.

The calibration after training (``decoding.calibrate.calibrate_tree``) picks the tree size with the
best expected tokens per second from the heads' held-out accuracy and the backbone's forward latency
at each size, timed on this machine. A latency curve skewed by a machine that drifts while it is
measured picks another tree from one run to the next. This script repeats the calibration of one set
of heads ``--trials`` times, with the latencies timed in rounds (every size once per round: what the
calibration does) and one size after the other, alternating the two, and reports which tree size
each order picked how often at tolerance 0, the best expected tokens/s (``--json``: with every
trial's latency curve). The accuracy table and settings are those stored in the heads'
``calibration.json``, so only the timing differs between trials. For each ``--tolerances`` value it
also reports the picks of ``pick_size`` on the same trials' tables: the smallest tree within that
fraction of the best expected tokens/s (``tree.tolerance``). ``--attention`` is the tree attention
the forwards are timed with (the stage times ``eval.attention``); default SDPA.

Run as:
    python scripts/bench_calibration.py --backbone runs/default/pretrain --heads runs/default/heads
    python scripts/bench_calibration.py --backbone ... --heads ... --trials 16 --json calibration.json
    python scripts/bench_calibration.py --backbone ... --heads ... --tolerances 0 0.02 0.05
    python scripts/bench_calibration.py --backbone ... --heads ... --device cuda --attention triton
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from medusa_train.decoding.attention import ATTENTION_CHOICES  # noqa: E402

ORDERS = {"rounds": True, "one size after the other": False}
"""Name of each timing order -> ``interleave`` of ``measure_forward_latency``."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbone", required=True, help="the backbone's directory (e.g. runs/default/pretrain)")
    p.add_argument("--heads", required=True, help="trained heads' directory, holding calibration.json")
    p.add_argument("--trials", type=int, default=8, help="calibrations per timing order (>= 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--attention",
        default="sdpa",
        choices=ATTENTION_CHOICES,
        help="tree attention the forwards are timed with, as the calibration takes eval.attention "
        "(auto: resolved as a decoder call of the stored latency context's keys)",
    )
    p.add_argument(
        "--tolerances",
        type=float,
        nargs="+",
        default=[0.0, 0.01, 0.02, 0.03, 0.05],
        help="tree.tolerance values whose picks are reported (each in [0, 1))",
    )
    p.add_argument("--json", help="write the results to this file too")
    args = p.parse_args(argv)
    if args.trials < 1:
        p.error(f"--trials must be >= 1, got {args.trials}")
    if not all(0 <= t < 1 for t in args.tolerances):
        p.error(f"--tolerances must be in [0, 1), got {args.tolerances}")
    return args


def run(args: argparse.Namespace) -> dict:
    from medusa_train.backbone import load_backbone
    from medusa_train.decoding.calibrate import calibrate_tree, pick_size

    calibration_file = Path(args.heads) / "calibration.json"
    if not calibration_file.is_file():
        raise SystemExit(f"error: {calibration_file} not found: --heads must be a trained heads directory")
    stored = json.loads(calibration_file.read_text())
    settings = stored["settings"]
    acc = torch.tensor(stored["head_topk_accuracy"])  # (K, 10)
    model, _ = load_backbone(args.backbone, dtype=args.dtype, device=args.device)
    model.eval()
    picks: dict[str, list[int]] = {name: [] for name in ORDERS}
    by_tolerance: dict[str, dict[float, list[int]]] = {
        name: {t: [] for t in args.tolerances} for name in ORDERS
    }
    curves: dict[str, list[dict[int, float]]] = {name: [] for name in ORDERS}  # ms by token count
    with torch.inference_mode():
        for _ in range(args.trials):
            for name, interleave in ORDERS.items():
                tree = calibrate_tree(
                    model,
                    acc,
                    settings["tree_max_nodes"],
                    settings["tree_topk"],
                    settings["tree_latency_context"],
                    attention=args.attention,
                    interleave=interleave,
                )
                picks[name].append(len(tree["choices"]))
                for t in args.tolerances:
                    by_tolerance[name][t].append(pick_size(tree["table"], t))
                curves[name].append({n: round(v["seconds"] * 1e3, 3) for n, v in tree["latency"].items()})
    return {
        "machine": tree["calibrated_for"],  # device, dtype and the tree attention timed
        "trials": args.trials,
        "stored_pick": stored["tree"]["best"]["nodes"],
        "picks": picks,
        "counts": {name: dict(sorted(collections.Counter(p).items())) for name, p in picks.items()},
        "tolerance_counts": {
            name: {t: dict(sorted(collections.Counter(p).items())) for t, p in per.items()}
            for name, per in by_tolerance.items()
        },
        "context_len": tree["context_len"],
        "latency_ms": curves,
    }


def table(result: dict) -> str:
    lines = ["| timing order | tree sizes picked (nodes: times) |", "|---|---|"]
    for name, counts in result["counts"].items():
        lines.append(f"| {name} | {', '.join(f'{n}: {c}' for n, c in counts.items())} |")
    lines += ["", "| timing order | tolerance | tree sizes picked (nodes: times) |", "|---|---:|---|"]
    for name, per in result["tolerance_counts"].items():
        for t, counts in per.items():
            lines.append(f"| {name} | {t:g} | {', '.join(f'{n}: {c}' for n, c in counts.items())} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    machine = result["machine"]
    print(
        f"{machine['device']} ({machine['dtype']}, {machine['attention']} attention), "
        f"{result['trials']} trials per order"
    )
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
