"""Benchmark one layer's tree attention: SDPA with the dense masks against the tree kernels.

Run as:
    # GPU (about a minute on one H100): contexts 512/2K/8K/32K, trees of 16/64/256 nodes, batch 1 and 8,
    # bf16, 32 query heads, 8 KV heads, head dim 128
    python scripts/bench_attention.py --device cuda --json attention.json
    # CPU dry run (tiny shapes; the Triton kernel in triton's interpreter)
    python scripts/bench_attention.py --device cpu --quick

Per shape, the time of one attention call (the masks and the tree description built beforehand):
``sdpa_float`` SDPA with the dense ``(B, 1, M, W)`` float mask and K/V expanded to the query heads (what
the decoders' ``attention=sdpa`` path ran through transformers, its K/V expansion left out), ``sdpa_bool``
the same with a boolean mask, ``flash_nomask`` SDPA without any mask (grouped K/V; a lower bound: it
ignores the tree; with ragged rows, every row over the one width that gives it as many keys as the
rows have), ``sdpa_repeat`` transformers' SDPA attention function on the float mask (its
``repeat_kv`` copy of K/V timed too), ``sdpa_packed`` the decoders' ``attention=sdpa`` path
(``packed_gqa_sdpa``: query heads stacked per KV head, nothing expanded), and the
tree kernels ``triton`` (on a GPU in the launch configuration its tuner picked for the shape, reported as
``triton_config``), ``triton_default`` (the same kernel in its untuned default configuration) and
``cuda``. Each kernel's largest deviation from ``sdpa_bool`` (relative to the output's
largest magnitude) is reported too. A case that fails is reported with its error and the rest go on.
Needs only torch (+ triton for the Triton kernel, nvcc + ninja for the CUDA one).

Two times per method on a GPU. ``<method>`` is the GPU's own time per call: the calls are queued
behind a sleep kernel, so the host has launched them all before the first starts and launch gaps are
not timed (what a CUDA-graph replay of the decoder step pays). ``<method>_call`` is the CUDA-event
median of single calls, launch cost included (what an eager decoder pays per layer). On a CPU both
are wall-clock medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medusa_train.decoding.attention import TreeMask, resolve_attention, tree_attention  # noqa: E402
from medusa_train.decoding.attention.sdpa import dense_tree_mask, packed_gqa_sdpa  # noqa: E402
from medusa_train.decoding.attention.triton_kernel import (  # noqa: E402
    default_config,
    triton_next_pow2,
    triton_tree_attention,
    tuned_configs,
)
from medusa_train.decoding.tree import TreeBuffers  # noqa: E402
from tests.helpers.bench import time_queued  # noqa: E402
from tests.helpers.models import random_tree  # noqa: E402

METHODS = (
    "sdpa_float",
    "sdpa_bool",
    "flash_nomask",
    "sdpa_repeat",
    "sdpa_packed",
    "triton",
    "triton_default",
    "cuda",
)
KERNELS = ("triton", "triton_default", "cuda")


def tree_of(nodes: int) -> list[list[int]]:
    """A random tree of ``nodes`` nodes (root included), depth <= 5 (a Medusa-shaped tree)."""
    return random_tree(nodes, nodes=nodes - 1, max_depth=5, max_rank=max(4, nodes // 4))


def time_call(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU, wall clock on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


class GroupedLayer(torch.nn.Module):
    """What transformers' attention functions read from a grouped-query attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def bench_case(
    context: int,
    nodes: int,
    batch: int,
    shape: dict,
    device: torch.device,
    dtype,
    warmup: int,
    iters: int,
    methods: tuple[str, ...] = METHODS,
) -> dict:
    """Every method at one shape; the rows of a batch have different past lengths (the longest ``context``)."""
    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    gen = torch.Generator().manual_seed(context + nodes + batch)
    mask = TreeMask.of(TreeBuffers.from_choices(tree_of(nodes)).to(device))
    m = mask.num_nodes
    width = context + m
    pasts = [context - (b * context) // (4 * batch) for b in range(batch)]  # ragged, longest first
    past = torch.tensor(pasts, dtype=torch.int32, device=device)
    start = torch.zeros(batch, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, m, d, generator=gen).to(device, dtype)  # (B, Hq, M, D)
    k = torch.randn(batch, hkv, width, d, generator=gen).to(device, dtype)  # (B, Hkv, W, D)
    v = torch.randn(batch, hkv, width, d, generator=gen).to(device, dtype)
    allowed = dense_tree_mask(past, start, mask.bits, mask.depth, width)  # (B, 1, M, W)
    float_mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )
    untuned = default_config((hq // hkv) * m, max(16, triton_next_pow2(d)), dtype, device.type)
    kernel_args = (q, k, v, past, start, mask.bits, mask.depth, d**-0.5)
    layer = GroupedLayer(hq // hkv)
    # Flash without a mask reads every row's keys up to one width: the width that gives it as many keys
    # as the ragged rows have (sum of past + M), so that it stays a lower bound on the same work.
    flash_width = -(-(sum(pasts) + batch * m) // batch)
    k_flash, v_flash = k[:, :, :flash_width], v[:, :, :flash_width]
    k_rep = k.repeat_interleave(hq // hkv, dim=1)  # (B, Hq, W, D), as transformers' repeat_kv
    v_rep = v.repeat_interleave(hq // hkv, dim=1)
    calls = {
        "sdpa_float": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=float_mask),
        "sdpa_bool": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=allowed),
        "flash_nomask": lambda: F.scaled_dot_product_attention(q, k_flash, v_flash, enable_gqa=True),
        "sdpa_repeat": lambda: sdpa_attention_forward(layer, q, k, v, float_mask, scaling=d**-0.5),
        "sdpa_packed": lambda: packed_gqa_sdpa(q, k, v, float_mask, d**-0.5),
        "triton": lambda: tree_attention(q, k, v, past, start, mask, backend="triton"),
        "triton_default": lambda: triton_tree_attention(*kernel_args, config=untuned),
        "cuda": lambda: tree_attention(q, k, v, past, start, mask, backend="cuda"),
    }
    ref = calls["sdpa_bool"]().float()
    scale = ref.abs().max().item()
    keys = sum(pasts) + batch * m  # every row's past and tree
    row: dict = {
        "context": context,
        "nodes": m,
        "batch": batch,
        # what a call must move and compute at least: K and V of every key once; every query against
        # every key of its row (the tree's mask spares a little of that), two products of head dim d
        "kv_bytes": 2 * keys * hkv * d * k.element_size(),
        "dense_flop": 4 * keys * m * hq * d,
    }
    for name in methods:
        try:
            if name in KERNELS:
                resolve_attention(
                    name.removesuffix("_default"), device
                )  # a clear reason when it cannot run here
                tuned = set(tuned_configs().items())
                row[f"{name}_err"] = ((calls[name]().float() - ref).abs().max().item()) / scale
                if name == "triton":  # its first call tuned it (on a GPU): which configuration won
                    picked = [str(c) for _, c in set(tuned_configs().items()) - tuned]
                    row["triton_config"] = picked[0] if picked else str(untuned)
            row[f"{name}_call"] = time_call(calls[name], device, warmup, iters)
            queued = device.type == "cuda"
            row[name] = time_queued(calls[name], warmup, iters) if queued else row[f"{name}_call"]
        except Exception as err:  # noqa: BLE001 - report the case and go on
            row[name] = None
            row[f"{name}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return row


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table: GPU ms per call (launch gaps not timed), the Triton kernel's
    speed-up over sdpa_float and its ratio to flash without a mask, then single-call times with the
    launch included."""
    lines = [
        "| context | nodes | batch | SDPA + float mask | SDPA + bool mask | flash, no mask (lower bound) | "
        "transformers' SDPA (K/V expanded) | packed SDPA | "
        "triton (tuned config) | triton, default config | cuda | triton vs float mask | triton / flash | "
        "triton, flash: K/V GB/s, TFLOPS | per call with launch: float mask, triton | "
        "max rel. err (triton, cuda) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def rates(r: dict, name: str) -> str:  # K/V read and dense products per second of GPU time
        t = r.get(name)
        if not t or "kv_bytes" not in r:
            return "-"
        return f"{r['kv_bytes'] / t / 1e6:.0f}, {r['dense_flop'] / t / 1e9:.0f}"

    def ms(x):
        return "failed" if x is None else f"{x:.3f}"

    for r in rows:

        def cell(name: str, r: dict = r) -> str:  # "-": not timed (--methods)
            return ms(r[name]) if name in r else "-"

        t, f, nm = r.get("triton"), r.get("sdpa_float"), r.get("flash_nomask")
        speed = f"{f / t:.2f}x" if t and f else "-"
        bound = f"{t / nm:.2f}" if t and nm else "-"
        calls = f"{cell('sdpa_float_call')}, {cell('triton_call')}"
        errs = ", ".join(f"{r[k]:.1e}" if k in r else "-" for k in ("triton_err", "cuda_err"))
        lines.append(
            f"| {r['context']} | {r['nodes']} | {r['batch']} | {cell('sdpa_float')} | {cell('sdpa_bool')} | "
            f"{cell('flash_nomask')} | {cell('sdpa_repeat')} | {cell('sdpa_packed')} | "
            f"{cell('triton')} ({r.get('triton_config', '-')}) | {cell('triton_default')} | {cell('cuda')} | "
            f"{speed} | {bound} | {rates(r, 'triton')}; {rates(r, 'flash_nomask')} | {calls} | {errs} |"
        )
    failures = sorted({f"{k[:-6]}: {v}" for r in rows for k, v in r.items() if k.endswith("_error")})
    if failures:
        lines += ["", "Failures:"] + [f"- {f}" for f in failures]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes (a CPU dry run)")
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--nodes", type=int, nargs="+", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--iters", type=int, default=None, help="timed calls per method (median)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument(
        "--methods", nargs="+", choices=METHODS, default=list(METHODS), help="what to time (default: all)"
    )
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    if args.quick:
        shape = {"q_heads": 4, "kv_heads": 2, "head_dim": 16}
        contexts, nodes, batches, iters, warmup = [40], [8], [1, 2], 2, 1
    else:
        shape = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
        contexts, nodes, batches, iters, warmup = [512, 2048, 8192, 32768], [16, 64, 256], [1, 8], 10, 3
    contexts, nodes, batches = args.contexts or contexts, args.nodes or nodes, args.batches or batches
    iters = args.iters or iters
    dtype = getattr(torch, args.dtype)
    rows = []
    for batch in batches:
        for context in contexts:
            for n in nodes:
                try:
                    rows.append(
                        bench_case(
                            context, n, batch, shape, device, dtype, warmup, iters, tuple(args.methods)
                        )
                    )
                except Exception as err:  # noqa: BLE001 - e.g. out of memory: report and go on
                    rows.append(
                        {"context": context, "nodes": n, "batch": batch, "case_error": repr(err)[:300]}
                    )
                print(json.dumps(rows[-1]), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(markdown([r for r in rows if "case_error" not in r]))
    for r in rows:
        if "case_error" in r:
            print(
                f"case context={r['context']} nodes={r['nodes']} batch={r['batch']} failed: {r['case_error']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
