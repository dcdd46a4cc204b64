"""The static-shape decoder against the hardware floor and transformers' compiled static-cache generate.

Run as:
    # GPU (one H100, ~3 min): Llama-3-8B shape, random bf16 weights, 4 random heads
    python scripts/bench_static.py --device cuda --json static.json
    # the step's tree forward through a tree-attention kernel instead of SDPA's (B, 1, M, C) mask
    python scripts/bench_static.py --device cuda --attention triton --json static_triton.json
    # heads over a 32K-token draft vocabulary (a quarter of the 8B shape's 128K: 1.1 GB instead of 4.2 GB
    # read per tree step), and the step compiled by inductor with its GEMM autotuning instead of captured
    python scripts/bench_static.py --device cuda --head-projection truncated --draft-vocab 32768 \
        --capture compile --compile-mode max-autotune --inductor-tuning --contexts 2048 --batch-sizes 1
    # the cost of exact sampling in the captured step (warping, top-p's sort, a draw per node);
    # --top-k 50 (generate's default) ranks only the top-k's scores for the top-p instead of sorting
    python scripts/bench_static.py --device cuda --acceptance sample --top-p 0.9 --contexts 2048 \
        --batch-sizes 1 16 --nodes 1 64 --hf-static-contexts --json static_sample.json
    # CPU dry run (under a minute): a tiny Llama, same table
    python scripts/bench_static.py --device cpu --tiny
    # CPU dry run of the Triton kernel (triton's interpreter: slow, so few cases)
    python scripts/bench_static.py --device cpu --tiny --attention triton --contexts 32 --new-tokens 8 \
        --batch-sizes 2 --nodes 1 16 --hf-static-contexts --parity-captures eager

Prints one table: the device's copy bandwidth and the floor it implies (reading every weight once),
plain eager ``generate`` ms/token, transformers' ``generate(cache_implementation="static")`` ms/token
(compiled by transformers on CUDA: ``mode="reduce-overhead"``; eager static cache elsewhere), our
static decoder with a 1-node tree (plain greedy, captured) ms/step, and Medusa ms/step for 4, 16 and
64 tree nodes (prefixes of the 63-path Medusa tree), at batch 1, 4 and 16 and the given contexts. ``--attention``
picks the tree attention of our decoder's steps (``sdpa``: the model's attention with the fixed-width mask;
``triton`` / ``cuda``: the tree kernels); ``--acceptance`` the rule inside the step (greedy by
default; ``sample`` and ``typical`` at ``--temperature``, ``sample`` with ``--top-p`` and ``--top-k``); both are
recorded in the JSON. Before the table, a
parity check on tiny models on the same device: the captured decoder's tokens against ``generate``.
Every case catches its own failure and reports it, so one bad case does not lose the others. Needs
only torch + transformers (no Hydra).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medusa_train.decoding import MEDUSA_63  # noqa: E402
from medusa_train.decoding.static import CAPTURES, SDPA_BACKENDS, StaticDecoder  # noqa: E402
from medusa_train.heads import MedusaHeads  # noqa: E402
from tests.helpers.bench import copy_bandwidth, report, sync  # noqa: E402
from tests.helpers.models import llama8b_config, random_heads, random_tree, tiny_model  # noqa: E402

NODES = (1, 4, 16, 64)


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=4096,
    )


def build(
    config: LlamaConfig,
    device: str,
    dtype: torch.dtype,
    projection: str,
    num_heads: int = 4,
    draft_vocab: int | None = None,
):
    """Random backbone (built on the device, in ``dtype``) and heads (copies of its lm_head, sharing it,
    or ``truncated``: copies of its first ``draft_vocab`` rows, which time the same as any other map)."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    token_map = None
    if projection == "truncated":
        token_map = torch.arange(min(draft_vocab or config.vocab_size, config.vocab_size))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
            heads = MedusaHeads(
                config.hidden_size,
                config.vocab_size,
                num_heads=num_heads,
                head_projection=projection,
                token_map=token_map,
            )
    finally:
        torch.set_default_dtype(previous)
    if projection == "shared":
        heads.bind_lm_head(model.get_output_embeddings())
    else:
        heads.init_from_lm_head(model.get_output_embeddings().weight)
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)
    return model, heads.eval()


