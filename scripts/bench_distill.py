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

``--library`` also times transformers' own continuous batching (``model.generate_batch``, paged
attention, ``max_requests_per_batch`` = the largest batch size) on the same prompts, and checks both
engines' greedy replies against unbatched ``model.generate`` on the first ``--parity-prompts``.

``--server`` also measures ``distill.engine=server`` (:class:`medusa_train.engines.server.ServerEngine`,
chat API): the script starts ``transformers serve`` on 127.0.0.1 (with and without its
``--continuous-batching``), sends the same first turns at each ``--concurrency``, and reports
records/s, tokens/s and how many replies equal the in-process ones (the server and this client
share the machine's cores).

``--step-contexts 16 128`` also measures the ceiling that bounds the ratio: the cost of one decode
step with every row busy, no prefill and no finished rows (each batch size runs ``batch`` requests of
the given context length for ``--step-tokens`` tokens, minus the same run for one token), so that
``batch x step(1) / step(batch)`` is the best tokens/s ratio continuous batching could reach.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from medusa_train.backbone import load_backbone
from medusa_train.data.chat import ChatRenderer, eos_token_ids
from medusa_train.data.embedded import embedded_prompts
from medusa_train.data.sources import Conversation
from medusa_train.engines.base import GenRequest
from medusa_train.engines.inprocess import ContinuousBatcher
from medusa_train.engines.server import ServerClient, ServerEngine, reply_end_id


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


def library_batch(model, prompts: list[list[int]], eos: list[int], pad_id: int, batch: int, max_new: int):
    """``model.generate_batch`` (transformers' continuous batching): replies by prompt index, seconds.

    The paged cache is sized for the job (``batch`` rows of the longest prompt + ``max_new`` tokens,
    pages of 256 tokens, 2,048 tokens per forward at most): left to its defaults on a CPU it sizes
    itself from free RAM and zero-fills gigabytes per call (measured: 12 of 18 s for 16 prompts).
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=pad_id)
    pages = -(-(max(len(p) for p in prompts) + max_new) // 256)
    cb = ContinuousBatchingConfig(
        max_requests_per_batch=batch, num_blocks=batch * pages + batch, max_batch_tokens=2048
    )
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb)
    seconds = time.perf_counter() - start
    replies = {}
    for i in range(len(prompts)):
        ids = list(out[f"req_{i}"].generated_tokens)
        end = next((j + 1 for j, t in enumerate(ids) if t in eos), len(ids))
        replies[i] = ids[:end]
    return replies, seconds


def generate_reference(model, prompts: list[list[int]], eos: list[int], pad_id: int, max_new: int) -> dict:
    """Unbatched, unpadded greedy ``model.generate`` per prompt (the parity reference)."""
    import torch

    replies = {}
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
            eos_token_id=eos, pad_token_id=pad_id,
        )[0, len(p) :].tolist()  # fmt: skip
        end = next((j + 1 for j, t in enumerate(out) if t in eos), len(out))
        replies[i] = out[:end]
    return replies


def server_rows(model_dir: str, tok, convs, prompts, eos, reference, args) -> list[dict]:
    """Records/s and tokens/s through ``transformers serve`` (with and without --continuous-batching)."""
    renderer = ChatRenderer(tok)
    rows = []
    for cb in (False, True):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [
            str(Path(sys.executable).parent / "transformers"), "serve", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--dtype", args.dtype,
        ]  # fmt: skip
        if cb:  # its paged cache sized for the job, as in library_batch (else it sizes itself from free RAM)
            pages = -(-(max(len(p) for p in prompts) + args.max_new_tokens) // 256)
            blocks = max(args.concurrency) * (pages + 1)
            cmd += ["--continuous-batching", "--cb-num-blocks", str(blocks), "--cb-max-batch-tokens", "2048"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": tempfile.mkdtemp()}
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    time.sleep(0.2)
            url = f"http://127.0.0.1:{port}/v1"
            for concurrency in args.concurrency:
                engine = ServerEngine(
                    ServerClient([url], timeout_s=600, max_retries=2),
                    model=model_dir, tokenizer=tok, api="chat", max_new_tokens=args.max_new_tokens,
                    eos_ids=eos, end_id=reply_end_id(tok, eos), concurrency=concurrency,
                )  # fmt: skip
                requests = [
                    GenRequest(i, p, None, renderer.messages(c, [], True))
                    for i, (c, p) in enumerate(zip(convs, prompts, strict=True))
                ]
                warm = requests[: 2 * concurrency]
                engine.run(warm, lambda req, new: None)
                replies: dict[int, list[int] | None] = {}
                start = time.perf_counter()
                engine.run(requests, lambda req, new, out=replies: out.__setitem__(req.key, new))
                seconds = time.perf_counter() - start
                tokens = sum(len(r or []) for r in replies.values())
                rows.append(
                    {
                        "engine": "transformers serve" + (" --continuous-batching" if cb else ""),
                        "concurrency": concurrency,
                        "records": len(replies),
                        "tokens": tokens,
                        "seconds": round(seconds, 3),
                        "records_per_s": round(len(replies) / seconds, 2),
                        "tokens_per_s": round(tokens / seconds, 1),
                        "replies_equal_inprocess": sum(replies[k] == reference[k] for k in reference),
                        "not_round_trip": engine.stats["not_round_trip"],
                        "token_count_differs": engine.stats["token_count_differs"],
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress; --json stays one object
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rows


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
    parser.add_argument("--library", action="store_true", help="also time model.generate_batch (see above)")
    parser.add_argument("--parity-prompts", type=int, default=32, help="prompts checked against generate")
    parser.add_argument("--server", action="store_true", help="also time transformers serve (see above)")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4, 16], help="server requests in flight"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    model, tok = load_backbone(args.model, dtype=args.dtype, device=args.device)
    renderer = ChatRenderer(tok)
    eos = eos_token_ids(model, tok)
    convs = [
        Conversation(f"embedded:{i}", [c[0]["content"]])
        for i, c in enumerate(embedded_prompts("eval", args.prompts, seed=0))
    ]
    prompts = [renderer.prompt_ids(c) for c in convs]

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
    library: dict = {"seconds": [], "replies": None}
    if args.library:
        library_batch(model, prompts[:8], eos, tok.pad_token_id, max(args.batch_sizes), 8)  # warm-up
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every size alike
        for bs in args.batch_sizes:
            start = time.perf_counter()
            results[bs] = generate(bs, prompts)
            timings[bs].append(time.perf_counter() - start)
        if args.library:
            replies, seconds = library_batch(
                model, prompts, eos, tok.pad_token_id, max(args.batch_sizes), args.max_new_tokens
            )
            library["seconds"].append(seconds)
            library["replies"] = replies
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
    extra = {}
    ours = results[max(args.batch_sizes)][0]
    if args.library:
        seconds = statistics.median(library["seconds"])
        theirs = library["replies"]
        n = min(args.parity_prompts, len(prompts))
        ref = generate_reference(model, prompts[:n], eos, tok.pad_token_id, args.max_new_tokens)
        extra["library"] = {
            "batch_size": max(args.batch_sizes),
            "tokens": sum(len(r) for r in theirs.values()),
            "seconds": round(seconds, 3),
            "seconds_all": [round(t, 3) for t in library["seconds"]],
            "tokens_per_s": round(sum(len(r) for r in theirs.values()) / seconds, 1),
            "replies_equal_ours": sum(theirs[k] == ours[k] for k in ours),
            "parity_prompts": n,
            "library_equal_generate": sum(theirs[k] == ref[k] for k in ref),
            "ours_equal_generate": sum(ours[k] == ref[k] for k in ref),
        }
    if args.server:
        extra["server"] = server_rows(args.model, tok, convs, prompts, eos, ours, args)
    result = {
        "model": args.model,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "rows": rows,
        "step_ceiling": ceilings,
        **extra,
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
    if "library" in extra:
        lib = extra["library"]
        print(
            f"model.generate_batch (batch {lib['batch_size']}): {lib['tokens']} tokens, {lib['seconds']:.2f} s, "
            f"{lib['tokens_per_s']:.1f} tokens/s; replies equal ours {lib['replies_equal_ours']}/{len(ours)}; "
            f"equal to generate on {lib['parity_prompts']}: library {lib['library_equal_generate']}, "
            f"ours {lib['ours_equal_generate']}"
        )
    for r in extra.get("server", []):
        print(
            f"{r['engine']}, concurrency {r['concurrency']}: {r['records_per_s']:.2f} records/s, "
            f"{r['tokens_per_s']:.1f} tokens/s, {r['replies_equal_inprocess']}/{r['records']} replies equal in-process"
        )
    for c in ceilings:
        steps = ", ".join(
            f"batch {b}: {ms:.2f} ms ({c['ceiling_vs_first'][b]:.2f}x)" for b, ms in c["step_ms"].items()
        )
        print(f"full-batch decode step, context {c['context']}: {steps}")


if __name__ == "__main__":
    main()
