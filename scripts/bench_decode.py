"""Benchmark Medusa tree decoding against plain greedy ``generate``.

Run as:
    # trained backbone + heads, prompts from a JSONL ({"text": ...} or {"input_ids": [...]} per line)
    python scripts/bench_decode.py --model workdir/pretrain --heads workdir/heads \
        --prompts prompts.jsonl --tree workdir/export/medusa_choices.json --json bench.json
    # CPU smoke test: tiny random Llama (tests/helpers/models.py's tiny_config) + random heads
    python scripts/bench_decode.py --random
    # GPU: verification cost of N = 1..64 tree tokens on a Llama-3-8B-shaped random bf16 model
    python scripts/bench_decode.py --llama8b-shape --device cuda --dtype bfloat16
    # the demo workdir at batch sizes 1, 4 and 16: plain batched generate vs batched Medusa
    python scripts/bench_decode.py --model runs/default/pretrain --heads runs/default/heads \
        --tree runs/default/heads/medusa_choices.json --embedded-prompts --num-prompts 16 \
        --max-new-tokens 128 --batch-sizes 1 4 16 --repeats 3

Reports wall-clock tokens/s of plain greedy ``generate`` and greedy ``medusa_generate`` on the same
prompts (same machine, same run), the speed-up, tau (tokens per step), the forward cost of N tree
tokens relative to 1 (with the ``--attention`` the decoders run), and the decoder's own overhead (time
outside the model forward). With
``--batch-sizes``: for each batch size B, plain batched ``generate`` (left padding) against
``medusa_generate_batch`` on the same prompts in groups of B, repeats interleaved. Needs only
torch + transformers (no Hydra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medusa_train.decoding import (  # noqa: E402
    ATTENTION_CHOICES,
    MEDUSA_63,
    PackedHeads,
    TreeBuffers,
    load_choices,
    measure_forward_latency,
    medusa_generate,
    medusa_generate_batch,
)
from medusa_train.decoding.calibrate import timed_attention  # noqa: E402
from medusa_train.decoding.generate import attention_backends  # noqa: E402
from medusa_train.decoding.timing import (  # noqa: E402
    WARMUP_TURNS,
    Decoded,
    interleaved,
    pair_record,
    speedup_figures,
)
from medusa_train.heads import MedusaHeads  # noqa: E402
from tests.helpers.models import llama8b_config, tiny_config  # noqa: E402

TREE_SIZES = (1, 4, 8, 16, 32, 64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def random_run_config() -> LlamaConfig:
    """A small random Llama for the ``--random`` CPU run (the tests' builder; LlamaConfig's token ids)."""
    return tiny_config(
        "llama", vocab=256, hidden=64, max_pos=512, bos_token_id=1, eos_token_id=2, pad_token_id=None
    )


def build_random(config: LlamaConfig, num_heads: int, device: str, dtype: torch.dtype, seed: int = 0):
    """Random backbone + heads (heads start as copies of the lm_head, as in training)."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: an 8B model in fp32 would need 32 GB
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
            heads = MedusaHeads(config.hidden_size, config.vocab_size, num_heads=num_heads, num_layers=1)
    finally:
        torch.set_default_dtype(previous)
    heads.init_from_lm_head(model.get_output_embeddings().weight)
    return model, heads.eval()


def read_prompts(path: str | None, model, num: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    """Prompts as ``(1, T)`` tensors: from a JSONL file, or random tokens."""
    if path is None:
        gen = torch.Generator().manual_seed(seed)
        vocab = model.get_output_embeddings().weight.shape[0]
        return [torch.randint(0, vocab, (1, length), generator=gen) for _ in range(num)]
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][:num]
    if lines and "input_ids" not in lines[0]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
        return [tokenizer(row["text"], return_tensors="pt").input_ids for row in lines]
    return [torch.tensor([row["input_ids"]], dtype=torch.long) for row in lines]


def embedded_chat_prompts(model_dir: str, num: int, seed: int = 0) -> list[torch.Tensor]:
    """The first user turn of ``num`` held-out embedded conversations (what ``stage=eval`` uses by
    default), rendered with the backbone's chat template: ``(1, T)`` each."""
    from transformers import AutoTokenizer

    from medusa_train.data.embedded import embedded_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for conv in embedded_prompts("eval", num, seed):
        messages = [m for m in conv if m["role"] == "system"]
        messages.append(next(m for m in conv if m["role"] == "user"))
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"])
    return out


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The tokens up to and including the first EOS (``generate`` pads finished rows after it)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def plain_batch(
    model, prompts: list[torch.Tensor], max_new_tokens: int, eos_token_id, pad: int
) -> list[list[int]]:
    """Plain greedy ``generate`` on left-padded prompts; each row's new tokens up to its EOS."""
    device = next(model.parameters()).device
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1] :] = p[0]
        mask[i, width - p.shape[1] :] = 1
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad,
    )[:, width:]
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
    return [_until_eos(row, eos) for row in out.tolist()]


