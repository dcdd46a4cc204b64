"""Benchmark Medusa tree decoding against plain greedy ``generate``.

Run as:
    # trained backbone + heads, prompts from a JSONL ({"text": ...} or {"input_ids": [...]} per line)
    python scripts/bench_decode.py --model workdir/pretrain --heads workdir/heads \
        --prompts prompts.jsonl --tree workdir/export/medusa_choices.json --json bench.json
    # CPU smoke test: tiny random Llama (tests/helpers/models.py's tiny_config) + random heads
    python scripts/bench_decode.py --random
    # GPU: verification cost of N = 1..64 tree tokens on a Llama-3-8B-shaped random bf16 model
    python scripts/bench_decode.py --llama8b-shape --device cuda --dtype bfloat16

Reports wall-clock tokens/s of plain greedy ``generate`` and greedy ``medusa_generate`` on the same
prompts (same machine, same run), the speed-up, tau (tokens per step), the forward cost of N tree
tokens relative to 1, and the decoder's own overhead (time outside the model forward). Needs only
torch + transformers (no Hydra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medusa_train.decoding import (  # noqa: E402
    MEDUSA_63,
    PackedHeads,
    TreeBuffers,
    load_choices,
    measure_forward_latency,
    medusa_generate,
)
from medusa_train.heads import MedusaHeads  # noqa: E402
from tests.helpers.models import tiny_config  # noqa: E402

TREE_SIZES = (1, 4, 8, 16, 32, 64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def llama8b_config(**overrides) -> LlamaConfig:
    """Llama-3-8B's shape (random weights); ``overrides`` shrink it for CPU tests."""
    shape = dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    shape.update(overrides)
    return LlamaConfig(**shape)


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_generation(model, heads, prompts, tree, max_new_tokens: int, eos_token_id) -> dict:
    """Plain greedy ``generate`` vs greedy ``medusa_generate`` on the same prompts."""
    device = next(model.parameters()).device
    packed = PackedHeads(heads)  # both built once, as a caller decoding many prompts would
    tree = TreeBuffers.from_choices(tree).to(device)
    plain_tokens = medusa_tokens = 0
    plain_s = medusa_s = forward_s = prefill_s = 0.0
    steps = forwards = 0
    mismatches = 0
    pad = eos_token_id if isinstance(eos_token_id, int) else (eos_token_id[0] if eos_token_id else 0)
    # Warm-up both paths once (kernels, allocator) outside the timings.
    warm = prompts[0].to(device)
    model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=pad)
    medusa_generate(model, packed, warm, max_new_tokens=4, tree=tree)
    for prompt in prompts:
        prompt = prompt.to(device)
        _sync(device)
        t0 = time.perf_counter()
        ref = model.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=pad,
        )[0, prompt.shape[1] :]
        _sync(device)
        plain_s += time.perf_counter() - t0
        plain_tokens += ref.numel()
        out = medusa_generate(
            model, packed, prompt, max_new_tokens=max_new_tokens, tree=tree, eos_token_id=eos_token_id
        )
        medusa_s += out.total_s
        forward_s += out.forward_s
        prefill_s += out.prefill_s
        medusa_tokens += out.tokens.numel()
        steps += out.num_steps
        forwards += out.num_forwards
        mismatches += int(
            not torch.equal(out.tokens, ref.cpu())
        )  # whole sequences: a short output is a mismatch
    plain_tps = plain_tokens / plain_s
    medusa_tps = medusa_tokens / medusa_s
    decode_s = medusa_s - prefill_s
    return {
        "prompts": len(prompts),
        "plain_tokens_per_s": plain_tps,
        "medusa_tokens_per_s": medusa_tps,
        "speedup": medusa_tps / plain_tps,
        "tau": medusa_tokens / max(1, steps),
        "overhead_fraction": (decode_s - forward_s) / decode_s if decode_s > 0 else 0.0,
        # Per verification forward: the model's forward, and everything else of the decode (heads,
        # candidates, mask views, acceptance, KV compaction, per-call setup, Python).
        "forward_ms": 1e3 * forward_s / max(1, forwards),
        "overhead_ms": 1e3 * (decode_s - forward_s) / max(1, forwards),
        "greedy_mismatches": mismatches,
    }


