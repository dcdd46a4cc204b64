"""Which head loss? Medusa-1 heads trained with each ``training.head_loss`` on the same backbone, data,
steps and tree, measured by greedy, typical and exact-sampling tau.

The figures and the choice of ``training.head_loss`` in docs/training.md ("Which head loss?") come
from this script. Everything but ``training.head_loss`` and ``training.seed`` is the same across the
runs of one base (``conf/training/medusa1.yaml`` plus ``--extra``), so a difference in tau is the loss.

Run as:
    # 1. one base workdir per backbone, each with the backbone (pretrain/) and distilled data (distill/):
    python -m medusa_train stage=distill workdir=runs/demo tracking=disabled        # after stage=pretrain
    python -m medusa_train stage=pretrain workdir=runs/shakespeare data=text \\
        data.path=../shared/data/tinyshakespeare.txt tracking=disabled
    python -m medusa_train stage=distill workdir=runs/shakespeare data=text \\
        data.path=../shared/data/tinyshakespeare.txt tracking=disabled
    # 2. the full table: 4 losses x 3 seeds per backbone (each run trains in its own workdir under --out):
    python scripts/sweep_head_loss.py run --base runs/demo --out runs/head_loss/demo
    python scripts/sweep_head_loss.py run --base runs/shakespeare --out runs/head_loss/shakespeare
    python scripts/sweep_head_loss.py report --out runs/head_loss/demo runs/head_loss/shakespeare
    # a quick look (1 seed, ce / kl / tv, 60 optimizer steps, 12 prompts x 64 tokens):
    python scripts/sweep_head_loss.py run --base runs/demo --out runs/head_loss/quick --quick

Each run gets ``<out>/<loss>-s<seed>/`` with copies of the base's ``pretrain/`` and ``distill/``
(``cp -a``), trains there with ``python -m medusa_train stage=train training.head_loss=<loss>
training.seed=<seed> <extra>`` (a subprocess, ``nice``, ``OMP_NUM_THREADS``), and is then measured in
this process on the first ``--num-prompts`` held-out distilled records (the prompt: every token before
the first trained one; at most ``--max-new-tokens`` new tokens), on the 63-node tree for every run:

- ``tau_greedy``: tokens per verification step with greedy acceptance (a function of the weights);
- ``tau_typical_0.7``: Medusa's typical acceptance at T=0.7 (epsilon 0.09, alpha 0.3);
- ``tau_sample_0.7`` / ``tau_sample_1.0``: exact sampling at T=0.7 / 1.0, the same seeded generator
  for every run, so the runs of one base see the same random numbers;
- ``heldout_top1``: the calibration's held-out top-1 per head.

``ceiling`` bounds what any heads could reach on a base with the same prompts, budget and tree: it
samples each prompt's reply from the backbone (ancestral sampling at T; greedy at T=0), takes the
rank of every emitted token under the backbone's own distribution given its prefix, and replays
the tree walk of exact sampling with oracle heads whose children at every node are the backbone's
top-ranked tokens given that node's path (a node is entered iff the drawn token's rank is one of its
children's ranks). Exact sampling emits the backbone's ancestral samples whatever the heads, so this
is the expected tau of oracle heads (Monte Carlo over ``--samples`` replies per prompt); no head
trained on ``h_t`` alone, which cannot see the drawn path, gets above it:

    python scripts/sweep_head_loss.py ceiling --base runs/demo --num-prompts 20 --max-new-tokens 64

A failed run is recorded (``failed`` in its result.json) and the others still run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medusa_train.backbone import load_backbone  # noqa: E402
from medusa_train.data.chat import eos_token_ids  # noqa: E402
from medusa_train.data.distilled import load_distilled, split_heldout  # noqa: E402
from medusa_train.decoding import MEDUSA_63, PackedHeads, TreeBuffers, medusa_generate  # noqa: E402
from medusa_train.heads import MedusaHeads  # noqa: E402
from medusa_train.hf_compat import cache_kwargs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOSSES = ["ce", "kl", "tv", "kl+0.5ce"]
SEEDS = [0, 1, 2]
QUICK = {
    "losses": ["ce", "kl", "tv"],
    "seeds": [0],
    "extra": ["training.max_steps=60", "training.calibration_max_records=20", "tree.max_nodes=16"],
    "num_prompts": 12,
    "max_new_tokens": 64,
}
RULES = [("greedy", 0.0), ("typical", 0.7), ("sample", 0.7), ("sample", 1.0)]


def rule_key(acceptance: str, temperature: float) -> str:
    return "tau_greedy" if acceptance == "greedy" else f"tau_{acceptance}_{temperature:.1f}"


# -- measurement ----------------------------------------------------------------------------------
def heldout_prompts(distill_dir: Path, num_prompts: int, eval_fraction: float) -> list[torch.Tensor]:
    """The prompts of the first ``num_prompts`` held-out distilled records: tokens before the first trained one."""
    _, held = split_heldout(load_distilled(distill_dir), eval_fraction)
    prompts = []
    for r in held:
        first = next((i for i, m in enumerate(r["loss_mask"]) if m), None)
        if first:
            prompts.append(torch.tensor([r["input_ids"][:first]]))  # (1, T)
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise SystemExit(
            f"no held-out record with a prompt in {distill_dir} (data.eval_fraction={eval_fraction})"
        )
    return prompts


@torch.inference_mode()
def measure(wd: Path, prompts: list[torch.Tensor], max_new_tokens: int) -> dict:
    """Tau of every rule in :data:`RULES` of the heads in ``wd/heads`` on the 63-node tree."""
    model, tok = load_backbone(str(wd / "pretrain"))
    heads = MedusaHeads.from_pretrained(wd / "heads").eval()
    heads.attach(model)
    packed = PackedHeads(heads)
    depth = heads.num_heads
    tree = TreeBuffers.from_choices([list(p) for p in MEDUSA_63 if len(p) <= depth])
    eos = eos_token_ids(model, tok)
    result = {}
    for acceptance, temperature in RULES:
        gen = torch.Generator().manual_seed(1234)
        tokens = steps = 0
        for ids in prompts:
            budget = min(max_new_tokens, model.config.max_position_embeddings - ids.shape[1])
            out = medusa_generate(
                model,
                packed,
                ids,
                max_new_tokens=budget,
                tree=tree,
                acceptance=acceptance,
                temperature=temperature if acceptance != "greedy" else 1.0,
                eos_token_id=eos,
                generator=gen,
            )
            tokens += len(out.tokens)
            steps += len(out.accepted_lengths)
        result[rule_key(acceptance, temperature)] = round(tokens / max(steps, 1), 4)
    return result


# -- ceiling ----------------------------------------------------------------------------------------
@torch.inference_mode()
def sample_ranks(model, ids: torch.Tensor, budget: int, temperature: float, eos: set[int], gen) -> list[int]:
    """Ranks (0 = the argmax) of an ancestral sample's tokens under the backbone, EOS included."""
    from transformers import DynamicCache

    cache = DynamicCache()
    logits = model(input_ids=ids, **cache_kwargs(model, cache)).logits[0, -1]  # (V,)
    ranks = []
    for _ in range(budget):
        if temperature > 0:
            tok = int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen))
        else:
            tok = int(logits.argmax())
        ranks.append(int((logits > logits[tok]).sum()))
        if tok in eos:
            break
        logits = model(input_ids=torch.tensor([[tok]]), **cache_kwargs(model, cache)).logits[0, -1]  # (V,)
    return ranks