def _timed(device: torch.device, decode, *args, **kwargs) -> tuple:
    """``decode(*args, **kwargs)`` and its wall-clock seconds, the device synchronised at both ends."""
    _sync(device)
    t0 = time.perf_counter()
    out = decode(*args, **kwargs)
    _sync(device)
    return out, time.perf_counter() - t0


def bench_batches(
    model,
    heads,
    prompts,
    tree,
    max_new_tokens: int,
    eos_token_id,
    batch_sizes,
    repeats: int,
    batch1_fast_path=True,
    attention: str = "sdpa",
) -> list[dict]:
    """Plain batched ``generate`` vs ``medusa_generate_batch`` at each batch size, same prompts.

    The timing protocol of ``medusa_train.decoding.timing``: both paths warmed up at every batch size
    on the first group at the full budget; the prompts decoded in consecutive groups of B (the last
    group may be smaller), every repeat running every batch size, plain and Medusa alternating which
    goes first from group to group; the speed-up is the median over groups and repeats (min and max
    beside it), the summed tokens/s ratio kept as ``speedup_tokens_per_s``.
    """
    device = next(model.parameters()).device
    packed = PackedHeads(heads)
    tree = TreeBuffers.from_choices(tree).to(device)
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = eos_token_id if isinstance(eos_token_id, int) else (eos_token_id[0] if eos_token_id else 0)

    def plain(group: list[torch.Tensor]) -> Decoded:
        ref, seconds = _timed(device, plain_batch, model, group, max_new_tokens, eos_token_id, pad)
        return Decoded(ref, seconds)

    def medusa(group: list[torch.Tensor]) -> Decoded:
        out, seconds = _timed(
            device, medusa_generate_batch, model, packed, [p.to(device) for p in group],
            max_new_tokens=max_new_tokens, tree=tree, eos_token_id=eos_token_id, pad_token_id=pad,
            batch1_fast_path=batch1_fast_path, attention=attention,
        )  # fmt: skip
        steps = [n for r in out.rows for n in r.accepted_lengths]
        return Decoded([r.tokens.tolist() for r in out.rows], seconds, steps, out.prefill_s, out.num_forwards)

    for bsz in batch_sizes:  # warm-up: both paths at every batch size, full budget, untimed
        plain(prompts[:bsz])
        medusa(prompts[:bsz])
    records: dict[int, list[dict]] = {b: [] for b in batch_sizes}
    mismatch = dict.fromkeys(batch_sizes, 0)
    for rep in range(repeats):
        for bsz in batch_sizes:
            for g, start in enumerate(range(0, len(prompts), bsz)):
                group = prompts[start : start + bsz]
                ref, out = interleaved(rep + g, [partial(plain, group), partial(medusa, group)])
                records[bsz].append(pair_record(ref, out))
                mismatch[bsz] += sum(a != b for a, b in zip(out.tokens, ref.tokens, strict=True))
    rows = []
    for bsz in batch_sizes:
        fig = speedup_figures(records[bsz])
        per_group = [r["speedup"] for r in records[bsz]]
        rows.append(
            {
                "batch_size": bsz,
                "plain_tokens_per_s": fig["tokens_per_s_baseline"],
                "medusa_tokens_per_s": fig["tokens_per_s_medusa"],
                "speedup": fig["speedup"],
                "speedup_min": min(per_group),
                "speedup_max": max(per_group),
                "speedup_tokens_per_s": fig["speedup_tokens_per_s"],
                "speedup_plausible": fig["speedup_plausible"],
                "tau": fig["tau"],
                "rows_differing": mismatch[bsz] / repeats,
            }
        )
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_generation(
    model, heads, prompts, tree, max_new_tokens: int, eos_token_id, attention: str = "sdpa"
) -> dict:
    """Plain greedy ``generate`` vs greedy ``medusa_generate`` (tree attention ``attention``) on the
    same prompts.

    The timing protocol of ``medusa_train.decoding.timing``: both decoders warmed up on the first
    prompts at the full budget, then plain and Medusa alternating which goes first from prompt to
    prompt; ``speedup`` is the median per-prompt speed-up (quartiles beside it), the summed tokens/s
    ratio ``speedup_tokens_per_s``.
    """
    device = next(model.parameters()).device
    packed = PackedHeads(heads)  # both built once, as a caller decoding many prompts would
    tree = TreeBuffers.from_choices(tree).to(device)
    pad = eos_token_id if isinstance(eos_token_id, int) else (eos_token_id[0] if eos_token_id else 0)
    details: list = []  # the MedusaOutput of each timed prompt, for the overhead figures

    def plain(prompt: torch.Tensor) -> Decoded:
        # An explicit all-ones mask: without it `generate` masks every prompt token equal to the pad
        # id (random prompts contain it), and the reference is no longer plain greedy decoding.
        out, seconds = _timed(
            device, model.generate, prompt, attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id, pad_token_id=pad,
        )  # fmt: skip
        return Decoded(out[0, prompt.shape[1] :].tolist(), seconds)

    def medusa(prompt: torch.Tensor) -> Decoded:
        out = medusa_generate(
            model, packed, prompt, max_new_tokens=max_new_tokens, tree=tree, eos_token_id=eos_token_id,
            attention=attention,
        )  # fmt: skip
        details.append(out)
        return Decoded(
            out.tokens.tolist(), out.total_s, list(out.accepted_lengths), out.prefill_s, out.num_forwards
        )

    for prompt in prompts[:WARMUP_TURNS]:  # warm-up: both paths on the shapes timed below, untimed
        plain(prompt.to(device))
        medusa(prompt.to(device))
    details.clear()
    records = []
    for i, prompt in enumerate(prompts):
        prompt = prompt.to(device)
        ref, out = interleaved(i, [partial(plain, prompt), partial(medusa, prompt)])
        records.append(pair_record(ref, out))
    fig = speedup_figures(records)
    medusa_s = sum(d.total_s for d in details)
    prefill_s = sum(d.prefill_s for d in details)
    forward_s = sum(d.forward_s for d in details)
    forwards = sum(d.num_forwards for d in details)
    decode_s = medusa_s - prefill_s
    return {
        "prompts": len(prompts),
        "plain_tokens_per_s": fig["tokens_per_s_baseline"],
        "medusa_tokens_per_s": fig["tokens_per_s_medusa"],
        "speedup": fig["speedup"],
        "speedup_q25": fig["speedup_q25"],
        "speedup_q75": fig["speedup_q75"],
        "speedup_tokens_per_s": fig["speedup_tokens_per_s"],
        "speedup_plausible": fig["speedup_plausible"],
        "tau": fig["tau"],
        "overhead_fraction": (decode_s - forward_s) / decode_s if decode_s > 0 else 0.0,
        # Per verification forward: the model's forward, and everything else of the decode (heads,
        # candidates, mask views, acceptance, KV compaction, per-call setup, Python).
        "forward_ms": 1e3 * forward_s / max(1, forwards),
        "overhead_ms": 1e3 * (decode_s - forward_s) / max(1, forwards),
        "greedy_mismatches": sum(not r["identical"] for r in records),  # whole sequences
    }


