"""Sweep Medusa-2 recipes from Medusa-1 heads and measure what they buy: tau gain vs backbone drift.

Cai et al., "Medusa" (arXiv:2401.10774), section 2.2.2 (Medusa-2: joint training, differential
learning rates, lambda0 warm-up, self-distillation). This script is how the figures and the
default of ``training=medusa2`` in docs/training.md were found.

Run as:
    # 1. a Medusa-1 workdir (embedded backbone, distilled data, Medusa-1 heads):
    python -m medusa_train stage=all workdir=runs/m1 tracking=disabled
    # 2. the Medusa-1 reference figures, then settings (each in its own workdir under --out):
    python scripts/sweep_medusa2.py baseline --base runs/m1 --out runs/sweep
    python scripts/sweep_medusa2.py run --base runs/m1 --out runs/sweep default lr1e-3 ...
    python scripts/sweep_medusa2.py run --base runs/m1 --out runs/sweep --extra my-try training.lr=5e-4 ...
    # 3. the table (Markdown) and the plot:
    python scripts/sweep_medusa2.py report --out runs/sweep --plot docs/medusa2_sweep.png
    python scripts/sweep_medusa2.py list            # the named settings

Each setting gets ``<out>/<name>/`` holding copies of the base's ``pretrain/`` (its embedded
backbone) and ``distill/`` (``cp -a``), trains there with ``python -m medusa_train stage=train
training=medusa2 training.init_heads=<base>/heads <overrides>`` (a subprocess, ``nice``,
``OMP_NUM_THREADS``), and is then measured in this process, all on the same inputs as the
Medusa-1 reference:

- ``tau_medusa63`` / ``tau_m1tree``: greedy tokens per step of ``medusa_generate`` with the trained
  backbone and heads on the first turns of the 40 held-out embedded eval prompts (``stage=eval``'s
  defaults: 128 new tokens), on the 63-node tree and on the Medusa-1 run's calibrated tree. Greedy
  tau is a function of the weights: no timing noise.
- ``agree`` / ``kl``: on every loss-masked position of the held-out distilled records, the share
  where the trained backbone's next-token argmax equals the original's, and the mean
  ``KL(p_original || p_trained)`` (nats).
- ``same_outputs``: the share of eval prompts whose greedy continuation is token-for-token the
  Medusa-1 reference's (the original backbone's).
- ``top1`` / ``topk``: held-out per-head top-1..10 accuracy (the calibration's table), with which
  ``exp_tau_*`` is the tree's expected tau.
- ``replay_*`` / ``clear_*`` / ``perfect_*`` / ``near_tie_share``: see :func:`replay` (the ceilings).

``--control`` adds, for each named setting, its frozen-backbone control: the same command with
``training.heads_only_steps`` = its steps (the heads train exactly as long, at the same learning
rate and schedule, on the original backbone), so a gain is not only more head training.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medusa_train.backbone import load_backbone, merge_adapter  # noqa: E402
from medusa_train.backbone_source import is_adapter_dir  # noqa: E402
from medusa_train.data.chat import ChatRenderer, eos_token_ids  # noqa: E402
from medusa_train.data.distilled import load_distilled, split_heldout  # noqa: E402
from medusa_train.decoding import MEDUSA_63, PackedHeads, TreeBuffers, load_choices, medusa_generate  # noqa: E402
from medusa_train.decoding.calibrate import compute_head_accuracy, expected_tau, per_rank_accuracy  # noqa: E402
from medusa_train.heads import MedusaHeads  # noqa: E402
from medusa_train.training.losses import IGNORE_INDEX, lm_targets  # noqa: E402
from medusa_train.training.trainer import PadCollator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# -- the settings ---------------------------------------------------------------------------------
# name -> overrides of `stage=train training=medusa2` (on top of conf/training/medusa2.yaml as it is
# in the checkout). Every setting reported in docs/training.md is here.
SETTINGS: dict[str, list[str]] = {
    "default": [],  # conf/training/medusa2.yaml as it is in the checkout
    # the shipped default this sweep replaced: 1 epoch (144 steps), lr 2e-5, KL
    "old-default": [
        "training.lr=2e-5",
        "training.lm_loss=kl",
        "training.max_steps=-1",
        "training.num_epochs=1",
    ],
    # backbone learning rate (heads x4), lambda0 0.2 sine over 100 steps, KL, full tuning, 300 steps
    "lr3e-4": ["training.lr=3e-4", "training.max_steps=300"],
    "lr1e-3": ["training.lr=1e-3", "training.max_steps=300"],
    "lr3e-3": ["training.lr=3e-3", "training.max_steps=300"],
    "lr1e-4": ["training.lr=1e-4", "training.max_steps=300"],
    # head multiplier, lambda0 and its warm-up, KL vs CE, LoRA, two-stage
    "lr3e-4-x1": ["training.lr=3e-4", "training.max_steps=300", "training.head_lr_multiplier=1"],
    "lr3e-4-lam1": ["training.lr=3e-4", "training.max_steps=300", "training.lambda0=1.0"],
    "lr3e-4-lam.02": ["training.lr=3e-4", "training.max_steps=300", "training.lambda0=0.02"],
    "lr3e-4-ce": ["training.lr=3e-4", "training.max_steps=300", "training.lm_loss=ce"],  # = ce-lr3e-4
    "lr3e-4-const": ["training.lr=3e-4", "training.max_steps=300", "training.lambda_warmup=constant"],
    "lr3e-4-2stage": ["training.lr=3e-4", "training.max_steps=300", "training.heads_only_steps=100"],
    "lora-lr1e-3": ["training.lr=1e-3", "training.max_steps=300", "training.backbone_tuning=lora"],
    "lora-lr3e-3": ["training.lr=3e-3", "training.max_steps=300", "training.backbone_tuning=lora"],
    # CE on the (greedy) distilled tokens instead of the KL: the same knobs
    "ce-lr1e-3": ["training.lr=1e-3", "training.max_steps=300", "training.lm_loss=ce"],
    "ce-lr1e-4": ["training.lr=1e-4", "training.max_steps=300", "training.lm_loss=ce"],
    "ce-lr3e-4-lam1": [
        "training.lr=3e-4",
        "training.max_steps=300",
        "training.lm_loss=ce",
        "training.lambda0=1.0",
    ],
    "ce-lr3e-4-150": ["training.lr=3e-4", "training.max_steps=150", "training.lm_loss=ce"],
    "ce-lr3e-4-x1": [
        "training.lr=3e-4",
        "training.max_steps=300",
        "training.lm_loss=ce",
        "training.head_lr_multiplier=1",
    ],
    "ce-lr3e-4-2stage": [
        "training.lr=3e-4",
        "training.max_steps=300",
        "training.lm_loss=ce",
        "training.heads_only_steps=100",
    ],
    "ce-lora-lr1e-3": [
        "training.lr=1e-3",
        "training.max_steps=300",
        "training.lm_loss=ce",
        "training.backbone_tuning=lora",
    ],
    # longer runs (300 steps took 43 s on the idle 2-core machine, not the ~4.5 min measured under
    # load, so 1,000+ steps fit the 5-minute budget); CE throughout
    "ce-lr3e-4-600": ["training.lr=3e-4", "training.lm_loss=ce", "training.max_steps=600"],
    "ce-lr3e-4-1000": ["training.lr=3e-4", "training.lm_loss=ce", "training.max_steps=1000"],
    "ce-lr3e-4-1500": ["training.lr=3e-4", "training.lm_loss=ce", "training.max_steps=1500"],
    "ce-lr1e-3-1000": ["training.lr=1e-3", "training.lm_loss=ce", "training.max_steps=1000"],
    "ce-lr3e-4-x10-1000": [
        "training.lr=3e-4",
        "training.lm_loss=ce",
        "training.max_steps=1000",
        "training.head_lr_multiplier=10",
    ],
    "ce-lr3e-4-lam1-1000": [
        "training.lr=3e-4",
        "training.lm_loss=ce",
        "training.max_steps=1000",
        "training.lambda0=1.0",
    ],
    "ce-lr3e-4-const-1000": [
        "training.lr=3e-4",
        "training.lm_loss=ce",
        "training.max_steps=1000",
        "training.lambda_warmup=constant",
    ],
    "ce-lr3e-4-lin300-1000": [
        "training.lr=3e-4",
        "training.lm_loss=ce",
        "training.max_steps=1000",
        "training.lambda_warmup=linear",
        "training.lambda_warmup_steps=300",
    ],
    "ce-x10-const-1000": [
        "training.lr=3e-4",
        "training.lm_loss=ce",
        "training.max_steps=1000",
        "training.head_lr_multiplier=10",
        "training.lambda_warmup=constant",
    ],
    "ce-lr3e-4-2stage300-1000": [
        "training.lr=3e-4",
        "training.lm_loss=ce",
        "training.max_steps=1000",
        "training.heads_only_steps=300",
    ],
    "ce-lora-lr1e-3-1000": [
        "training.lr=1e-3",
        "training.lm_loss=ce",
        "training.max_steps=1000",
        "training.backbone_tuning=lora",
    ],
}


def control_of(overrides: list[str]) -> list[str]:
    """The frozen-backbone control of a setting: heads only for all of its steps."""
    steps = next((o.split("=", 1)[1] for o in overrides if o.startswith("training.max_steps=")), None)
    if steps is None:
        raise SystemExit("a control needs training.max_steps in the setting's overrides")
    return [o for o in overrides if not o.startswith("training.heads_only_steps=")] + [
        f"training.heads_only_steps={steps}"
    ]


# -- measurement ----------------------------------------------------------------------------------
def heldout_records(distill_dir: Path, eval_fraction: float = 0.05, max_len: int = 512) -> list[dict]:
    """Held-out distilled records (the split ``stage=train`` calibrates on), truncated like training."""
    _, held = split_heldout(load_distilled(distill_dir), eval_fraction)
    out = []
    for r in held:
        if sum(r["loss_mask"][2:max_len]) > 0:
            out.append(
                {"input_ids": list(r["input_ids"][:max_len]), "loss_mask": list(r["loss_mask"][:max_len])}
            )
    return out


@torch.no_grad()
def drift(original, trained, records: list[dict], batch_size: int = 8) -> dict:
    """Next-token argmax agreement and mean KL(original || trained) on loss-masked positions."""
    collate = PadCollator(0)
    agree = total = 0
    kl = 0.0
    for start in range(0, len(records), batch_size):
        b = collate(records[start : start + batch_size])
        keep = lm_targets(b["input_ids"], b["loss_mask"], b["attention_mask"]) != IGNORE_INDEX  # (B, T)
        lo = (
            original(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[keep].float()
        )  # (N, V)
        lt = (
            trained(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[keep].float()
        )  # (N, V)
        agree += int((lo.argmax(-1) == lt.argmax(-1)).sum())
        po, pt = lo.log_softmax(-1), lt.log_softmax(-1)  # (N, V)
        kl += float((po.exp() * (po - pt)).sum())
        total += int(keep.sum())
    return {"agree": agree / max(total, 1), "kl": kl / max(total, 1), "positions": total}


@torch.no_grad()
def head_accuracy(backbone, heads: MedusaHeads, records: list[dict]) -> torch.Tensor:
    """``(K, 10)`` held-out cumulative top-1..10 accuracy of each head (``stage=train``'s table)."""
    collate = PadCollator(0)
    batches = (collate(records[i : i + 8]) for i in range(0, len(records), 8))
    return compute_head_accuracy(backbone, heads, batches, max_k=10)


CLEAR = 0.5
"""A decision of the backbone is clear when its top-1 next-token probability beats its top-2 by this much."""


@torch.no_grad()
def replay(
    model, heads: MedusaHeads, inputs, outputs: list[list[int]], trees: dict[str, list[list[int]]]
) -> dict:
    """Greedy tree decoding replayed from teacher-forced states, and two ceilings on the same turns.

    Greedy tree decoding is exact, so the hidden state it reads at a step is the teacher-forced one
    of the greedy sequence (prompt + ``outputs``): a step starts after the last accepted token j, its
    root is token j+1, and the tree's node at depth d with rank i is right iff head d's rank-i token
    at j is token j+1+d; the deepest right path is accepted. For each tree this gives

    - ``replay_<tree>``: the tau of these heads (the measured tau, but for the last step's cut);
    - ``clear_<tree>``: the tau if the rank-0 candidate of every head were right wherever the
      backbone's own choice of that token was clear (top-1 minus top-2 probability >= ``CLEAR``),
      the heads as they are at its near ties: what heads reading a better hidden state could reach
      while the backbone keeps its decisions;
    - ``perfect_<tree>``: every rank-0 candidate right (K + 1 but for the budget's cut);

    and ``near_tie_share``: the share of generated tokens that were a near-tie choice of the backbone.
    """
    sums: dict[str, list[int]] = {}
    near = total = 0
    for (ids, _), out in zip(inputs, outputs, strict=True):
        if not out:
            continue
        seq = torch.tensor([ids[0].tolist() + out])  # (1, T)
        start = ids.shape[1] - 1  # the prompt's last position: its logits chose out[0]
        res = model(input_ids=seq, output_hidden_states=True)
        top2 = res.logits[0].float().softmax(-1).topk(2, dim=-1).values  # (T, 2)
        clear = (top2[:, 0] - top2[:, 1]) >= CLEAR  # (T,): position t chose token t+1 clearly
        hidden = res.hidden_states[-1][0].to(next(heads.parameters()).dtype)  # (T, d)
        tops = (
            heads.full_vocab_logits(heads(hidden)).topk(10, dim=-1).indices
        )  # (K, T, 10) full-vocabulary ids
        tokens = seq[0].tolist()
        near += int((~clear[start : start + len(out)]).sum())
        total += len(out)
        for name, choices in trees.items():
            for mode in ("replay", "clear", "perfect"):
                j, done, steps = start, 0, 0
                while done < len(out):
                    depth = 0
                    for path in choices:
                        ok = True
                        for d, rank in enumerate(path, start=1):
                            pos = j + 1 + d  # the token head d proposes at j
                            if pos >= len(tokens):
                                ok = False
                            elif mode == "perfect":
                                ok = rank == 0
                            else:
                                ok = int(tops[d - 1, j, rank]) == tokens[pos] or (
                                    mode == "clear" and rank == 0 and bool(clear[pos - 1])
                                )
                            if not ok:
                                break
                        if ok:
                            depth = max(depth, len(path))
                    gained = min(1 + depth, len(out) - done)
                    done, j, steps = done + gained, j + gained, steps + 1
                acc = sums.setdefault(f"{mode}_{name}", [0, 0])
                acc[0] += len(out)
                acc[1] += steps
    result = {k: round(v[0] / max(v[1], 1), 4) for k, v in sums.items()}
    result["near_tie_share"] = round(near / max(total, 1), 4)
    return result


def eval_inputs(tok, num_prompts: int = 40, max_new_tokens: int = 128) -> list[tuple[torch.Tensor, int]]:
    """First turns of ``stage=eval``'s default prompts (held-out embedded), rendered, with their budget."""
    from medusa_train.config import EvalConfig
    from medusa_train.stages.eval import load_eval_prompts

    renderer = ChatRenderer(tok)
    prompts = load_eval_prompts(EvalConfig(num_prompts=num_prompts))
    return [(torch.tensor([renderer.turn_prompt_ids(p, [])]), max_new_tokens) for p in prompts]


def eval_prompts(num_prompts: int = 40):
    """``stage=eval``'s default prompts (held-out embedded conversations, all their turns)."""
    from medusa_train.config import EvalConfig
    from medusa_train.stages.eval import load_eval_prompts

    return load_eval_prompts(EvalConfig(num_prompts=num_prompts))


@torch.inference_mode()
def all_turn_inputs(model, heads: MedusaHeads, tok, prompts, eos: list[int], max_new_tokens: int = 128):
    """Every turn of ``prompts`` rendered after the model's own greedy answers to the earlier ones (as
    ``stage=eval eval.all_turns=true``): ``(inputs, outputs)`` per turn."""
    renderer, packed, chain = ChatRenderer(tok), PackedHeads(heads), TreeBuffers.from_choices([[0]])
    inputs, outputs = [], []
    for prompt in prompts:
        history: list[str] = []
        for _ in prompt.turns:
            ids = torch.tensor([renderer.turn_prompt_ids(prompt, history)])  # (1, T)
            budget = min(max_new_tokens, model.config.max_position_embeddings - ids.shape[1])
            if budget <= 0:
                break
            out = medusa_generate(model, packed, ids, max_new_tokens=budget, tree=chain, eos_token_id=eos)
            inputs.append((ids, budget))
            outputs.append(out.tokens.tolist())
            history.append(tok.decode(out.tokens, skip_special_tokens=True))
    return inputs, outputs


@torch.inference_mode()
def greedy_tau(model, heads: MedusaHeads, inputs, choices, eos: list[int]) -> tuple[float, list[list[int]]]:
    """Greedy tokens per step over ``inputs`` and the generated tokens of each."""
    packed, tree = PackedHeads(heads), TreeBuffers.from_choices(choices)
    tokens = steps = 0
    outs = []
    for ids, budget in inputs:
        budget = min(budget, model.config.max_position_embeddings - ids.shape[1])
        out = medusa_generate(model, packed, ids, max_new_tokens=budget, tree=tree, eos_token_id=eos)
        tokens += len(out.tokens)
        steps += out.num_steps
        outs.append(out.tokens.tolist())
    return tokens / max(steps, 1), outs


def load_model(path: Path, base_dir: Path):
    """A backbone directory (full model) or a LoRA adapter directory merged into ``base_dir``."""
    if is_adapter_dir(path):
        base, _ = load_backbone(str(base_dir))
        return merge_adapter(base, path).eval()
    model, _ = load_backbone(str(path))
    return model


def measure(base: Path, heads_dir: Path, backbone_dir: Path | None, cache: dict) -> dict:
    """All figures of one set of heads (with its trained backbone, or the original when None)."""
    if "original" not in cache:
        original, tok = load_backbone(str(base_backbone(base)))
        cache.update(
            original=original,
            tok=tok,
            records=heldout_records(base / "distill"),
            inputs=eval_inputs(tok),
            prompts=eval_prompts(),
            m1_tree=load_choices(base / "heads" / "medusa_choices.json"),
        )
    original, tok = cache["original"], cache["tok"]
    model = original if backbone_dir is None else load_model(backbone_dir, base_backbone(base))
    heads = MedusaHeads.from_pretrained(heads_dir).eval()
    eos = eos_token_ids(model, tok)
    acc = head_accuracy(model, heads, cache["records"])
    result = {"top1": [round(float(a), 4) for a in acc[:, 0]], "topk": acc.tolist()}
    trees = {"medusa63": [list(p) for p in MEDUSA_63], "m1tree": cache["m1_tree"]}
    for name, choices in trees.items():
        tau, outs = greedy_tau(model, heads, cache["inputs"], choices, eos)
        result[f"tau_{name}"] = round(tau, 4)
        result[f"exp_tau_{name}"] = round(expected_tau(per_rank_accuracy(acc), choices), 4)
        if name == "medusa63":  # greedy outputs: the backbone's own, whatever the heads and tree
            result["outputs"] = outs
            ref = cache.get("reference_outputs", outs)  # the original backbone's (the Medusa-1 reference)
            result["same_outputs"] = round(sum(a == b for a, b in zip(outs, ref, strict=True)) / len(ref), 4)
    result.update(replay(model, heads, cache["inputs"], result["outputs"], trees))
    # Every turn, each after the model's own earlier answers (stage=eval eval.all_turns=true).
    inputs, outs = all_turn_inputs(model, heads, tok, cache["prompts"], eos)
    for name, choices in trees.items():
        result[f"tau_all_{name}"] = round(greedy_tau(model, heads, inputs, choices, eos)[0], 4)
    ceilings = replay(model, heads, inputs, outs, trees)
    result["near_tie_share_all"] = ceilings.pop("near_tie_share")
    result.update({k.replace("_", "_all_", 1): v for k, v in ceilings.items()})  # replay_all_medusa63, ...
    result["turns_all"] = len(inputs)
    result.update(
        {
            k: round(v, 6) if isinstance(v, float) else v
            for k, v in drift(original, model, cache["records"]).items()
        }
    )
    return result


# -- running --------------------------------------------------------------------------------------
def base_backbone(base: Path) -> Path:
    """The embedded backbone of the base workdir: ``pretrain/``."""
    return base / "pretrain"


def prepare(base: Path, wd: Path) -> None:
    """``wd`` with copies of the base's backbone (as ``pretrain/``) and distilled data (``cp -a``)."""
    wd.mkdir(parents=True, exist_ok=True)
    for src, name in ((base_backbone(base), "pretrain"), (base / "distill", "distill")):
        if not (wd / name).exists():
            subprocess.run(["cp", "-a", str(src), str(wd / name)], check=True)


def train(base: Path, wd: Path, overrides: list[str], threads: int, nice: int) -> dict:
    """``stage=train training=medusa2`` from the base's Medusa-1 heads; returns its training_result."""
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
        "training=medusa2",
        f"workdir={wd}",
        "tracking=disabled",
        f"training.init_heads={base / 'heads'}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(wd / "train.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads((wd / "heads" / "config.json").read_text())["training_result"]


def cmd_run(args) -> None:
    base, out = Path(args.base).resolve(), Path(args.out).resolve()
    todo: list[tuple[str, list[str]]] = []
    if args.extra:
        todo.append((args.extra[0], args.extra[1:]))
    for name in args.names:
        if name not in SETTINGS:
            raise SystemExit(f"unknown setting {name!r}: see `list`, or pass --extra NAME key=value ...")
        todo.append((name, SETTINGS[name]))
    if args.control:
        todo += [(f"{name}@frozen", control_of(ov)) for name, ov in list(todo)]
    torch.set_num_threads(args.threads)
    cache: dict = {"reference_outputs": reference_outputs(out)}
    for name, overrides in todo:
        wd = out / name.replace("@", "_")
        if (wd / "result.json").is_file() and not (args.force or args.remeasure):
            print(f"{name}: done already ({wd / 'result.json'})", flush=True)
            continue
        t0 = time.time()
        if args.remeasure:  # the trained heads as they are: measure again (after a change of the measures)
            result = json.loads((wd / "heads" / "config.json").read_text())["training_result"]
        else:
            prepare(base, wd)
            result = train(base, wd, overrides, args.threads, args.nice)
        figures = measure(base, wd / "heads", wd / "heads" / "backbone", cache)
        (wd / "outputs.json").write_text(json.dumps(figures.pop("outputs")) + "\n")
        record = {
            "name": name,
            "overrides": overrides,
            "steps": result["steps"],
            "train_seconds": result["train_seconds"],
            **figures,
            "wall_seconds": round(time.time() - t0, 1),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
        }
        (wd / "result.json").write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps({k: v for k, v in record.items() if k != "topk"}), flush=True)


