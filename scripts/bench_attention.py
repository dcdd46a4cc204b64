"""Benchmark one layer's tree attention: SDPA with the dense masks against the tree kernels.

Run as:
    # GPU (about a minute on one H100): contexts 512/2K/8K/32K, trees of 16/64/256 nodes, batch 1 and 8,
    # bf16, 32 query heads, 8 KV heads, head dim 128
    python scripts/bench_attention.py --device cuda --json attention.json
    # CPU dry run (tiny shapes; the Triton kernel in triton's interpreter)
    python scripts/bench_attention.py --device cpu --quick
    # the attention of models whose layers the kernel computes more of (chunks, sinks, softcapped scores,
    # values narrower than the keys), each at its own head layout: contexts 2K/8K, 64 nodes, batch 1 and 8
    python scripts/bench_attention.py --device cuda --models llama4 gpt-oss gemma2 deepseek-v3

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
``cuda``. Each kernel's largest deviation from the reference (relative to the output's largest
magnitude) is reported too: SDPA with the boolean mask, or the softmax written out in fp32 where sinks
or a softcap apply (:func:`~medusa_train.decoding.attention.sdpa.sdpa_tree_attention`). A case that fails is reported with its error and the rest go on.

``--models`` picks the layer shapes (:data:`MODELS`): Llama-3-8B's by default; Llama 4's chunked layers,
gpt-oss's attention sinks, Gemma 2's softcapped scores and DeepSeek-V3's latent attention (keys 192 wide,
values 128, one KV head per query head, as transformers runs it) each with its own heads and option.
SDPA computes neither sinks nor a softcap: for those models the baseline is ``eager``, the model's own
eager attention function from transformers on the float mask (what the decoders run without the
kernel), and the SDPA methods are not timed.
Needs only torch (+ triton for the Triton kernel, nvcc + ninja for the CUDA one).

Two times per method on a GPU. ``<method>`` is the GPU's own time per call: the calls are queued
behind a sleep kernel, so the host has launched them all before the first starts and launch gaps are
not timed (what a CUDA-graph replay of the decoder step pays). ``<method>_call`` is the CUDA-event
median of single calls, launch cost included (what an eager decoder pays per layer). On a CPU both
are wall-clock medians.
"""

from __future__ import annotations

import argparse
import importlib
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
from medusa_train.decoding.attention.sdpa import (  # noqa: E402
    dense_tree_mask,
    packed_gqa_sdpa,
    sdpa_tree_attention,
)
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
    "eager",
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
SDPA_METHODS = ("sdpa_float", "sdpa_bool", "sdpa_repeat", "sdpa_packed")
MODELS = {
    "llama": {"q_heads": 32, "kv_heads": 8, "head_dim": 128},  # Llama-3-8B
    "llama4": {"q_heads": 40, "kv_heads": 8, "head_dim": 128, "chunk": 8192},  # Llama 4's chunked layers
    "gpt-oss": {"q_heads": 64, "kv_heads": 8, "head_dim": 64, "sinks": True},  # gpt-oss-20b
    "gemma2": {"q_heads": 16, "kv_heads": 8, "head_dim": 256, "softcap": 50.0},  # Gemma 2 9B
    # DeepSeek-V3's multi-head latent attention as transformers runs it: the latent decompressed into
    # one key (192: 128 + 64 rotary) and one value (128) per query head
    "deepseek-v3": {"q_heads": 128, "kv_heads": 128, "head_dim": 192, "value_dim": 128},
}
"""Layer shapes of ``--models``: query heads, KV heads, head dim (and the values' where narrower), and the
option the kernel applies (Llama 4's chunk, gpt-oss's sinks, Gemma 2's softcap of its attention scores)."""
EAGER_MODULES = {"gpt-oss": "gpt_oss", "gemma2": "gemma2"}
"""transformers' modeling modules whose ``eager_attention_forward`` is the baseline of a model whose
option SDPA cannot compute."""


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
    """What transformers' attention functions read from a grouped-query attention module (gpt-oss's
    eager attention reads the layer's ``sinks``)."""

    def __init__(self, groups: int, head_dim: int, sinks: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.head_dim = head_dim
        self.is_causal = True
        self.sinks = sinks
        self.eval()


def eager_attention(model: str):
    """transformers' ``eager_attention_forward`` of ``model`` (:data:`EAGER_MODULES`)."""
    name = EAGER_MODULES[model]
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}").eager_attention_forward