def bench_overhead(
    model, heads, context_lens, sizes=TREE_SIZES, repeats: int = 5, attentions=("sdpa",)
) -> dict:
    """Forward cost of N tree tokens relative to 1 at each context length, for each tree attention,
    plus head cost per step.

    Each forward runs the tree attention the decoders run for that choice at that context
    (``measure_forward_latency``: ``auto`` resolved as a decoder call of that many keys, a kernel inside
    ``tree_step``); ``timed`` holds the implementation each was resolved to.
    """
    packed = PackedHeads(heads)
    device = next(model.parameters()).device
    result: dict = {"forward": {}, "timed": {}}
    for attention in attentions:
        result["forward"][attention], result["timed"][attention] = {}, {}
        for ctx in context_lens:
            lat = measure_forward_latency(model, sizes, ctx, attention=attention, warmup=2, repeats=repeats)
            result["forward"][attention][str(ctx)] = {str(n): v for n, v in lat.items()}
            result["timed"][attention][str(ctx)] = timed_attention(attention, device, ctx)
    hidden = torch.randn(heads.hidden_size, device=device, dtype=packed.dtype)
    times = []
    for r in range(2 + repeats):
        _sync(device)
        t0 = time.perf_counter()
        packed.logits(hidden).topk(10, dim=-1)
        _sync(device)
        if r >= 2:
            times.append(time.perf_counter() - t0)
    result["heads_topk_s"] = statistics.median(times)
    return result


