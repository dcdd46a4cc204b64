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

``--demo NAME=HEADS_DIR,...`` instead compares trained heads of every variant on the embedded demo:
one backbone (``--backbone``), the same held-out embedded prompts and the same tree (``--tree``, a
``medusa_choices.json``) for all; prompt by prompt, plain greedy ``generate`` and every variant run
back to back in a rotating order (a shared, drifting machine skews them alike). Reports tau,
tokens/s, speed-up over plain greedy and greedy parity per variant.

Run as:
    python scripts/bench_heads.py                                   # bf16, markdown table
    python scripts/bench_heads.py --demo own=runs/own/heads,shared=runs/shared/heads \
        --backbone runs/own/pretrain --tree runs/own/heads/medusa_choices.json --prompts 40
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
    from medusa_train.head_targets import IGNORE_INDEX
    from medusa_train.heads import MedusaHeads
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


def demo(args: argparse.Namespace) -> list[dict]:
    """Tau and speed-up of trained heads of every variant, interleaved prompt by prompt."""
    from medusa_train.backbone import load_backbone
    from medusa_train.config import EvalConfig
    from medusa_train.data.chat import ChatRenderer, eos_token_ids
    from medusa_train.decoding import PackedHeads, TreeBuffers, medusa_generate
    from medusa_train.formats import load_heads
    from medusa_train.stages.eval import load_eval_prompts

    model, tok = load_backbone(args.backbone, dtype="float32", device="cpu")
    model.eval()
    eos = eos_token_ids(model, tok)
    tree = TreeBuffers.from_choices(json.loads(Path(args.tree).read_text()))
    variants = {}
    for item in args.demo.split(","):
        name, path = item.split("=", 1)
        variants[name] = PackedHeads(load_heads(path).attach(model).eval())
    renderer = ChatRenderer(tok)
    prompts = load_eval_prompts(EvalConfig(num_prompts=args.prompts))
    names = ["plain", *variants]
    totals = {n: {"tokens": 0, "steps": 0, "seconds": 0.0, "identical": 0} for n in names}

    @torch.inference_mode()
    def decode(name: str, ids: torch.Tensor) -> tuple[list[int], int, float]:
        t0 = time.perf_counter()
        if name == "plain":
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=args.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos[0],
            )
            return out[0, ids.shape[1] :].tolist(), 0, time.perf_counter() - t0
        out = medusa_generate(
            model, variants[name], ids, max_new_tokens=args.max_new_tokens, tree=tree, eos_token_id=eos
        )
        return out.tokens.tolist(), out.num_steps, time.perf_counter() - t0

    first = torch.tensor([renderer.turn_prompt_ids(prompts[0], [])])
    for name in names:  # warm-up, untimed
        decode(name, first)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([renderer.turn_prompt_ids(prompt, [])])  # (1, T)
        order = names[i % len(names) :] + names[: i % len(names)]
        outs = {name: decode(name, ids) for name in order}
        for name, (tokens, steps, seconds) in outs.items():
            totals[name]["tokens"] += len(tokens)
            totals[name]["steps"] += steps
            totals[name]["seconds"] += seconds
            totals[name]["identical"] += tokens == outs["plain"][0]
    base = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    rows = []
    for name in variants:
        t = totals[name]
        tps = t["tokens"] / t["seconds"]
        rows.append(
            {
                "variant": name,
                "tau": t["tokens"] / max(1, t["steps"]),
                "tokens_per_s": tps,
                "tokens_per_s_plain": base,
                "speedup": tps / base,
                "greedy_identical": t["identical"] / len(prompts),
            }
        )
    print(f"{len(prompts)} prompts, tree of {tree.num_nodes - 1} nodes, plain greedy {base:.1f} tokens/s\n")
    print("| variant | tau | tokens/s | speed-up | greedy identical |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['tau']:.3f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
            f"{100 * r['greedy_identical']:.0f}% |"
        )
    return rows


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
    parser.add_argument("--demo", help="NAME=HEADS_DIR,...: compare trained heads on the demo (see above)")
    parser.add_argument("--backbone", help="--demo: the backbone directory")
    parser.add_argument("--tree", help="--demo: medusa_choices.json of the tree every variant uses")
    parser.add_argument("--prompts", type=int, default=40, help="--demo: held-out embedded prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="--demo: tokens per prompt")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one variant in this process
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure(args, args.one)))
        return
    if args.demo:
        rows = demo(args)
        if args.json:
            print(json.dumps(rows))
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