class StepClock(LogitsProcessor):
    """Stamps the time at each of ``generate``'s decoding steps, once the step's logits are on hand (the
    device synchronised first): the steps between the first token's and the last one's, prefill left
    out, measured directly rather than as the difference of two calls (which a busy machine made
    negative, one slow call sufficing)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.stamps = device, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def generate_ms_per_token(model, ids: torch.Tensor, new: int, repeats: int = 3, **kwargs) -> float:
    """Plain greedy ``generate``: ms per token after the first (the ``new - 1`` steps between the first
    and the last token's logits, :class:`StepClock`), the median of ``repeats`` calls after a warm-up."""
    if new < 2:
        raise ValueError(f"a time per token after the first needs 2 new tokens or more, not {new}")

    def timed() -> float:
        clock = StepClock(ids.device)
        model.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
            logits_processor=LogitsProcessorList([clock]), **kwargs,
        )  # fmt: skip
        return 1000 * (clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1)

    timed()  # warm-up (and, when compiled, compilation)
    return statistics.median(timed() for _ in range(repeats))


def tensor_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def step_floor_bytes(model, heads: MedusaHeads, depth: int, context: int, batch: int) -> int:
    """The least one step reads from memory: every backbone weight (the issue's floor), the heads the
    tree reaches (its depth; shared heads read the lm_head once more), and each row's KV cache over its
    ``context`` columns. A tree step's time over the 1-node step's can at best be the ratio of the two
    floors, whatever the kernels."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element
    used = sum(tensor_bytes(heads.heads[k]) for k in range(depth))
    if depth and heads.head_projection == "shared":
        used += heads.head_weight(0).numel() * element
    return tensor_bytes(model) + used + kv_per_token * context * batch


def static_ms_per_step(
    decoder: StaticDecoder, prompts: list[torch.Tensor], new: int, repeats: int = 1
) -> tuple[float, float]:
    """Our decoder on B prompts: (ms per step after the prefill, median of ``repeats`` calls; tau), after
    a warm-up call of at least three steps (a step emits at most depth + 1 tokens; fewer if ``new`` is
    smaller): a step compiled
    with CUDA graphs (``reduce-overhead``) records its graph on its second run, which must not be timed."""
    decoder.generate_batch(prompts, max_new_tokens=min(new, 3 * (decoder.tree.max_depth + 1)))
    times, tau = [], 0.0
    for _ in range(repeats):
        out = decoder.generate_batch(prompts, max_new_tokens=new)
        times.append(1000 * (out.total_s - out.prefill_s) / max(1, out.num_forwards))
        tau = out.tau
    return statistics.median(times), tau


def parity(device: str, captures: list[str], attention: str = "sdpa") -> list[dict]:
    """Captured decoder vs ``generate`` on tiny fp32 models on ``device`` (one row per capture), the
    steps' tree attention ``attention``."""
    rows = []
    for capture in captures:
        for arch in ("llama", "gpt2"):
            try:
                model = tiny_model(arch).to(device)
                heads = random_heads(model).to(device)
                mode = "reduce-overhead" if capture == "compile" and device == "cuda" else None
                tree = random_tree(1)
                dec = StaticDecoder(
                    model, heads, tree, 128, capture=capture, compile_mode=mode, attention=attention
                )
                batch = StaticDecoder(
                    model,
                    heads,
                    tree,
                    128,
                    batch_size=3,
                    capture=capture,
                    compile_mode=mode,
                    attention=attention,
                )
                same = 0
                prompts, refs = [], []
                for seed in range(3):
                    g = torch.Generator().manual_seed(seed)
                    ids = torch.randint(1, 128, (1, 4 + 5 * seed), generator=g).to(device)
                    ref = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
                    out = dec.generate(ids, max_new_tokens=30)
                    same += out.tokens.tolist() == ref[0, ids.shape[1] :].tolist()
                    prompts.append(ids)
                    refs.append(ref[0, ids.shape[1] :].tolist())
                rows_out = batch.generate_batch(prompts, max_new_tokens=30).rows
                same_rows = sum(r.tokens.tolist() == ref for r, ref in zip(rows_out, refs, strict=True))
                rows.append(
                    {
                        "capture": capture,
                        "attention": attention,
                        "arch": arch,
                        "identical": f"{same}/3",
                        "batch3_rows": f"{same_rows}/3",
                    }
                )
            except Exception as err:  # noqa: BLE001 - report and go on
                rows.append(
                    {
                        "capture": capture,
                        "attention": attention,
                        "arch": arch,
                        "error": f"{type(err).__name__}: {err}",
                    }
                )
                traceback.print_exc()
            print(rows[-1], flush=True)
    return rows


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    results: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "attention": args.attention,
        "acceptance": {
            "rule": args.acceptance,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
        },
        "capture": args.capture or ("cuda_graph" if device.type == "cuda" else "eager"),
        "compile_mode": args.compile_mode,
        "inductor_tuning": args.inductor_tuning,
    }
    captures = [c for c in args.parity_captures if c != "cuda_graph" or device.type == "cuda"]
    results["parity"] = parity(args.device, captures, args.attention)
    dtype = getattr(torch, args.dtype)
    config = tiny_llama_config() if args.tiny else llama8b_config(num_hidden_layers=args.layers)
    if args.inductor_tuning:  # gpt-fast's setting: inductor tunes its generated kernels' launch parameters
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
    t0 = time.perf_counter()
    model, heads = build(config, args.device, dtype, args.head_projection, draft_vocab=args.draft_vocab)
    results["heads"] = {
        "projection": args.head_projection,
        "draft_vocab": heads.draft_vocab_size,
        "bytes": sum(p.numel() * p.element_size() for p in heads.parameters()),
    }
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(device, 1 << (30 if device.type == "cuda" else 26))
    results |= {
        "build_s": time.perf_counter() - t0,
        "weights_gb": weight_bytes / 1e9,
        "copy_gb_s": bw / 1e9,
        "floor_ms": 1000 * weight_bytes / bw,
        "rows": [],
    }
    print(
        f"weights {weight_bytes / 1e9:.2f} GB, copy {bw / 1e9:.0f} GB/s, floor {results['floor_ms']:.2f} ms"
    )
    capture = results["capture"]
    mode = args.compile_mode if capture == "compile" and device.type == "cuda" else None
    for context in args.contexts:
        ids = torch.randint(1, config.vocab_size, (1, context), generator=torch.Generator().manual_seed(1))
        ids = ids.to(device)

        def row(name: str, fn, context: int = context) -> None:
            t = time.perf_counter()
            entry = {"context": context, "decoder": name}
            try:
                entry |= fn()
            except Exception as err:  # noqa: BLE001 - report and go on
                entry["error"] = f"{type(err).__name__}: {err}"
                traceback.print_exc()
            entry["seconds"] = round(time.perf_counter() - t, 1)
            results["rows"].append(entry)
            print(entry, flush=True)

        with torch.inference_mode():
            row(
                "plain eager generate",
                lambda ids=ids: {"ms": generate_ms_per_token(model, ids, args.new_tokens)},
            )
            if context in args.hf_static_contexts:
                hf = {"cache_implementation": "static"}
                if device.type != "cuda":
                    hf["disable_compile"] = True  # transformers compiles on CUDA only
                row(
                    "plain generate static cache" + (" compiled" if device.type == "cuda" else ""),
                    lambda ids=ids, hf=hf: {"ms": generate_ms_per_token(model, ids, args.new_tokens, **hf)},
                )
            for bsz in args.batch_sizes:
                gen = torch.Generator().manual_seed(2)
                prompts = [ids] + [
                    torch.randint(1, config.vocab_size, (1, context), generator=gen).to(device)
                    for _ in range(bsz - 1)
                ]
                for nodes in args.nodes:
                    tree = MEDUSA_63[: nodes - 1]

                    def medusa(tree=tree, context=context, prompts=prompts, bsz=bsz) -> dict:
                        dec = StaticDecoder(
                            model,
                            heads,
                            tree,
                            context + args.new_tokens + len(tree) + 1,
                            batch_size=bsz,
                            capture=capture,
                            compile_mode=mode,
                            sdpa_backend=args.sdpa,
                            attention=args.attention,
                            acceptance=args.acceptance,
                            temperature=args.temperature,
                            top_p=args.top_p,
                            top_k=args.top_k,
                        )
                        ms, tau = static_ms_per_step(dec, prompts, args.new_tokens, args.repeats)
                        del dec
                        depth = max((len(path) for path in tree), default=0)
                        floor_bytes = step_floor_bytes(model, heads, depth, context, bsz)
                        return {"ms": ms, "tau": tau, "batch": bsz, "step_floor_ms": 1000 * floor_bytes / bw}

                    kind = capture if args.attention == "sdpa" else f"{capture} {args.attention}"
                    kind += "" if args.acceptance == "greedy" else f" {args.acceptance}"
                    row(f"static {kind} batch {bsz}, {nodes} node{'s' if nodes > 1 else ''}", medusa)

    results["table"] = markdown(results)
    return results