def replay_tau(ranks: list[int], paths: set[tuple[int, ...]], depth: int, budget: int) -> tuple[int, int]:
    """(tokens, steps) of the tree walk of oracle heads over one reply's ranks (see ``ceiling``)."""
    n, pos, steps = len(ranks), 0, 0
    while pos < n:
        room = min(budget - pos - 1, n - pos - 1, depth)  # nodes that could still be emitted
        accepted = 0
        while accepted < room and tuple(ranks[pos + 1 : pos + 2 + accepted]) in paths:
            accepted += 1
        pos += 1 + accepted
        steps += 1
    return n, steps


def cmd_ceiling(args) -> None:
    torch.set_num_threads(args.threads)
    base = Path(args.base).resolve()
    prompts = heldout_prompts(base / "distill", args.num_prompts, args.eval_fraction)
    model, tok = load_backbone(str(base / "pretrain"))
    model.eval()
    eos = set(eos_token_ids(model, tok))
    paths = {tuple(p) for p in MEDUSA_63 if len(p) <= args.depth}
    result = {"base": str(base), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    for temperature in args.temperatures:
        gen = torch.Generator().manual_seed(1234)
        tokens = steps = 0
        for ids in prompts:
            budget = min(args.max_new_tokens, model.config.max_position_embeddings - ids.shape[1])
            for _ in range(args.samples if temperature > 0 else 1):
                t, s = replay_tau(
                    sample_ranks(model, ids, budget, temperature, eos, gen), paths, args.depth, budget
                )
                tokens, steps = tokens + t, steps + s
        name = "tau_greedy" if temperature == 0 else f"tau_sample_{temperature:.1f}"
        result[name] = round(tokens / max(steps, 1), 4)
    print(json.dumps(result), flush=True)


# -- running --------------------------------------------------------------------------------------
def prepare(base: Path, wd: Path) -> None:
    """``wd`` with copies of the base's backbone (``pretrain/``) and distilled data (``cp -a``)."""
    wd.mkdir(parents=True, exist_ok=True)
    for name in ("pretrain", "distill"):
        if not (wd / name).exists():
            subprocess.run(["cp", "-a", str(base / name), str(wd / name)], check=True)


def train(wd: Path, loss: str, seed: int, extra: list[str], threads: int, nice: int) -> dict:
    """``stage=train`` with ``training.head_loss=loss``; returns its training_result."""
    for stale in ("heads", "train"):
        shutil.rmtree(wd / stale, ignore_errors=True)
    cmd = [
        "nice",
        "-n",
        str(nice),
        sys.executable,
        "-m",
        "medusa_train",
        "stage=train",
        f"workdir={wd}",
        "tracking=disabled",
        f"training.head_loss={loss}",
        f"training.seed={seed}",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(wd / "train.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads((wd / "heads" / "config.json").read_text())["training_result"]


def cmd_run(args) -> None:
    base, out = Path(args.base).resolve(), Path(args.out).resolve()
    losses, seeds = args.losses or LOSSES, args.seeds or SEEDS
    extra, num_prompts, max_new = list(args.extra), args.num_prompts, args.max_new_tokens
    if args.quick:
        losses, seeds = args.losses or QUICK["losses"], args.seeds or QUICK["seeds"]
        extra = QUICK["extra"] + extra
        num_prompts, max_new = QUICK["num_prompts"], QUICK["max_new_tokens"]
    torch.set_num_threads(args.threads)
    prompts = heldout_prompts(base / "distill", num_prompts, args.eval_fraction)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(
        json.dumps({"base": str(base), "extra": extra, "prompts": len(prompts), "max_new_tokens": max_new})
        + "\n"
    )
    for seed in seeds:
        for loss in losses:
            wd = out / f"{loss}-s{seed}"
            if (wd / "result.json").is_file() and not args.force:
                print(f"{wd.name}: done already", flush=True)
                continue
            t0 = time.time()
            result: dict = {"loss": loss, "seed": seed, "overrides": extra}
            try:
                prepare(base, wd)
                trained = train(wd, loss, seed, extra, args.threads, args.nice)
                result.update(
                    steps=trained["steps"],
                    final_loss=trained["final_loss"],
                    heldout_top1=trained.get("heldout_top1"),
                    train_seconds=trained.get("train_seconds"),
                )
                result.update(measure(wd, prompts, max_new))
            except Exception as err:  # one failed run is reported, the others still run
                result["failed"] = (
                    f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                )
            result["seconds"] = round(time.time() - t0, 1)
            (wd / "result.json").write_text(json.dumps(result, indent=1) + "\n")
            print(json.dumps(result), flush=True)


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.2f}"
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return f"{mean:.2f} ± {sd:.2f}"


def cmd_report(args) -> None:
    keys = [rule_key(a, t) for a, t in RULES]
    print(
        "| base | head_loss | seeds | greedy tau | typical tau T=0.7 | sampling tau T=0.7 | sampling tau T=1.0 | "
        "held-out top-1 (heads 1..K) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for folder in map(Path, args.out):
        results = [json.loads(p.read_text()) for p in sorted(folder.glob("*/result.json"))]
        for loss in dict.fromkeys(r["loss"] for r in results):
            runs = [r for r in results if r["loss"] == loss and "failed" not in r]
            failed = sum(1 for r in results if r["loss"] == loss and "failed" in r)
            top1 = [r["heldout_top1"] for r in runs if r.get("heldout_top1")]
            mean_top1 = [sum(col) / len(col) for col in zip(*top1, strict=True)] if top1 else []
            cells = [_mean_sd([r[k] for r in runs if k in r]) for k in keys]
            print(
                f"| {folder.name} | {loss} | {len(runs)}{f' ({failed} failed)' if failed else ''} | "
                + " | ".join(cells)
                + f" | {' / '.join(f'{a:.2f}' for a in mean_top1) or '-'} |"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train and measure each loss x seed")
    r.add_argument("--base", required=True, help="workdir with pretrain/ and distill/")
    r.add_argument("--out", required=True)
    r.add_argument("--losses", nargs="+", help=f"training.head_loss values (default {LOSSES})")
    r.add_argument("--seeds", nargs="+", type=int, help=f"training.seed values (default {SEEDS})")
    r.add_argument(
        "--extra", nargs="*", default=[], help="more stage=train overrides, the same for every run"
    )
    r.add_argument("--num-prompts", type=int, default=40)
    r.add_argument("--eval-fraction", type=float, default=0.05, help="data.eval_fraction of the runs")
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--quick", action="store_true", help="1 seed, ce/kl/tv, 60 steps, 12 prompts x 64 tokens")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--nice", type=int, default=10)
    r.add_argument("--force", action="store_true", help="train again runs that have a result.json")
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("ceiling", help="tau of oracle heads on the backbone's own samples")
    c.add_argument("--base", required=True, help="workdir with pretrain/ and distill/")
    c.add_argument("--num-prompts", type=int, default=40)
    c.add_argument("--eval-fraction", type=float, default=0.05)
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--depth", type=int, default=4, help="heads (tree depth), training.num_heads")
    c.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7, 1.0])
    c.add_argument("--samples", type=int, default=3, help="sampled replies per prompt at T > 0")
    c.add_argument("--threads", type=int, default=1)
    c.set_defaults(func=cmd_ceiling)
    rep = sub.add_parser("report", help="the Markdown table over one or more --out folders")
    rep.add_argument("--out", nargs="+", required=True)
    rep.set_defaults(func=cmd_report)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
