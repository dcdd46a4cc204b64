"""Tokens/s of distillation's generation (continuous batching) at batch 16 vs batch 1.

Run as:
    python scripts/bench_distill.py                         # the embedded backbone in runs/default/pretrain
    python scripts/bench_distill.py path/to/model --batch-sizes 1 4 16 --prompts 128 --max-new-tokens 256 --json

The same prompts (first turns of the embedded eval split, rendered with the model's chat template)
are generated greedily at each batch size by :class:`medusa_train.engines.inprocess.ContinuousBatcher`,
exactly what ``stage=distill`` runs, after one warm-up pass. tokens/s counts generated tokens (up to
and including each reply's EOS) over wall time; "rows/step" is the mean number of rows per decode
step (how full continuous batching keeps the batch). Each batch size runs ``--repeats`` times,
interleaved with the others, and the median time is reported (this shared VM's speed drifts by up
to 1.5x within minutes). The greedy replies at every batch size are compared with those at the
first one. Target on 2 CPU cores with the embedded backbone: batch 16
>= 8x batch 1.

``--step-contexts 16 128`` also measures the ceiling that bounds the ratio: the cost of one decode
step with every row busy, no prefill and no finished rows (each batch size runs ``batch`` requests of
the given context length for ``--step-tokens`` tokens, minus the same run for one token), so that
``batch x step(1) / step(batch)`` is the best tokens/s ratio continuous batching could reach.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from medusa_train.backbone import load_backbone
from medusa_train.data.chat import ChatRenderer, eos_token_ids
from medusa_train.data.embedded import embedded_prompts
from medusa_train.data.sources import Conversation
from medusa_train.engines.base import GenRequest
from medusa_train.engines.inprocess import ContinuousBatcher


def step_ceiling(model, pad_id: int, batch_sizes: list[int], context: int, tokens: int, repeats: int) -> dict:
    """Milliseconds per decode step with every row busy, by batch size, and the implied ceiling ratio.

    ``batch`` identical-length requests (distinct token ids per row) never stop before ``tokens``:
    one prefill plus ``tokens - 1`` full-batch decode steps. The same run with one token (the prefill
    alone) is subtracted. Medians of ``repeats`` interleaved runs.
    """
    vocab = model.get_output_embeddings().weight.shape[0]

    def run(batch: int, new_tokens: int) -> float:
        requests = [
            GenRequest(i, [3 + (i * 131 + j * 7) % (vocab - 3) for j in range(context)]) for i in range(batch)
        ]
        batcher = ContinuousBatcher(
            model, batch_size=batch, pad_id=pad_id, eos_ids=[], max_new_tokens=new_tokens
        )
        start = time.perf_counter()
        batcher.run(requests, lambda req, new: None)
        return time.perf_counter() - start

    run(max(batch_sizes), 4)  # warm-up
    full: dict[int, list[float]] = {b: [] for b in batch_sizes}
    prefill: dict[int, list[float]] = {b: [] for b in batch_sizes}
    for _ in range(repeats):
        for b in batch_sizes:
            full[b].append(run(b, tokens))
            prefill[b].append(run(b, 1))
    step_ms = {
        b: 1e3 * (statistics.median(full[b]) - statistics.median(prefill[b])) / (tokens - 1)
        for b in batch_sizes
    }
    first = batch_sizes[0]
    return {
        "context": context,
        "step_ms": {b: round(ms, 3) for b, ms in step_ms.items()},
        "ceiling_vs_first": {b: round(b / first * step_ms[first] / ms, 2) for b, ms in step_ms.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="runs/default/pretrain", help="HF model dir or hub id")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts", type=int, default=128, help="prompts generated at each batch size")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="cap per reply (distill's default)")
    parser.add_argument(
        "--refill-min", type=int, default=None, help="free slots before rows join (default B/4)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed passes per batch size, interleaved; the median is reported",
    )
    parser.add_argument(
        "--step-contexts",
        type=int,
        nargs="*",
        default=[],
        help="also time full-batch decode steps at these context lengths (the ratio's ceiling)",
    )
    parser.add_argument("--step-tokens", type=int, default=129, help="tokens per row when timing steps")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    model, tok = load_backbone(args.model, dtype=args.dtype, device=args.device)
    renderer = ChatRenderer(tok)
    eos = eos_token_ids(model, tok)
    convs = embedded_prompts("eval", args.prompts, seed=0)
    prompts = [
        renderer.prompt_ids(Conversation(f"embedded:{i}", [c[0]["content"]])) for i, c in enumerate(convs)
    ]

    def generate(batch_size: int, requests: list[list[int]]) -> tuple[dict[int, list[int]], dict]:
        replies: dict[int, list[int]] = {}
        batcher = ContinuousBatcher(
            model,
            batch_size=batch_size,
            pad_id=tok.pad_token_id,
            eos_ids=eos,
            max_new_tokens=args.max_new_tokens,
            refill_min=args.refill_min,
        )
        batcher.run(
            [GenRequest(i, p) for i, p in enumerate(requests)],
            lambda req, new: replies.__setitem__(req.key, new),
        )
        return replies, batcher.stats

    generate(max(args.batch_sizes), prompts[: 2 * max(args.batch_sizes)])  # warm-up
    timings: dict[int, list[float]] = {bs: [] for bs in args.batch_sizes}
    results: dict[int, tuple[dict, dict]] = {}
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every size alike
        for bs in args.batch_sizes:
            start = time.perf_counter()
            results[bs] = generate(bs, prompts)
            timings[bs].append(time.perf_counter() - start)
    rows, reference = [], results[args.batch_sizes[0]][0]
    for bs in args.batch_sizes:
        replies, stats = results[bs]
        seconds = statistics.median(timings[bs])
        tokens = sum(len(r) for r in replies.values())
        rows.append(
            {
                "batch_size": bs,
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "seconds_all": [round(t, 3) for t in timings[bs]],
                "tokens_per_s": round(tokens / seconds, 1),
                "rows_per_step": round(stats["row_steps"] / max(stats["decode_steps"], 1), 2),
                "prefills": stats["prefills"],
                "replies_equal_first": sum(replies[k] == reference[k] for k in reference),
            }
        )
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup_vs_first"] = round(row["tokens_per_s"] / base, 2)
    ceilings = [
        step_ceiling(model, tok.pad_token_id, args.batch_sizes, c, args.step_tokens, args.repeats)
        for c in args.step_contexts
    ]
    result = {
        "model": args.model,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "rows": rows,
        "step_ceiling": ceilings,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{args.model} on {args.device} ({result['threads']} threads), {len(prompts)} prompts, "
        f"max_new_tokens={args.max_new_tokens}"
    )
    print(
        f"{'batch':>6} {'tokens':>8} {'seconds':>9} {'tokens/s':>10} {'rows/step':>10} {'same':>6} {'speed-up':>9}"
    )
    for r in rows:
        print(
            f"{r['batch_size']:>6} {r['tokens']:>8} {r['seconds']:>9.2f} {r['tokens_per_s']:>10.1f} "
            f"{r['rows_per_step']:>10.2f} {r['replies_equal_first']:>6} {r['speedup_vs_first']:>8.2f}x"
        )
    for c in ceilings:
        steps = ", ".join(
            f"batch {b}: {ms:.2f} ms ({c['ceiling_vs_first'][b]:.2f}x)" for b, ms in c["step_ms"].items()
        )
        print(f"full-batch decode step, context {c['context']}: {steps}")


if __name__ == "__main__":
    main()
