"""Time of warping one step's logits for sampling: ours against transformers' warpers.

A sampled tree step warps every node's logits (temperature, top-k, top-p) and draws a token per node
(``StaticDecoder(acceptance="sample")``: ``draw_tokens``; the eager decoders: ``warp_probs`` then a
draw). At Llama-3's vocabulary that is ``nodes x rows`` distributions of 128,256 scores per step. For each
setting this times, on random logits of ``(--rows, --vocab)`` (standard normal times the setting's
spread: 4 concentrates the mass on a few scores, 0.5 spreads it over most of the vocabulary):

- ``transformers``: ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` and a
  softmax, what plain ``generate(do_sample=True)`` runs on one row per token (its top-p sorts the
  vocabulary);
- ``warp_probs``: ours, as the eager decoders call it (its top-p ranks only the top-k's scores when a
  top-k is set, else the highest 64 to 1,024 scores where they hold the nucleus), checked equal to the
  above but in rows where a token's mass ahead is top-p to within float32 rounding (one keeps it, the
  other not; counted in the JSON);
- ``sorted``: ``warp_probs(host_sync=False)``, as the captured step calls it (top-p without a top-k
  sorts the vocabulary), checked bit for bit equal to ``warp_probs``;
- ``draw_tokens``: that and the exponential race of the static step.

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

SETTINGS = [  # (spread, temperature, top_p, top_k)
    (4.0, 0.6, 0.9, 50),  # Llama-3-Instruct's generation config with generate's default top-k
    (4.0, 0.6, 0.9, 0),  # top-p alone: the highest scores hold the nucleus
    (0.5, 0.6, 0.9, 0),  # top-p alone, mass spread out: the vocabulary is sorted after one round
    (4.0, 1.0, 1.0, 50),  # top-k alone
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


def rows_apart_at_the_edge(ours: torch.Tensor, theirs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``(N,)`` the rows where one of the two keeps tokens the other drops, all tied at the lowest score
    kept: where the mass ahead of them is top-p to within the rounding of float32 sums, which transformers
    adds in increasing order and ours in decreasing. Any other difference fails."""
    apart = (ours > 0) != (theirs > 0)  # (N, V)
    edge = apart.any(dim=-1)  # (N,)
    for row in edge.nonzero().flatten().tolist():
        kept = logits[row][(ours[row] > 0) | (theirs[row] > 0)]
        assert (logits[row][apart[row]] == kept.min()).all(), f"row {row} differs inside the nucleus"
    return edge


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
        "| rows | spread | temperature | top-p | top-k | transformers ms | warp_probs ms | sorted ms "
        "| draw_tokens ms | speed-up on transformers | on sorted |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        noise = torch.randn(rows, args.vocab, device=device)
        for spread, temperature, top_p, top_k in SETTINGS:
            logits = noise * spread
            theirs = transformers_probs(logits, temperature, top_p, top_k)
            ours = warp_probs(logits, temperature, top_p, top_k)
            edge = rows_apart_at_the_edge(ours, theirs, logits)
            torch.testing.assert_close(ours[~edge], theirs[~edge])
            assert torch.equal(ours, warp_probs(logits, temperature, top_p, top_k, host_sync=False))
            fns = {
                "transformers": functools.partial(transformers_probs, logits, temperature, top_p, top_k),
                "warp_probs": functools.partial(warp_probs, logits, temperature, top_p, top_k),
                "sorted": functools.partial(warp_probs, logits, temperature, top_p, top_k, host_sync=False),
                "draw_tokens": functools.partial(
                    draw_tokens, logits, temperature=temperature, top_p=top_p, top_k=top_k
                ),
            }
            ms = {name: median_ms(fn, device, args.repeats) for name, fn in fns.items()}
            row = {"rows": rows, "spread": spread, "temperature": temperature, "top_p": top_p, "top_k": top_k}
            results.append(row | {"ms": ms, "rows_apart_at_the_edge": int(edge.sum())})
            print(
                f"| {rows} | {spread} | {temperature} | {top_p} | {top_k} | {ms['transformers']:.2f} "
                f"| {ms['warp_probs']:.2f} | {ms['sorted']:.2f} | {ms['draw_tokens']:.2f} "
                f"| {ms['transformers'] / ms['warp_probs']:.2f}x | {ms['sorted'] / ms['warp_probs']:.2f}x |"
            )
    if args.json:
        args.json.write_text(
            json.dumps({"device": str(device), "vocab": args.vocab, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
