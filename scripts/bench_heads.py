"""Memory and time of the three head projection variants (own | shared | truncated) at Llama-3 scale.

Random weights, Llama-3 8B shape by default (V = 128,256, d = 4,096, K = 4 heads, 1 block each). For
each variant, in a fresh subprocess (so peak memory is that variant's alone):

1. heads' parameter memory: the tensors stored with the heads (blocks, own projections, token map);
   a shared head's lm_head is the backbone's and is not counted;
2. training peak of the heads' loss: peak RSS of one forward + backward of
   ``training.losses.medusa_head_loss`` (chunked fused CE, no metrics) on ``--rows`` rows, minus the
   RSS right before it (heads, backbone lm_head and inputs already allocated), on CPU;
3. one decoding step's head computation: ``PackedHeads.logits`` on one hidden state + top-10 of every
   head (what the tree decoder runs per step), median of ``--repeats`` after 2 warm-ups.

Run as:
    python scripts/bench_heads.py                                   # bf16, markdown table
    python scripts/bench_heads.py --dtype float32 --json            # JSON on the last line
    python scripts/bench_heads.py --vocab 32000 --draft 8000 --variants own,truncated
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(args: argparse.Namespace, variant: str) -> dict:
    """One variant's figures (runs in its own process)."""
    from medusa_train.decoding import PackedHeads
    from medusa_train.heads import IGNORE_INDEX, MedusaHeads
    from medusa_train.training.losses import medusa_head_loss

    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    torch.set_default_dtype(dtype)  # build every weight in the target dtype (no fp32 transient)
    v, d, k = args.vocab, args.hidden, args.heads
    lm_head = torch.nn.Linear(d, v, bias=False)  # the backbone's output embedding
    token_map = torch.randperm(v)[: args.draft].sort().values if variant == "truncated" else None
    heads = MedusaHeads(d, v, k, args.layers, head_projection=variant, token_map=token_map)
    if variant == "shared":
        heads.bind_lm_head(lm_head)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, 0.02)
    stored = sum(t.numel() * t.element_size() for t in heads.state_tensors().values())

    # 2. Training peak of the heads' loss (forward + backward), chunked.
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.rows, d, generator=gen).to(dtype)  # (N, d)
    targets = torch.randint(0, v, (args.rows, k), generator=gen)  # (N, K) full-vocabulary ids
    targets[torch.rand(args.rows, k, generator=gen) < 0.1] = IGNORE_INDEX
    gc.collect()
    before = _current_rss_bytes()
    t0 = time.perf_counter()
    out = medusa_head_loss(heads, hidden, targets, chunk_size=args.chunk, with_metrics=False)
    out.loss.backward()
    train_s = time.perf_counter() - t0
    peak = _rss_peak_bytes() - before
    for p in heads.parameters():
        p.grad = None
    del out
    gc.collect()

    # 3. One decoding step's head computation: packed logits + top-10 of each head.
    heads.eval()
    packed = PackedHeads(heads)
    del heads
    gc.collect()
    h = torch.randn(d, generator=gen).to(dtype)
    times = []
    with torch.inference_mode():
        for r in range(2 + args.repeats):
            t0 = time.perf_counter()
            packed.logits(h).topk(10, dim=-1)
            if r >= 2:
                times.append(time.perf_counter() - t0)
    read = {"own": k * v * d, "shared": v * d, "truncated": k * args.draft * d}[variant]
    return {
        "variant": variant,
        "draft_vocab": args.draft if variant == "truncated" else v,
        "param_bytes": stored,
        "train_peak_bytes": peak,
        "train_loss_s": train_s,
        "step_s": statistics.median(times),
        "step_projection_bytes_read": read * torch.finfo(dtype).bits // 8,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--draft", type=int, default=32_768, help="truncated: draft vocabulary size N")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--rows", type=int, default=256, help="trained positions in the loss")
    parser.add_argument("--chunk", type=int, default=256, help="rows per chunk of the fused CE")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--variants", default="own,shared,truncated")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one variant in this process
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure(args, args.one)))
        return
    rows = []
    for variant in args.variants.split(","):
        argv = [a for a in sys.argv[1:] if a != "--json"]
        proc = subprocess.run(
            [sys.executable, __file__, *argv, "--one", variant], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            sys.exit(f"{variant}: {proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    own = next((r for r in rows if r["variant"] == "own"), None)
    gib = 2**30
    print(
        f"V={args.vocab} d={args.hidden} K={args.heads} L={args.layers} {args.dtype}, loss on {args.rows} rows "
        f"(chunk {args.chunk}), torch {torch.__version__}, {torch.get_num_threads()} threads\n"
    )
    print(
        "| variant | draft vocab | heads' params | vs own | loss peak (fwd+bwd) | vs own | loss s | step: heads + top-10 | vs own |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:

        def rel(key: str, r: dict = r) -> str:
            return f"{100 * r[key] / own[key]:.1f}%" if own else "-"

        print(
            f"| {r['variant']} | {r['draft_vocab']:,} | {r['param_bytes'] / gib:.3f} GiB | {rel('param_bytes')} | "
            f"{r['train_peak_bytes'] / gib:.2f} GiB | {rel('train_peak_bytes')} | {r['train_loss_s']:.1f} | "
            f"{1e3 * r['step_s']:.1f} ms | {rel('step_s')} |"
        )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