def markdown(results: dict) -> str:
    """Results as markdown tables."""
    lines = []
    batches = results.get("batches")
    if batches:
        lines += [
            "| batch | plain tokens/s | Medusa tokens/s | speed-up: median (min-max over groups) | tau | rows differing |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['batch_size']} | {r['plain_tokens_per_s']:.1f} | {r['medusa_tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | {r['tau']:.2f} | "
            f"{r['rows_differing']:g} |"
            for r in batches
        ]
        lines.append("")
    gen = results.get("generation")
    if gen:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in gen.items()]
        lines.append("")
    dec = results.get("decoder")
    if dec:
        first = next(iter(dec.values()))
        lines += [
            f"Medusa decoder, random heads, context {first['context']}, {first['tokens']} tokens in "
            f"{first['steps']} steps; medians over {len(first['ms_per_step_rounds'])} rounds:",
            "",
            "| tree attention | ms per step (min-max) | forward ms per step | outside the forward |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {a} | {r['ms_per_step']:.2f} ({min(r['ms_per_step_rounds']):.2f}-{max(r['ms_per_step_rounds']):.2f}) "
            f"| {r['forward_ms_per_step']:.2f} | {r['overhead_fraction']:.1%} |"
            for a, r in dec.items()
        ]
        lines.append("")
    if "overhead" not in results:
        return "\n".join(lines)
    fwd, timed = results["overhead"]["forward"], results["overhead"]["timed"]
    columns = [(a, c) for a in fwd for c in fwd[a]]  # (attention, context)
    sizes = list(fwd[columns[0][0]][columns[0][1]])

    def header(a: str, c: str) -> str:
        used = timed[a][c]
        return f"{a}{f' ({used})' if used != a else ''}, ctx {c}: ms (x N=1)"

    lines += ["| N tree tokens | " + " | ".join(header(a, c) for a, c in columns) + " |"]
    lines += ["|---" * (len(columns) + 1) + "|"]
    for n in sizes:
        cells = [f"{fwd[a][c][n]['seconds'] * 1e3:.2f} ({fwd[a][c][n]['relative']:.2f}x)" for a, c in columns]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append(
        f"\nheads (all K, one batched product) + top-10: {results['overhead']['heads_topk_s'] * 1e3:.3f} ms"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="backbone directory (HF format)")
    p.add_argument("--heads", help="Medusa heads directory")
    p.add_argument("--random", action="store_true", help="tiny random Llama + random heads")
    p.add_argument(
        "--llama8b-shape", action="store_true", help="random Llama-3-8B-shaped model: overhead only"
    )
    p.add_argument("--prompts", help="JSONL of prompts ({'text': ...} or {'input_ids': [...]})")
    p.add_argument(
        "--embedded-prompts",
        action="store_true",
        help="held-out embedded prompts rendered with --model's chat template (stage=eval's default prompts)",
    )
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32, help="length of random prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tree", help="JSON tree (list of paths); default: the 63-node Medusa tree")
    p.add_argument("--num-heads", type=int, default=4, help="heads of the random models")
    p.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="context lengths for the overhead table"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--batch-sizes", type=int, nargs="+", default=None, help="also the batch-size table (e.g. 1 4 16)"
    )
    p.add_argument(
        "--no-batch1-fast-path",
        action="store_true",
        help="batch size 1 through the batched decoder too (default: medusa_generate's batch-1 path)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--skip-overhead", action="store_true", help="skip the N-tree-tokens table")
    p.add_argument(
        "--attention",
        nargs="+",
        default=["sdpa"],
        choices=ATTENTION_CHOICES,
        help="Medusa's tree attention: sdpa (dense float mask), triton, cuda or auto (docs/decoding.md), "
        "in the decoders and the N-tree-tokens table; with --llama8b-shape several, the decoders timed in "
        "turn over --repeats rounds in one process, the table one column per attention and context",
    )
    p.add_argument("--json", help="write results here")
    args = p.parse_args(argv)
    if sum([bool(args.model), args.random, args.llama8b_shape]) != 1:
        p.error("give exactly one of --model (with --heads), --random or --llama8b-shape")
    if args.model and not args.heads:
        p.error("--model needs --heads")
    if args.embedded_prompts and not args.model:
        p.error("--embedded-prompts needs --model (its tokenizer's chat template)")
    if len(args.attention) > 1 and not args.llama8b_shape:
        p.error("several --attention choices are compared with --llama8b-shape only")
    return args


