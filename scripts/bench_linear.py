"""The 8B shape's linear layers at the token counts a tree step verifies: how close each product comes
to the copy bandwidth.

Run as:
    # GPU (about 20 s on one H100): Llama-3-8B's weight shapes, bf16, M = 1 4 16 64 256 tokens
    python scripts/bench_linear.py --device cuda --json linear.json
    # CPU dry run: a tiny shape
    python scripts/bench_linear.py --device cpu --quick

A Medusa step's forward reads the same weights as a plain step's and multiplies them by M tokens
instead of one. At one token the product is a matrix-vector kernel; at a few tokens a matrix-matrix
kernel, which may read its weight more slowly: then every tree step pays for it whatever its
attention, and a bigger tree is no cheaper per extra node. Per weight (``q``, ``k`` / ``v``, ``o``,
``gate`` / ``up``, ``down``, ``lm_head``, a head's projection over 32K tokens) and per M: GPU time per
product (calls queued back to back behind a sleep kernel, so launches are not timed, as in a
replayed CUDA graph), the weight's bytes over that time, and its fraction of the device's measured
copy bandwidth. Each product cycles through enough copies of its weight to defeat the L2 cache.
Then per M the backbone's products of one forward: 32 layers plus the lm_head, against the same
bytes at copy speed. On a CPU, wall-clock medians (a dry run of the code, not a measurement).
Needs only torch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.bench import copy_bandwidth, report, time_queued  # noqa: E402

L2_DEFEAT_BYTES = 256 << 20  # each product cycles through copies of its weight totalling at least this

# (name, out features, in features, products per forward): Llama-3-8B, one decoder layer's products
# counted per layer (the forward has 32), the lm_head and a draft head once.
LLAMA8B = {"hidden": 4096, "kv": 1024, "ffn": 14336, "vocab": 128256, "draft": 32768, "layers": 32}
TINY = {"hidden": 64, "kv": 32, "ffn": 128, "vocab": 256, "draft": 128, "layers": 2}


def weights_of(shape: dict) -> list[tuple[str, int, int, int]]:
    h, layers = shape["hidden"], shape["layers"]
    return [
        ("q / o", h, h, 2 * layers),
        ("k / v", shape["kv"], h, 2 * layers),
        ("gate / up", shape["ffn"], h, 2 * layers),
        ("down", h, shape["ffn"], layers),
        ("lm_head", shape["vocab"], h, 1),
        ("head projection (draft vocab)", shape["draft"], h, 0),  # not part of the backbone's forward
    ]


def time_products(x: torch.Tensor, weights: list[torch.Tensor], calls: int) -> float:
    """Milliseconds per ``F.linear(x, w)``, cycling through ``weights`` (GPU time of queued calls on
    CUDA, the wall-clock median elsewhere)."""
    F.linear(x, weights[0])  # warm-up: the library picks its kernel
    if x.device.type != "cuda":
        times = []
        for i in range(calls):
            t0 = time.perf_counter()
            F.linear(x, weights[i % len(weights)])
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    cycle = itertools.cycle(weights)
    return time_queued(lambda: F.linear(x, next(cycle)), warmup=len(weights), iters=calls)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = TINY if args.quick else LLAMA8B
    bw = copy_bandwidth(device, 1 << (30 if device.type == "cuda" else 24))
    results: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "copy_gb_s": bw / 1e9,
        "rows": [],
        "forward": [],
    }
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    per_forward = {m: 0.0 for m in args.tokens}
    forward_bytes = 0
    for name, out_f, in_f, count in weights_of(shape):
        nbytes = out_f * in_f * torch.finfo(dtype).bits // 8
        copies = max(1, math.ceil(L2_DEFEAT_BYTES / nbytes)) if device.type == "cuda" else 1
        weights = [
            torch.randn(out_f, in_f, device=device, dtype=dtype, generator=gen) * in_f**-0.5
            for _ in range(copies)
        ]
        forward_bytes += count * nbytes
        for m in args.tokens:
            x = torch.randn(m, in_f, device=device, dtype=dtype, generator=gen)
            ms = time_products(x, weights, args.calls)
            row = {
                "weight": name,
                "out": out_f,
                "in": in_f,
                "tokens": m,
                "ms": ms,
                "gb_s": nbytes / ms / 1e6,
                "of_copy": nbytes / ms / 1e6 / (bw / 1e9),
            }
            results["rows"].append(row)
            per_forward[m] += count * ms
            print(json.dumps(row), flush=True)
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    floor_ms = 1e3 * forward_bytes / bw
    for m in args.tokens:
        results["forward"].append(
            {"tokens": m, "ms": per_forward[m], "floor_ms": floor_ms, "x_floor": per_forward[m] / floor_ms}
        )
    results["table"] = markdown(results)
    return results


def markdown(results: dict) -> str:
    tokens = sorted({r["tokens"] for r in results["rows"]})
    lines = [
        f"device {results['device']}, {results['dtype']}, torch {results['torch']}: copy "
        f"{results['copy_gb_s']:.0f} GB/s",
        "",
        "Fraction of the copy bandwidth each product reaches (ms in brackets):",
        "",
        "| weight (out x in) | " + " | ".join(f"M = {m}" for m in tokens) + " |",
        "|---|" + "---:|" * len(tokens),
    ]
    by_weight: dict[str, dict[int, dict]] = {}
    for r in results["rows"]:
        by_weight.setdefault(f"{r['weight']} ({r['out']} x {r['in']})", {})[r["tokens"]] = r
    for name, cells in by_weight.items():
        lines.append(
            f"| {name} | "
            + " | ".join(f"{cells[m]['of_copy']:.2f} ({cells[m]['ms']:.3f})" for m in tokens)
            + " |"
        )
    lines += [
        "",
        "The backbone's products of one forward (every layer + the lm_head) against its weights at copy speed:",
        "",
        "| tokens | ms | floor ms | x floor |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {f['tokens']} | {f['ms']:.2f} | {f['floor_ms']:.2f} | {f['x_floor']:.2f} |"
        for f in results["forward"]
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="a tiny shape (a CPU dry run)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="rows of each product")
    p.add_argument("--calls", type=int, default=50, help="timed products per weight and token count")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if min(args.tokens) < 1 or args.calls < 1:
        p.error("--tokens and --calls must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; give --device cpu for a dry run")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