def markdown(results: dict) -> str:
    floor = results["floor_ms"]
    lines = [
        f"device {results['device']}, tree attention {results['attention']}, capture {results['capture']}: weights "
        f"{results['weights_gb']:.2f} GB, copy {results['copy_gb_s']:.0f} GB/s, floor {floor:.2f} ms",
        f"heads: {results['heads']['projection']} projections over {results['heads']['draft_vocab']} tokens, "
        f"{results['heads']['bytes'] / 1e9:.2f} GB",
        "",
        "x plain: the step's time over the 1-node step's at the same batch and context (the tau at which",
        "Medusa breaks even). step floor: what the step must read (weights, the heads its tree reaches,",
        "every row's KV cache) at the copy bandwidth; floor x plain: its step floor over the 1-node step's,",
        "the least x plain can be.",
        "",
        "| context | decoder | ms per token/step | x floor | x plain | step floor ms | x step floor "
        "| floor x plain | tau | seconds |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ones = [
        r for r in results["rows"] if "batch" in r and "error" not in r and r["decoder"].endswith(" 1 node")
    ]
    plain = {(r["context"], r["batch"]): r["ms"] for r in ones}
    plain_floor = {(r["context"], r["batch"]): r["step_floor_ms"] for r in ones}
    for r in results["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['context']} | {r['decoder']} | failed: {r['error'][:80]} | | | | | | | {r['seconds']} |"
            )
            continue
        tau = f"{r['tau']:.2f}" if "tau" in r else ""
        base = plain.get((r["context"], r.get("batch")))
        vs = f"{r['ms'] / base:.2f}" if base else ""
        own = r.get("step_floor_ms")
        base_floor = plain_floor.get((r["context"], r.get("batch")))
        step = f"{own:.2f} | {r['ms'] / own:.2f} | " if own else " | | "
        step += f"{own / base_floor:.2f}" if own and base_floor else ""
        lines.append(
            f"| {r['context']} | {r['decoder']} | {r['ms']:.2f} | {r['ms'] / floor:.2f} | {vs} | {step} | {tau} | "
            f"{r['seconds']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the 8B shape (dry run)")
    p.add_argument("--layers", type=int, default=32, help="8B shape with fewer layers (dry runs only)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--nodes", type=int, nargs="+", default=list(NODES), help="tree sizes (1..64)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="rows of the static decoder"
    )
    p.add_argument("--capture", choices=CAPTURES, default=None, help="default: cuda_graph on CUDA")
    p.add_argument("--sdpa", choices=SDPA_BACKENDS, default=None, help="SDPA backend (default: torch's)")
    p.add_argument(
        "--attention",
        choices=("sdpa", "triton", "cuda"),
        default="sdpa",
        help="tree attention of our decoder's steps: the model's SDPA with a mask, or a tree kernel",
    )
    p.add_argument(
        "--acceptance",
        choices=("greedy", "sample", "typical"),
        default="greedy",
        help="acceptance rule inside our decoder's step (sample: exact sampling, a draw per node)",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="of --acceptance sample and typical")
    p.add_argument("--top-p", type=float, default=1.0, help="of --acceptance sample")
    p.add_argument("--top-k", type=int, default=0, help="of --acceptance sample (0: none)")
    p.add_argument(
        "--head-projection",
        choices=("own", "shared", "truncated"),
        default="own",
        help="the heads' vocabulary projections: own copies of the lm_head, the lm_head itself, or "
        "truncated to --draft-vocab tokens",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=32768,
        help="tokens of truncated heads (--head-projection truncated)",
    )
    p.add_argument(
        "--compile-mode",
        default="reduce-overhead",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        help="torch.compile mode of --capture compile on CUDA (reduce-overhead and max-autotune add CUDA graphs)",
    )
    p.add_argument(
        "--inductor-tuning",
        action="store_true",
        help="inductor's coordinate-descent tuning of its generated kernels (for --capture compile and "
        "transformers' compiled static cache)",
    )
    p.add_argument(
        "--hf-static-contexts",
        type=int,
        nargs="*",
        default=[512],
        help="contexts at which to run transformers' static-cache generate (each compiles, ~1 min on CUDA)",
    )
    p.add_argument(
        "--parity-captures", nargs="*", default=["eager", "cuda_graph"], choices=CAPTURES, help="tiny checks"
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="timed calls per case of our decoder (their median)"
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.draft_vocab < 1:
        p.error(f"--draft-vocab must be >= 1, got {args.draft_vocab}")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        p.error(
            "need --temperature >= 0, 0 < --top-p <= 1 and --top-k >= 0, got "
            f"{args.temperature}, {args.top_p} and {args.top_k}"
        )
    if not all(1 <= n <= len(MEDUSA_63) + 1 for n in args.nodes):
        p.error(f"--nodes must be in 1..{len(MEDUSA_63) + 1}")
    limit = (tiny_llama_config() if args.tiny else llama8b_config()).max_position_embeddings
    too_long = [c for c in args.contexts if c + args.new_tokens + max(args.nodes) > limit]
    if too_long:  # the decoders would stop at once (nothing left to generate) and time nothing
        p.error(
            f"--contexts {too_long}: context + --new-tokens + tree nodes must fit the model's "
            f"{limit} positions; give at most {limit - args.new_tokens - max(args.nodes)}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
