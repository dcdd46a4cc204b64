"""Tokens/s of batched generation (what stage=distill does) at batch 16 vs batch 1.

Run as:
    python scripts/bench_distill.py                         # the embedded backbone in runs/default/backbone
    python scripts/bench_distill.py path/to/model --batch-sizes 1 4 16 --max-new-tokens 64 --json

The same prompts (first turns of the embedded eval split, rendered with the model's chat template)
are generated greedily at each batch size with left padding and KV cache
(:func:`medusa_train.data.regenerate.generate_batch`), after one warm-up call. tokens/s counts
generated tokens (up to and including each row's EOS) over wall time. Target on 2 CPU cores with
the embedded backbone: batch 16 >= 8x batch 1.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="runs/default/backbone", help="HF model dir or hub id")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--prompts", type=int, default=16, help="prompts per batch size (a multiple of each size)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    from medusa_train.backbone import load_backbone
    from medusa_train.data.embedded import embedded_prompts
    from medusa_train.data.regenerate import ChatRenderer, eos_token_ids, generate_batch
    from medusa_train.data.sources import Conversation

    model, tok = load_backbone(args.model, dtype=args.dtype, device=args.device)
    renderer = ChatRenderer(tok)
    eos = eos_token_ids(model, tok)
    convs = embedded_prompts("eval", args.prompts, seed=0)
    prompts = [
        renderer.prompt_ids(Conversation(f"embedded:{i}", [c[0]["content"]])) for i, c in enumerate(convs)
    ]

    def gen(batch: list[list[int]]) -> int:
        outs = generate_batch(
            model, batch, pad_id=tok.pad_token_id, eos_ids=eos, max_new_tokens=args.max_new_tokens
        )
        return sum(len(o) for o in outs)

    gen(prompts[: max(args.batch_sizes)])  # warm-up
    rows = []
    for bs in args.batch_sizes:
        tokens, start = 0, time.perf_counter()
        for i in range(0, len(prompts), bs):
            tokens += gen(prompts[i : i + bs])
        seconds = time.perf_counter() - start
        rows.append(
            {
                "batch_size": bs,
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1),
            }
        )
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup_vs_first"] = round(row["tokens_per_s"] / base, 2)
    import torch

    result = {
        "model": args.model,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{args.model} on {args.device} ({result['threads']} threads), {len(prompts)} prompts, max_new_tokens={args.max_new_tokens}"
    )
    print(f"{'batch':>6} {'tokens':>8} {'seconds':>9} {'tokens/s':>10} {'speed-up':>9}")
    for r in rows:
        print(
            f"{r['batch_size']:>6} {r['tokens']:>8} {r['seconds']:>9.2f} {r['tokens_per_s']:>10.1f} {r['speedup_vs_first']:>8.2f}x"
        )


if __name__ == "__main__":
    main()
