"""Where one step of the static decoder spends its GPU time: kernels by kind and by part of the step.

Run as:
    # GPU (one H100, about a minute): Llama-3-8B shape, random bf16 weights, 4 random heads, context 2048
    python scripts/bench_static_profile.py --device cuda --nodes 1 64 --attention triton --json profile.json
    # CPU dry run (seconds): a tiny Llama; each operator's own CPU time stands in for kernel time
    python scripts/bench_static_profile.py --device cpu --tiny

bench_static.py times the captured step (one CUDA graph); this script runs the same step eagerly under
``torch.profiler`` and adds up the GPU time of the kernels each step launches (the same kernels the
graph replays; their launch gaps are not counted), so it tells what a captured step's time is made of:

- by kind of kernel: weight products (GEMM/GEMV), attention, the rest (norms, RoPE, activations,
  residual adds, casts, copies, top-k, the acceptance's gathers), with the number of kernels per step;
- by part of the step: the backbone's forward, the heads' logits, and the rest (candidates,
  acceptance, KV compaction, bookkeeping).

Against the copy bandwidth: the weights' floor, and the GPU time of the weight products over it. A
step of many small kernels is slow by their count even when each is fast: on one H100 the captured
plain step took ~3 ms more than its weight products (docs/benchmarks.md). Needs only torch +
transformers.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_static import build, tiny_llama_config  # noqa: E402

from medusa_train.decoding import MEDUSA_63  # noqa: E402
from medusa_train.decoding.static import StaticDecoder  # noqa: E402
from tests.helpers.bench import copy_bandwidth, report  # noqa: E402
from tests.helpers.models import llama8b_config  # noqa: E402

STEP, BACKBONE, HEADS = "medusa step", "backbone forward", "heads"
PARTS = (BACKBONE, HEADS, "rest of the step")
KINDS = {
    # (what the kernel or, on a CPU, the operator is called): checked in this order
    "weight products": re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitk|aten::(mm|addmm|bmm)$", re.I),
    "attention": re.compile(r"flash|fmha|attention|attn|sdpa|tree_attn", re.I),
}
REST = "norms, RoPE, activations, copies, ..."


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS.items() if pattern.search(name)), REST)


def part_of(event) -> str:
    """The part of the step ``event`` ran in: the innermost of our ranges above it."""
    while event is not None:
        if event.name in (BACKBONE, HEADS):
            return event.name
        event = event.cpu_parent
    return PARTS[2]


def profile_case(model, heads, args, nodes: int, device: torch.device) -> dict:
    """Profile ``args.steps`` steps of a ``nodes``-node tree after a warm-up call; figures per step."""
    tree = MEDUSA_63[: nodes - 1]
    ids = torch.randint(
        1, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(1)
    )
    prompts = [ids.to(device)] * args.batch_size
    capacity = args.context + args.steps + len(tree) + 1
    decoder = StaticDecoder(
        model, heads, tree, capacity, batch_size=args.batch_size, capture="eager", attention=args.attention
    )
    step, forward, logits_rows = decoder._run, model.forward, decoder.packed.logits_rows

    def ranged(name, fn):
        def call(*a, **k):
            with record_function(name):
                return fn(*a, **k)

        return call

    decoder._run = ranged(STEP, step)
    model.forward = ranged(BACKBONE, forward)
    decoder.packed.logits_rows = ranged(HEADS, logits_rows)
    try:
        decoder.generate_batch(prompts, max_new_tokens=4)  # warm-up: kernels compiled and tuned
        on_cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=activities) as prof:
            out = decoder.generate_batch(prompts, max_new_tokens=args.steps)
            if on_cuda:
                torch.cuda.synchronize(device)
    finally:
        del model.forward  # the class's forward again
    # On CUDA the profiler also lists each range's copy on the GPU's timeline (no kernels under it):
    # the steps are the host's ranges, one per step run.
    steps = [e for e in prof.events() if e.name == STEP and e.device_type == DeviceType.CPU]
    if len(steps) != out.num_forwards:
        raise RuntimeError(f"profiled {len(steps)} step ranges for {out.num_forwards} steps run")
    cells: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])  # (part, kind): [us, count]

    def own_work(event) -> list[tuple[str, float]]:
        """``(name, microseconds)`` of what ``event`` itself ran: its kernels on CUDA, on a CPU its
        own CPU time (children excluded)."""
        if on_cuda:
            return [(k.name, k.duration) for k in event.kernels]
        return [] if event.is_user_annotation else [(event.name, event.self_cpu_time_total)]

    def add(event) -> None:
        for name, us in own_work(event):
            cell = cells[part_of(event), kind_of(name)]
            cell[0] += us
            cell[1] += 1
        for child in event.cpu_children:
            add(child)

    for event in steps:
        add(event)
    n = max(1, len(steps))
    return {
        "nodes": nodes,
        "steps": len(steps),
        "tau": out.tau,
        "ms_per_step": sum(us for us, _ in cells.values()) / n / 1000,
        "kernels_per_step": sum(c for _, c in cells.values()) / n,
        "cells": [
            {"part": part, "kind": kind, "ms": us / n / 1000, "count": c / n}
            for (part, kind), (us, c) in sorted(cells.items())
        ],
    }


def cell(case: dict, part: str, kinds: list[str] | None = None) -> tuple[float, float]:
    """Milliseconds and kernels per step of ``part`` (of ``kinds``; None: all) in a profiled case."""
    rows = [c for c in case["cells"] if c["part"] == part and (kinds is None or c["kind"] in kinds)]
    return sum(c["ms"] for c in rows), sum(c["count"] for c in rows)


def markdown(results: dict) -> str:
    unit = "GPU kernel" if results["device"] != "cpu" else "CPU operator"
    lines = [
        f"device {results['device']}, context {results['context']}, batch {results['batch']}, attention "
        f"{results['attention']}, heads {results['heads']}: weights {results['weights_gb']:.2f} GB, copy "
        f"{results['copy_gb_s']:.0f} GB/s, floor {results['floor_ms']:.2f} ms",
        f"{unit} time per step in ms, launch gaps not counted; count: {unit}s per step",
        "",
        "| nodes | step ms (count) | backbone: weight products (x floor) | attention (count) | rest (count) | "
        "heads (count) | rest of the step (count) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in results["cases"]:
        if "error" in case:
            lines.append(f"| {case['nodes']} | failed: {case['error'][:80]} | | | | | |")
            continue

        products, _ = cell(case, BACKBONE, ["weight products"])
        attention, attention_n = cell(case, BACKBONE, ["attention"])
        rest, rest_n = cell(case, BACKBONE, [REST])
        heads, heads_n = cell(case, HEADS)
        other, other_n = cell(case, PARTS[2])
        lines.append(
            f"| {case['nodes']} | {case['ms_per_step']:.2f} ({case['kernels_per_step']:.0f}) | {products:.2f} "
            f"({products / results['floor_ms']:.2f}) | {attention:.2f} ({attention_n:.0f}) | {rest:.2f} "
            f"({rest_n:.0f}) | {heads:.2f} ({heads_n:.0f}) | {other:.2f} ({other_n:.0f}) |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    config = tiny_llama_config() if args.tiny else llama8b_config()
    model, heads = build(config, args.device, dtype, args.head_projection, draft_vocab=args.draft_vocab)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(device, 1 << (30 if device.type == "cuda" else 26))
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "context": args.context,
        "batch": args.batch_size,
        "attention": args.attention,
        "heads": args.head_projection,
        "weights_gb": weight_bytes / 1e9,
        "copy_gb_s": bw / 1e9,
        "floor_ms": 1000 * weight_bytes / bw,
        "cases": [],
    }
    with torch.inference_mode():
        for nodes in args.nodes:
            try:
                case = profile_case(model, heads, args, nodes, device)
            except Exception as err:  # noqa: BLE001 - report and go on
                case = {"nodes": nodes, "error": f"{type(err).__name__}: {err}"}
            results["cases"].append(case)
            print(case, flush=True)
    results["table"] = markdown(results)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the 8B shape (dry run)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 64], help="tree sizes (1..64)")
    p.add_argument("--steps", type=int, default=16, help="steps profiled per tree size")
    p.add_argument("--attention", choices=("sdpa", "triton", "cuda"), default="sdpa")
    p.add_argument("--head-projection", choices=("own", "shared", "truncated"), default="own")
    p.add_argument("--draft-vocab", type=int, default=32768, help="tokens of truncated heads")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if any(not 1 <= n <= len(MEDUSA_63) + 1 for n in args.nodes):
        p.error(f"--nodes must be between 1 and {len(MEDUSA_63) + 1}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; give --device cpu --tiny for a dry run")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    report(results, args.json)
    return 0 if all("error" not in c for c in results["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
