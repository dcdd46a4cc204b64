"""Time of warping one step's logits for sampling: ours against transformers' warpers.

A sampled tree step warps every node's logits (temperature, top-k, top-p) and draws a token per node
(``StaticDecoder(acceptance="sample")``: ``draw_tokens``; the eager decoders: ``warp_probs`` then a
draw). At Llama-3's vocabulary that is ``nodes x rows`` distributions of 128,256 scores per step. For each
setting this times, on random logits of ``(--rows, --vocab)``:

- ``transformers``: ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` and a
  softmax, what plain ``generate(do_sample=True)`` runs on one row per token (its top-p sorts the
  vocabulary);
- ``warp_probs``: ours (its top-p ranks only the top-k's scores when a top-k is set), checked equal to
  the above;
- ``draw_tokens``: ``warp_probs`` and the exponential race of the static step.

Median of ``--repeats`` after one warm-up call; on CUDA each call is synchronised.

Run as:
    python scripts/bench_sampling.py                              # CPU, 64 rows of 128,256
    python scripts/bench_sampling.py --device cuda --rows 64 1024 --json sampling.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SETTINGS = [  # (temperature, top_p, top_k)
    (0.6, 0.9, 50),  # Llama-3-Instruct's generation config with generate's default top-k
    (0.6, 0.9, 0),  # top-p alone
    (1.0, 1.0, 50),  # top-k alone
]


def transformers_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = TemperatureLogitsWarper(temperature)(None, logits.float())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)


def median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[64], help="distributions per call (nodes x rows)"
    )
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    from medusa_train.decoding.acceptance import warp_probs
    from medusa_train.decoding.static import draw_tokens

    device = torch.device(args.device)
    torch.manual_seed(0)
    results = []
    print(
        "| rows | temperature | top-p | top-k | transformers ms | warp_probs ms | draw_tokens ms | speed-up |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, device=device) * 4
        for temperature, top_p, top_k in SETTINGS:
            theirs = transformers_probs(logits, temperature, top_p, top_k)
            ours = warp_probs(logits, temperature, top_p, top_k)
            torch.testing.assert_close(ours, theirs)
            fns = {
                "transformers": functools.partial(transformers_probs, logits, temperature, top_p, top_k),
                "warp_probs": functools.partial(warp_probs, logits, temperature, top_p, top_k),
                "draw_tokens": functools.partial(
                    draw_tokens, logits, temperature=temperature, top_p=top_p, top_k=top_k
                ),
            }
            ms = {name: median_ms(fn, device, args.repeats) for name, fn in fns.items()}
            row = {"rows": rows, "temperature": temperature, "top_p": top_p, "top_k": top_k, "ms": ms}
            results.append(row)
            print(
                f"| {rows} | {temperature} | {top_p} | {top_k} | {ms['transformers']:.2f} | {ms['warp_probs']:.2f} "
                f"| {ms['draw_tokens']:.2f} | {ms['transformers'] / ms['warp_probs']:.2f}x |"
            )
    if args.json:
        args.json.write_text(
            json.dumps({"device": str(device), "vocab": args.vocab, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
