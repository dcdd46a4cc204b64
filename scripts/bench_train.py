"""Benchmark the Medusa heads' loss (forward + backward): chunked fused CE vs naive full logits, and
the soft-label losses (``training.head_loss=kl|tv``, chunked over rows and vocabulary) vs the same.

Variants (``--variants``): ``naive`` (full logits + ``F.cross_entropy``), ``chunked`` (the fused CE
training uses), ``naive_kl`` (full head and target logits, softmax, KL), ``kl`` and ``tv`` (the fused
soft losses, ``--vocab-chunk`` vocabulary entries per chunk; the target is the distribution of a
random ``(V, d)`` lm_head at random hidden states, which are allocated before the measurement).

Each (variant, vocab) runs in a fresh subprocess; peak memory is that process's peak RSS minus its
RSS right before the loss (inputs, heads and nothing else allocated) on CPU, or
``torch.cuda.max_memory_allocated`` minus the allocation before the loss on GPU. The heads'
parameter gradients (K x V x d) are part of both variants' peak.

``--cache`` also times one Medusa-1 epoch online (backbone forward + heads) against one epoch from
the hidden-state cache (heads only) on a random Llama of the embedded backbone's size.

Run as:
    python scripts/bench_train.py                          # markdown table, CPU
    python scripts/bench_train.py --json --cache           # + cache epoch ratio, JSON on the last line
    python scripts/bench_train.py --device cuda --tokens 8192 --hidden 4096
    python scripts/bench_train.py --vocab 128256 --variants chunked kl tv naive_kl --hidden 256 --tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> dict:
    """One measurement in this (fresh) process."""
    from medusa_train.heads import MedusaHeads
    from medusa_train.training.losses import HeadLoss, SoftTargets, medusa_head_loss, naive_medusa_head_loss

    torch.manual_seed(0)
    device = torch.device(args.device)
    heads = MedusaHeads(args.hidden, args.vocab, args.heads, 1).to(device)
    hidden = torch.randn(args.tokens, args.hidden, device=device)  # (T, d)
    targets = torch.randint(0, args.vocab, (args.tokens, args.heads), device=device)  # (T, K)
    soft_kind = args.variant.removeprefix("naive_")
    head_loss = HeadLoss.from_spec("ce" if soft_kind in ("naive", "chunked") else soft_kind)
    head_loss = HeadLoss(head_loss.terms, vocab_chunk_size=args.vocab_chunk)
    soft = None
    if (
        head_loss.soft
    ):  # the backbone's hidden states at t+k and its lm_head, allocated before the measurement
        sources = torch.randint(0, args.tokens, (args.tokens, args.heads), device=device)  # (T, K)
        lm_head = torch.randn(args.vocab, args.hidden, device=device) / args.hidden**0.5  # (V, d)
        soft = SoftTargets(torch.randn(args.tokens, args.hidden, device=device), sources, lm_head)

    def step() -> float:
        if args.variant.startswith("naive"):
            loss = naive_medusa_head_loss(heads, hidden, targets, head_loss=head_loss, soft=soft)
        else:
            loss = medusa_head_loss(
                heads,
                hidden,
                targets,
                chunk_size=args.chunk,
                with_metrics=False,
                head_loss=head_loss,
                soft=soft,
            ).loss
        loss.backward()
        return float(loss)

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _current_rss_bytes()
    times, loss = [], 0.0
    for _ in range(args.repeats):
        heads.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_peak_bytes()) - base
    best = min(times)
    return {
        "variant": args.variant,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "heads": args.heads,
        "tokens": args.tokens,
        "chunk": args.chunk,
        "vocab_chunk": args.vocab_chunk if head_loss.soft else None,
        "peak_gib": round(peak / 2**30, 3),
        "seconds": round(best, 3),
        "tokens_per_s": round(args.tokens / best, 1),
        "loss": round(loss, 4),
    }


def cache_epoch_ratio(args: argparse.Namespace) -> dict:
    """Seconds per Medusa-1 epoch online vs from the hidden-state cache (same heads, same batches)."""
    import tempfile

    from transformers import LlamaForCausalLM

    from medusa_train.backbone import frozen
    from medusa_train.heads import MedusaHeads
    from medusa_train.training.hidden_cache import build_hidden_cache
    from medusa_train.training.model import MedusaTrainingModel
    from medusa_train.training.trainer import PadCollator, row_collator
    from tests.helpers.models import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(  # the tests' builder at about the embedded backbone's size; LlamaConfig's token ids
        "llama",
        vocab=2048,
        hidden=256,
        intermediate=688,
        layers=4,
        kv_heads=4,
        max_pos=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    backbone = frozen(LlamaForCausalLM(cfg))
    g = torch.Generator().manual_seed(0)
    records = []
    for _ in range(args.cache_records):
        ids = torch.randint(2, 2048, (args.cache_seq_len,), generator=g).tolist()
        records.append({"input_ids": ids, "loss_mask": [0] * 32 + [1] * (args.cache_seq_len - 32)})
    heads = MedusaHeads(256, 2048, 4, 1)
    heads.init_from_lm_head(backbone.get_output_embeddings().weight)
    bs = 8

    def epoch(model, batches) -> float:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        t0 = time.perf_counter()
        for b in batches:
            model(**b)["loss"].backward()
            opt.step()
            opt.zero_grad()
        return time.perf_counter() - t0

    pad = PadCollator(0)
    online_batches = [pad(records[i : i + bs]) for i in range(0, len(records), bs)]
    online = epoch(MedusaTrainingModel(heads, backbone), online_batches)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        cache = build_hidden_cache(backbone, records, Path(tmp) / "c", 4, {"bench": 1}, batch_size=bs)
        build = time.perf_counter() - t0
        cached_batches = [
            row_collator([cache[j] for j in range(i, min(i + bs, len(cache)))])
            for i in range(0, len(cache), bs)
        ]
        cached = epoch(MedusaTrainingModel(heads, None), cached_batches)
    return {
        "records": len(records),
        "seq_len": args.cache_seq_len,
        "online_epoch_s": round(online, 2),
        "cached_epoch_s": round(cached, 2),
        "cache_build_s": round(build, 2),
        "epoch_speedup": round(online / cached, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024, help="trained positions per step")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--vocab-chunk", type=int, default=32768, help="soft losses: vocabulary entries per chunk")
    p.add_argument(
        "--variants",
        nargs="+",
        default=["naive", "chunked"],
        choices=["naive", "chunked", "naive_kl", "kl", "tv"],
        help="naive is the reference of the 'vs naive' columns (measured too when left out)",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="also print all results as one JSON line")
    p.add_argument("--cache", action="store_true", help="also measure the hidden-state cache epoch ratio")
    p.add_argument("--cache-records", type=int, default=64)
    p.add_argument("--cache-seq-len", type=int, default=256)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        args.variant, args.vocab = args.worker, args.vocab[0]
        print(json.dumps(worker(args)))
        return

    rows = []
    variants = ["naive"] + [v for v in args.variants if v != "naive"]
    for vocab in args.vocab:
        for variant in variants:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                variant,
                "--vocab",
                str(vocab),
                "--hidden",
                str(args.hidden),
                "--heads",
                str(args.heads),
                "--tokens",
                str(args.tokens),
                "--chunk",
                str(args.chunk),
                "--vocab-chunk",
                str(args.vocab_chunk),
                "--repeats",
                str(args.repeats),
                "--device",
                args.device,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:  # one failed case (e.g. out of memory) is reported, the rest still run
                tail = (out.stderr.strip().splitlines() or ["?"])[-1]
                print(f"V={vocab} {variant}: failed ({tail})", file=sys.stderr)
                rows.append({"variant": variant, "vocab": vocab, "failed": tail})
                continue
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"\nheads loss fwd+bwd: K={args.heads} d={args.hidden} T={args.tokens} chunk={args.chunk} "
        f"vocab chunk (soft)={args.vocab_chunk} on {args.device}\n"
    )
    print("| V | variant | peak GiB | peak vs naive CE | s/step | tokens/s | speed vs naive CE |")
    print("|---|---|---|---|---|---|---|")
    for vocab in args.vocab:
        naive = next((r for r in rows if r["vocab"] == vocab and r["variant"] == "naive"), {})
        for r in (r for r in rows if r["vocab"] == vocab):
            if "failed" in r:
                print(f"| {vocab} | {r['variant']} | failed: {r['failed'][:60]} | | | | |")
                continue
            if "peak_gib" in naive:
                r["peak_vs_naive"] = round(r["peak_gib"] / max(naive["peak_gib"], 1e-9), 3)
                r["speed_vs_naive"] = round(r["tokens_per_s"] / naive["tokens_per_s"], 3)
            print(
                f"| {vocab} | {r['variant']} | {r['peak_gib']:.2f} | {r.get('peak_vs_naive', float('nan')):.0%} | "
                f"{r['seconds']:.2f} | {r['tokens_per_s']:.0f} | {r.get('speed_vs_naive', float('nan')):.2f}x |"
            )
    result: dict = {"loss": rows}
    if args.cache:
        c = cache_epoch_ratio(args)
        result["cache"] = c
        print(
            f"\nhidden-state cache ({c['records']} records x {c['seq_len']} tokens, 4-layer d=256 Llama): "
            f"online epoch {c['online_epoch_s']} s, cached epoch {c['cached_epoch_s']} s "
            f"({c['epoch_speedup']}x), one-off cache build {c['cache_build_s']} s"
        )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