def run(args: argparse.Namespace, config_overrides: dict | None = None) -> dict:
    """Run the benchmark described by ``args``; ``config_overrides`` shrink --llama8b-shape for tests."""
    dtype = DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    tree = load_choices(args.tree) if args.tree else MEDUSA_63
    results: dict = {
        "device": args.device,
        "dtype": args.dtype,
        "tree_nodes": len(tree),
        "threads": torch.get_num_threads(),
        "attention": args.attention,
    }
    attention = args.attention[0]
    if args.llama8b_shape:
        model, heads = build_random(
            llama8b_config(**(config_overrides or {})), args.num_heads, args.device, dtype
        )
        contexts = args.contexts or [512, 2048]
    else:
        if args.random:
            model, heads = build_random(random_run_config(), args.num_heads, args.device, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
            heads = MedusaHeads.from_pretrained(args.heads, device=args.device, dtype=dtype).eval()
        contexts = args.contexts or [args.prompt_len]
        if args.embedded_prompts:
            prompts = embedded_chat_prompts(args.model, args.num_prompts)
        else:
            prompts = read_prompts(args.prompts, model, args.num_prompts, args.prompt_len)
        eos = getattr(model.generation_config, "eos_token_id", None) if args.model else None
        results["generation"] = bench_generation(
            model, heads, prompts, tree, args.max_new_tokens, eos, attention
        )
        if args.batch_sizes:
            results["batches"] = bench_batches(
                model, heads, prompts, tree, args.max_new_tokens, eos, args.batch_sizes, args.repeats,
                batch1_fast_path=not args.no_batch1_fast_path, attention=attention,
            )  # fmt: skip
    if not args.skip_overhead:
        results["overhead"] = bench_overhead(
            model, heads, contexts, repeats=args.repeats, attentions=args.attention
        )
    if args.llama8b_shape:
        results["decoder"] = bench_decoder_overhead(
            model, heads, tree, contexts[0], args.max_new_tokens, args.attention, args.repeats
        )
    return results


def bench_decoder_overhead(
    model, heads, tree, context_len: int, max_new_tokens: int, attentions: list[str], rounds: int = 1
) -> dict:
    """Per-step time of ``medusa_generate`` and the share spent outside the model forward, for each
    tree attention: ``rounds`` rounds, each timing every attention in turn (a machine that slows down
    or speeds up mid-run shifts all of them alike), medians over the rounds."""
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (1, context_len), generator=torch.Generator().manual_seed(0)).to(device)
    packed = PackedHeads(heads)
    tree = TreeBuffers.from_choices(tree).to(device)
    runs: dict[str, list] = {a: [] for a in attentions}
    for attention in attentions:  # warm-up: the timed call itself (same shapes), so every kernel is
        # compiled and tuned for them before anything is timed (4 tokens verified only a 3-node prefix)
        medusa_generate(model, packed, prompt, max_new_tokens=max_new_tokens, tree=tree, attention=attention)
    for _ in range(max(1, rounds)):
        for attention in attentions:
            out = medusa_generate(
                model, packed, prompt, max_new_tokens=max_new_tokens, tree=tree, attention=attention
            )
            runs[attention].append(out)
    results = {}
    for attention, outs in runs.items():
        step_ms = [1e3 * (o.total_s - o.prefill_s) / max(1, o.num_steps) for o in outs]
        last = outs[-1]
        results[attention] = {
            "context": context_len,
            "tokens": len(last.tokens),
            "steps": last.num_steps,
            "tau": last.tau,
            "ms_per_step": statistics.median(step_ms),
            "ms_per_step_rounds": step_ms,
            "forward_ms_per_step": statistics.median(
                1e3 * o.forward_s / max(1, o.num_forwards) for o in outs
            ),
            "overhead_fraction": statistics.median(o.overhead_fraction for o in outs),
        }
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Plain `generate` and Medusa on the same attention kernels (on CUDA: SDPA without cuDNN, as the
    # decoders run; see medusa_train.decoding.generate.attention_backends).
    with attention_backends(torch.device(args.device)):
        results = run(args)
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