def bench_overhead(model, heads, context_lens, sizes=TREE_SIZES, repeats: int = 5) -> dict:
    """Forward cost of N tree tokens relative to 1 at each context length, plus head cost per step."""
    packed = PackedHeads(heads)
    device = next(model.parameters()).device
    result: dict = {"forward": {}}
    for ctx in context_lens:
        lat = measure_forward_latency(model, sizes, ctx, warmup=2, repeats=repeats)
        result["forward"][str(ctx)] = {str(n): v for n, v in lat.items()}
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
    gen = results.get("generation")
    if gen:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in gen.items()]
        lines.append("")
    dec = results.get("decoder")
    if dec:
        lines += ["| decoder (random heads) | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in dec.items()]
        lines.append("")
    fwd = results["overhead"]["forward"]
    ctxs = list(fwd)
    sizes = list(next(iter(fwd.values())))
    lines += ["| N tree tokens | " + " | ".join(f"ctx {c}: ms (x N=1)" for c in ctxs) + " |"]
    lines += ["|---" * (len(ctxs) + 1) + "|"]
    for n in sizes:
        cells = [f"{fwd[c][n]['seconds'] * 1e3:.2f} ({fwd[c][n]['relative']:.2f}x)" for c in ctxs]
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
    p.add_argument("--json", help="write results here")
    args = p.parse_args(argv)
    if sum([bool(args.model), args.random, args.llama8b_shape]) != 1:
        p.error("give exactly one of --model (with --heads), --random or --llama8b-shape")
    if args.model and not args.heads:
        p.error("--model needs --heads")
    return args


def run(args: argparse.Namespace, config_overrides: dict | None = None) -> dict:
    """Run the benchmark described by ``args``; ``config_overrides`` shrink --llama8b-shape for tests."""
    dtype = DTYPES[args.dtype]
    tree = load_choices(args.tree) if args.tree else MEDUSA_63
    results: dict = {"device": args.device, "dtype": args.dtype, "tree_nodes": len(tree)}
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
        prompts = read_prompts(args.prompts, model, args.num_prompts, args.prompt_len)
        eos = getattr(model.generation_config, "eos_token_id", None) if args.model else None
        results["generation"] = bench_generation(model, heads, prompts, tree, args.max_new_tokens, eos)
    results["overhead"] = bench_overhead(model, heads, contexts, repeats=args.repeats)
    if args.llama8b_shape:
        results["decoder"] = bench_decoder_overhead(model, heads, tree, contexts[0], args.max_new_tokens)
    return results


def bench_decoder_overhead(model, heads, tree, context_len: int, max_new_tokens: int) -> dict:
    """Per-step time of ``medusa_generate`` and the share spent outside the model forward."""
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (1, context_len), generator=torch.Generator().manual_seed(0)).to(device)
    packed = PackedHeads(heads)
    tree = TreeBuffers.from_choices(tree).to(device)
    medusa_generate(model, packed, prompt, max_new_tokens=4, tree=tree)  # warm-up
    out = medusa_generate(model, packed, prompt, max_new_tokens=max_new_tokens, tree=tree)
    decode_s = out.total_s - out.prefill_s
    return {
        "context": context_len,
        "tokens": len(out.tokens),
        "steps": out.num_steps,
        "tau": out.tau,
        "ms_per_step": 1e3 * decode_s / max(1, out.num_steps),
        "forward_ms_per_step": 1e3 * out.forward_s / max(1, out.num_forwards),
        "overhead_fraction": out.overhead_fraction,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