def quick_shape(shape: dict) -> dict:
    """``shape`` at the dry run's size: 4 query heads (2 KV heads, or 4 where every query head has its
    own), head dim 16 (values 8 where narrower), a chunk of 16 (the 40-token context crosses two)."""
    small = {**shape, "q_heads": 4, "kv_heads": 4 if shape["kv_heads"] == shape["q_heads"] else 2}
    small["head_dim"] = 16
    if "value_dim" in shape:
        small["value_dim"] = 8
    if "chunk" in shape:
        small["chunk"] = 16
    return small


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
    model: str = "llama",
) -> dict:
    """Every method at one shape; the rows of a batch have different past lengths (the longest ``context``).
    ``shape``: a :data:`MODELS` entry; ``model`` its name."""
    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    dv, chunk, softcap = shape.get("value_dim", d), shape.get("chunk"), shape.get("softcap")
    gen = torch.Generator().manual_seed(context + nodes + batch)
    mask = TreeMask.of(TreeBuffers.from_choices(tree_of(nodes)).to(device))
    m = mask.num_nodes
    width = context + m
    pasts = [context - (b * context) // (4 * batch) for b in range(batch)]  # ragged, longest first
    past = torch.tensor(pasts, dtype=torch.int32, device=device)
    start = torch.zeros(batch, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, m, d, generator=gen).to(device, dtype)  # (B, Hq, M, D)
    k = torch.randn(batch, hkv, width, d, generator=gen).to(device, dtype)  # (B, Hkv, W, D)
    v = torch.randn(batch, hkv, width, dv, generator=gen).to(device, dtype)  # (B, Hkv, W, Dv)
    sinks = torch.randn(hq, generator=gen).to(device, dtype) if shape.get("sinks") else None  # (Hq,)
    options = {"chunk": chunk, "sinks": sinks, "softcap": softcap}
    allowed = dense_tree_mask(past, start, mask.bits, mask.depth, width, chunk=chunk)  # (B, 1, M, W)
    float_mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )
    untuned = default_config((hq // hkv) * m, max(16, triton_next_pow2(d)), dtype, device.type)
    kernel_args = (q, k, v, past, start, mask.bits, mask.depth, d**-0.5)
    layer = GroupedLayer(hq // hkv, d, sinks)
    # Flash without a mask reads every row's keys up to one width: the width that gives it as many keys
    # as the ragged rows have (sum of past + M), so that it stays a lower bound on the same work.
    flash_width = -(-(sum(pasts) + batch * m) // batch)
    k_flash, v_flash = k[:, :, :flash_width], v[:, :, :flash_width]
    k_rep = k.repeat_interleave(hq // hkv, dim=1)  # (B, Hq, W, D), as transformers' repeat_kv
    v_rep = v.repeat_interleave(hq // hkv, dim=1)
    calls = {
        "eager": lambda: eager_attention(model)(
            layer, q, k, v, float_mask, scaling=d**-0.5, dropout=0.0, softcap=softcap
        )[0],
        "sdpa_float": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=float_mask),
        "sdpa_bool": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=allowed),
        "flash_nomask": lambda: F.scaled_dot_product_attention(q, k_flash, v_flash, enable_gqa=True),
        "sdpa_repeat": lambda: sdpa_attention_forward(layer, q, k, v, float_mask, scaling=d**-0.5),
        "sdpa_packed": lambda: packed_gqa_sdpa(q, k, v, float_mask, d**-0.5),
        "triton": lambda: tree_attention(q, k, v, past, start, mask, backend="triton", **options),
        "triton_default": lambda: triton_tree_attention(*kernel_args, config=untuned, **options),
        "cuda": lambda: tree_attention(q, k, v, past, start, mask, backend="cuda", **options),
    }
    # SDPA takes no sinks and no softcap: those models' baseline is their eager attention; the others'
    # is SDPA, and their eager attention (scores of every head written out) is not timed.
    exact_sdpa = sinks is None and softcap is None
    left_out = ("eager",) if exact_sdpa else SDPA_METHODS
    methods = tuple(m for m in methods if m not in left_out)
    ref = sdpa_tree_attention(*kernel_args, **options).float()  # (B, Hq, M, Dv)
    scale = ref.abs().max().item()
    keys = sum(pasts) + batch * m  # every row's past and tree
    row: dict = {
        "model": model,
        "context": context,
        "nodes": m,
        "batch": batch,
        # what a call must move and compute at least: K and V of every key once; every query against
        # every key of its row (the tree's mask spares a little of that): scores over d, outputs over dv
        "kv_bytes": keys * hkv * (d + dv) * k.element_size(),
        "dense_flop": 2 * keys * m * hq * (d + dv),
    }
    for name in methods:
        try:
            if name in KERNELS:
                resolve_attention(
                    name.removesuffix("_default"), device
                )  # a clear reason when it cannot run here
                tuned = set(tuned_configs().items())
                out = calls[name]().float()  # (B, Hq, M, Dv)
                row[f"{name}_err"] = ((out - ref).abs().max().item()) / scale
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
        "| model | context | nodes | batch | eager (float mask) | SDPA + float mask | SDPA + bool mask | "
        "flash, no mask (lower bound) | transformers' SDPA (K/V expanded) | packed SDPA | "
        "triton (tuned config) | triton, default config | cuda | triton vs float mask | triton / flash | "
        "triton, flash: K/V GB/s, TFLOPS | per call with launch: float mask, triton | "
        "max rel. err (triton, cuda) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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

        # the float mask's baseline: SDPA, or the eager attention of a model SDPA cannot compute
        base = "sdpa_float" if "sdpa_float" in r else "eager"
        t, f, nm = r.get("triton"), r.get(base), r.get("flash_nomask")
        speed = f"{f / t:.2f}x" if t and f else "-"
        bound = f"{t / nm:.2f}" if t and nm else "-"
        calls = f"{cell(base + '_call')}, {cell('triton_call')}"
        errs = ", ".join(f"{r[k]:.1e}" if k in r else "-" for k in ("triton_err", "cuda_err"))
        lines.append(
            f"| {r.get('model', 'llama')} | {r['context']} | {r['nodes']} | {r['batch']} | {cell('eager')} | "
            f"{cell('sdpa_float')} | {cell('sdpa_bool')} | "
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
    p.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=["llama"],
        help="layer shapes to time (default: llama; the others default to contexts 2K/8K, 64 nodes)",
    )
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


def grid(model: str, quick: bool) -> tuple[list[int], list[int], list[int]]:
    """Default contexts, tree sizes and batches of ``model``: tiny for a dry run; Llama-3-8B's whole
    grid; for the others the contexts where the kernel is meant to pay (2K, 8K: Llama 4's chunk)."""
    if quick:
        return [40], [8], [1, 2]
    if model == "llama":
        return [512, 2048, 8192, 32768], [16, 64, 256], [1, 8]
    return [2048, 8192], [64], [1, 8]


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    iters, warmup = (2, 1) if args.quick else (10, 3)
    iters = args.iters or iters
    dtype = getattr(torch, args.dtype)
    rows = []
    for model in args.models:
        shape = quick_shape(MODELS[model]) if args.quick else MODELS[model]
        contexts, nodes, batches = grid(model, args.quick)
        contexts, nodes, batches = args.contexts or contexts, args.nodes or nodes, args.batches or batches
        for batch in batches:
            for context in contexts:
                for n in nodes:
                    case = {"model": model, "context": context, "nodes": n, "batch": batch}
                    try:
                        rows.append(
                            bench_case(
                                context,
                                n,
                                batch,
                                shape,
                                device,
                                dtype,
                                warmup,
                                iters,
                                tuple(args.methods),
                                model,
                            )
                        )
                    except Exception as err:  # noqa: BLE001 - e.g. out of memory: report and go on
                        rows.append({**case, "case_error": repr(err)[:300]})
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
                f"case model={r['model']} context={r['context']} nodes={r['nodes']} batch={r['batch']} "
                f"failed: {r['case_error']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