def cmd_baseline(args) -> None:
    base, out = Path(args.base).resolve(), Path(args.out).resolve()
    torch.set_num_threads(args.threads)
    record = {"name": "medusa1", "overrides": [], "steps": 0, "train_seconds": 0.0}
    record.update(measure(base, base / "heads", None, {}))
    record["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    (out / "medusa1").mkdir(parents=True, exist_ok=True)
    (out / "medusa1" / "outputs.json").write_text(json.dumps(record.pop("outputs")) + "\n")
    (out / "medusa1" / "result.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "topk"}), flush=True)


def reference_outputs(out: Path) -> list[list[int]]:
    """The original backbone's greedy outputs on the eval turns (written by ``baseline``)."""
    path = out / "medusa1" / "outputs.json"
    if not path.is_file():
        raise SystemExit(f"no Medusa-1 reference in {out}: run `baseline` first")
    return json.loads(path.read_text())


def load_results(out: Path) -> tuple[dict, list[dict]]:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*/result.json"))]
    ref = next((r for r in results if r["name"] == "medusa1"), None)
    if ref is None:
        raise SystemExit(f"no Medusa-1 reference in {out}: run `baseline` first")
    return ref, [r for r in results if r["name"] != "medusa1"]


def cmd_report(args) -> None:
    ref, rows = load_results(Path(args.out))
    rows.sort(key=lambda r: (r["name"].endswith("@frozen"), r["name"]))
    lines = [
        "| setting | overrides | steps | train s | tau 63 | tau M1 tree | all turns: tau 63 | all turns: tau M1 tree "
        "| argmax agree | KL | near ties | held-out top-1 |",
        "|" + "---|" * 12,
    ]

    def tau(r: dict, key: str, gain: bool) -> str:
        if key not in r:
            return "n/a"
        return f"{r[key]:.2f}" + (f" ({r[key] - ref[key]:+.2f})" if gain else "")

    def row(r: dict, gain: bool = True) -> str:
        ov = " ".join(o.removeprefix("training.") for o in r["overrides"])
        ov = ov or ("Medusa-1 heads, original backbone" if r["name"] == "medusa1" else "the shipped default")
        top1 = "/".join(f"{a:.3f}" for a in r["top1"])
        taus = " | ".join(
            tau(r, k, gain) for k in ("tau_medusa63", "tau_m1tree", "tau_all_medusa63", "tau_all_m1tree")
        )
        return (
            f"| {r['name']} | `{ov}` | {r['steps']} | {r['train_seconds']:.0f} | {taus} | {r['agree']:.4f} | "
            f"{r['kl']:.4f} | {r.get('near_tie_share', float('nan')):.3f} | {top1} |"
        )

    lines.append(row(ref, gain=False))
    lines += [row(r) for r in rows]
    print("\n".join(lines))
    print("\nceilings on each run's own greedy outputs (first turns; all turns):")
    print("| setting | replayed 63 / M1 tree | right on every clear decision | perfect heads |")
    print("|---|---|---|---|")
    for r in [ref, *rows]:
        cells = []
        for mode in ("replay", "clear", "perfect"):
            first = (
                f"{r.get(f'{mode}_medusa63', float('nan')):.2f} / {r.get(f'{mode}_m1tree', float('nan')):.2f}"
            )
            every = (
                f"; {r[f'{mode}_all_medusa63']:.2f} / {r[f'{mode}_all_m1tree']:.2f}"
                if f"{mode}_all_medusa63" in r
                else ""
            )
            cells.append(first + every)
        print(f"| {r['name']} | " + " | ".join(cells) + " |")
    if args.plot:
        plot(ref, rows, Path(args.plot))


def plot(ref: dict, rows: list[dict], path: Path) -> None:
    """Tau gain over Medusa-1 against backbone drift: (first turns, all turns) x (63-node tree, M1 tree)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex=True)
    panels = [
        (0, "", "first turns (stage=eval default)"),
        (1, "all_", "all turns (eval.all_turns=true)"),
    ]
    for row_i, prefix, turns in panels:
        for col, tree, title in ((0, "medusa63", "63-node tree"), (1, "m1tree", "Medusa-1 calibrated tree")):
            ax, key = axes[row_i][col], f"tau_{prefix}{tree}"
            for r in rows:
                if key not in r:
                    continue
                frozen = r["name"].endswith("@frozen")
                ce = "lm_loss=ce" in " ".join(r["overrides"])
                x, y = 100 * (1 - r["agree"]), r[key] - ref[key]
                color = "grey" if frozen else ("C1" if ce else "C0")
                ax.scatter(x, y, marker="s" if frozen else "o", color=color, s=30)
                ax.annotate(r["name"], (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
            ax.axhline(0.3, color="C2", ls="--", lw=1, label="target: +0.3 tau")
            ax.axhline(
                ref[f"perfect_{prefix}{tree}"] - ref[key],
                color="C3",
                ls=":",
                lw=1,
                label="perfect heads on Medusa-1's outputs",
            )
            ax.axvline(5.0, color="C3", ls="--", lw=1, label="limit: 95% argmax agreement")
            ax.axhline(0.0, color="black", lw=0.6)
            ax.set_title(f"{title}, {turns}: Medusa-1 tau {ref[key]:.2f}", fontsize=9)
            ax.grid(alpha=0.3)
            if row_i == 1:
                ax.set_xlabel("backbone drift: held-out positions whose greedy token changed (%)")
            if col == 0:
                ax.set_ylabel("tau gain over Medusa-1 (greedy, 40 eval prompts)")
    axes[0][0].legend(fontsize=7, loc="center right")
    fig.suptitle(
        "Medusa-2 from Medusa-1 heads. Blue: KL to the original, orange: CE on the distilled tokens, "
        "grey squares: the same steps with the backbone frozen",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "baseline"):
        p = sub.add_parser(name)
        p.add_argument("--base", required=True, help="the Medusa-1 workdir (pretrain/, distill/, heads/)")
        p.add_argument("--out", required=True, help="folder of the sweep's workdirs and results")
        p.add_argument("--threads", type=int, default=1, help="torch threads (training and measuring)")
        if name == "run":
            p.add_argument("names", nargs="*", help="named settings (see `list`)")
            p.add_argument(
                "--extra", nargs="+", metavar="NAME_OR_OVERRIDE", help="NAME key=value ...: an ad-hoc setting"
            )
            p.add_argument(
                "--control", action="store_true", help="also each setting's frozen-backbone control"
            )
            p.add_argument("--nice", type=int, default=10)
            p.add_argument("--force", action="store_true", help="redo settings that have a result")
            p.add_argument(
                "--remeasure", action="store_true", help="measure trained settings again, no training"
            )
    p = sub.add_parser("report")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", help="write the tau gain vs drift plot here (PNG)")
    sub.add_parser("list")
    args = parser.parse_args()
    if args.command == "list":
        for name, overrides in SETTINGS.items():
            print(f"{name}: {' '.join(overrides) or '(the defaults)'}")
        return
    {"run": cmd_run, "baseline": cmd_baseline, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
