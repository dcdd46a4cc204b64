"""Check an export through transformers' ``model.generate(custom_generate=<export>, trust_remote_code=True)``.

Run as:
    # an export of this pipeline (its base model: export/backbone, else medusa/config.json's, else --model)
    python scripts/check_custom_generate.py --export runs/default/export --device cuda
    python scripts/check_custom_generate.py --export runs/default/export --model runs/default/pretrain --device cpu
    # a workdir copied from another machine (the export names the base by its path there)
    python scripts/check_custom_generate.py --export WD/export --model WD/pretrain --device cuda
    # no export at hand: a tiny random Llama + random heads exported to a temporary folder (CPU dry run)
    python scripts/check_custom_generate.py --tiny --device cpu

An export without ``custom_generate/`` is checked on a temporary copy with that folder written in.
The temporary folder (that copy, the ``--tiny`` export, a distribution record) is removed when the
script ends, whether the cases passed, failed or raised: the output names no path inside it. The four
prompts are user turns in the tokenizer's chat template where it has one (the text heads of a chat
model are trained on), plain text with ``--raw-prompts``.

Cases, each caught and reported on its own (one failing case does not hide the others):
``greedy`` (each prompt alone: identical to plain greedy ``generate``), ``batch`` (the prompts as one
left-padded batch: each row identical to its own plain greedy ``generate``; equality with plain
batched ``generate`` is reported too), ``sample`` and ``typical`` (they run and keep the prompt),
``mismatch`` (a model of another hidden size is refused with a ValueError), ``static`` (greedy, the
batch and sampling again with ``cache_implementation="static"``: the static-shape decoder, its step
one CUDA graph on a GPU), and the wall-clock tokens/s over the greedy prompts of plain ``generate``, the tree decoder,
plain ``generate`` with its static cache (compiled by transformers on a GPU) and the static-shape
tree decoder, each after an untimed call that compiles or captures it. Prints one JSON object; exit code 1 when a case failed.
Needs torch + transformers + medusa_train only (no Hydra): transformers checks
``custom_generate/requirements.txt``, so a medusa_train that is importable but not pip-installed is
given a minimal distribution record in a temporary folder (said in the output).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import medusa_train  # noqa: E402
from medusa_train.custom_generate import FOLDER, write_custom_generate  # noqa: E402
from medusa_train.formats import save_medusa  # noqa: E402
from medusa_train.heads_layout import MEDUSA, read_heads_config  # noqa: E402
from medusa_train.workdir import CHOICES, TRAINED_BACKBONE  # noqa: E402
from tests.helpers.models import build_tiny_backbone, random_heads, tiny_model  # noqa: E402

PROMPTS = [
    "the cat sat on the mat and",
    "tell me a story about a big red dog",
    "why is the sun",
    "write a list of three happy things: one",
]


def render(tok, text: str) -> str:
    """``text`` as a user turn in the tokenizer's chat template, ready for the assistant's reply: what
    a chat model's heads are trained on (a raw prompt may draw an end-of-turn within a few tokens)."""
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def ensure_distribution_record(tmp: Path) -> str | None:
    """Make ``importlib.metadata`` find medusa_train when it is importable but not installed; returns a note."""
    try:
        importlib.metadata.version("medusa_train")
        return None
    except importlib.metadata.PackageNotFoundError:
        record = tmp / "site" / f"medusa_train-{medusa_train.__version__}.dist-info"
        record.mkdir(parents=True)
        (record / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: medusa_train\nVersion: {medusa_train.__version__}\n"
        )
        sys.path.append(str(record.parent))
        importlib.invalidate_caches()
        return "medusa_train is not pip-installed here: a temporary distribution record was put on sys.path"


def tiny_export(tmp: Path) -> tuple[Path, Path]:
    """A tiny random backbone and an export of random heads for it (``medusa/``, tree, custom_generate/)."""
    backbone = build_tiny_backbone(tmp / "base_model")
    model = AutoModelForCausalLM.from_pretrained(backbone)
    heads = random_heads(model, num_heads=3, std=0.05)
    heads.base_model_name_or_path = str(backbone)
    export = tmp / "export"
    save_medusa(heads, export / MEDUSA)
    (export / CHOICES).write_text(json.dumps([[0], [0, 0], [1], [0, 0, 0], [0, 1]]))
    write_custom_generate(export, export)
    return export, backbone


def base_of(export: Path, model: str | None) -> str:
    """The base model to load: ``--model``, the export's Medusa-2 backbone, else the heads' recorded base."""
    if model:
        return model
    if (export / TRAINED_BACKBONE).is_dir():
        return str(export / TRAINED_BACKBONE)
    name = read_heads_config(export / MEDUSA).get("base_model_name_or_path")
    if not name:
        raise SystemExit(f"{export / MEDUSA}/config.json names no base model: pass --model")
    return name


def run_case(results: dict, name: str, case) -> None:
    """``results[name]`` = the case's dict (``ok`` True/False) or its exception."""
    t0 = time.perf_counter()
    try:
        out = case()
    except Exception as err:  # report and go on with the other cases
        out = {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}
    out["seconds"] = round(time.perf_counter() - t0, 3)
    results[name] = out
    print(f"{name}: {'ok' if out['ok'] else 'FAILED'} {out.get('error', '')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--export", type=Path, help="an export folder (stage=export)")
    parser.add_argument(
        "--tiny", action="store_true", help="build a tiny random export in a temporary folder"
    )
    parser.add_argument("--model", help="the base model (default: from the export)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument(
        "--raw-prompts",
        action="store_true",
        help="encode the prompts as plain text even where the tokenizer has a chat template",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if not args.tiny and args.export is None:
        parser.error("give --export DIR or --tiny")

    tmp = Path(tempfile.mkdtemp(prefix="check_custom_generate_"))
    try:
        return check(args, tmp)
    finally:  # nothing is left behind in the temporary directory, nor on sys.path for a caller in-process
        sys.path[:] = [entry for entry in sys.path if not Path(entry).is_relative_to(tmp)]
        shutil.rmtree(tmp, ignore_errors=True)


def check(args: argparse.Namespace, tmp: Path) -> int:
    """The cases of the module docstring for the parsed ``args``, with ``tmp`` as scratch space (its
    caller removes it); returns the exit code."""
    results: dict = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__}
    results["transformers"] = __import__("transformers").__version__
    note = ensure_distribution_record(tmp)
    if note:
        results["note"] = note
        print(note, flush=True)
    if args.tiny:
        export, base = tiny_export(tmp)
        base = str(base)
        results.update(export="--tiny (temporary)", base="--tiny (temporary)")
    else:
        export, base = args.export.resolve(), base_of(args.export.resolve(), args.model)
        results.update(export=str(export), base=base)
        if not (export / FOLDER / "generate.py").is_file():  # an export without the folder: check a copy
            copy = tmp / "export"
            shutil.copytree(export, copy, ignore=shutil.ignore_patterns(TRAINED_BACKBONE))
            if (export / TRAINED_BACKBONE).is_dir():
                (copy / TRAINED_BACKBONE).symlink_to(export / TRAINED_BACKBONE)
            write_custom_generate(copy, copy)
            results["note_export"] = (
                f"{export} has no {FOLDER}/: checked a temporary copy with it written in (removed at the end)"
            )
            print(results["note_export"], flush=True)
            export = copy
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    model = (
        AutoModelForCausalLM.from_pretrained(base, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    )
    tok = AutoTokenizer.from_pretrained(base)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    n = args.max_new_tokens

    def medusa(**kwargs) -> torch.Tensor:
        return model.generate(**kwargs, custom_generate=str(export), trust_remote_code=True)

    templated = tok.chat_template is not None and not args.raw_prompts
    results["chat_template"] = templated
    texts = [render(tok, text) if templated else text for text in PROMPTS]

    def encode(text: str | list[str], **kwargs) -> dict:
        # a rendered template carries its own special tokens (a BOS would be doubled)
        ids = tok(text, return_tensors="pt", add_special_tokens=not templated, **kwargs)
        return {k: v.to(device) for k, v in ids.items()}

    def plain(inputs: dict, **extra) -> torch.Tensor:
        return model.generate(
            **inputs, do_sample=False, max_new_tokens=n, pad_token_id=tok.pad_token_id, **extra
        )

    def greedy(**extra) -> dict:
        same = []
        for text in texts:
            inputs = encode(text)
            ours = medusa(**inputs, max_new_tokens=n, pad_token_id=tok.pad_token_id, **extra)
            same.append(bool(torch.equal(ours, plain(inputs))))
        return {"ok": all(same), "identical": same}

    def batch(**extra) -> dict:
        inputs = encode(texts, padding=True)
        width = inputs["input_ids"].shape[1]
        ours = medusa(**inputs, max_new_tokens=n, pad_token_id=tok.pad_token_id, **extra)
        batched = plain(inputs)
        rows = []
        for i, text in enumerate(texts):
            alone = plain(encode(text))[0, encode(text)["input_ids"].shape[1] :].tolist()
            row = ours[i, width:].tolist()
            rows.append(row[: len(alone)] == alone and all(t == tok.pad_token_id for t in row[len(alone) :]))
        return {"ok": all(rows), "rows_identical_to_own_generate": rows,
                "identical_to_batched_generate": bool(torch.equal(ours, batched))}  # fmt: skip

    def sampled(**extra) -> dict:
        inputs = encode(texts[0])
        width = inputs["input_ids"].shape[1]
        out = medusa(**inputs, max_new_tokens=n, do_sample=True, temperature=0.8, top_p=0.9, **extra)
        ok = (
            out.shape[0] == 1
            and width < out.shape[1] <= width + n
            and torch.equal(out[:, :width], inputs["input_ids"])
        )
        return {"ok": bool(ok), "new_tokens": out.shape[1] - width}

    def mismatch() -> dict:
        vocab = model.get_output_embeddings().weight.shape[0]
        hidden = model.get_output_embeddings().weight.shape[1]
        other = tiny_model(hidden=2 * hidden if hidden <= 64 else 32, vocab=vocab).to(device)
        try:
            other.generate(
                **encode(texts[0]), custom_generate=str(export), trust_remote_code=True, max_new_tokens=4
            )
        except ValueError as err:
            return {"ok": "do not belong to this model" in str(err), "message": str(err)}
        return {"ok": False, "error": "no ValueError for a model of another hidden size"}

    def static() -> dict:
        alone, rows = greedy(cache_implementation="static"), batch(cache_implementation="static")
        sampling = sampled(cache_implementation="static")
        return {
            "ok": alone["ok"] and rows["ok"] and sampling["ok"],
            **alone,
            **{k: v for k, v in rows.items() if k != "ok"},
            "sample_new_tokens": sampling["new_tokens"],
        }

    def timing() -> dict:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        static = {"cache_implementation": "static"}
        calls = {
            "plain": lambda inputs: plain(inputs),
            "custom_generate": lambda inputs: medusa(**inputs, max_new_tokens=n),
            "plain_static": lambda inputs: plain(inputs, **static),
            "custom_generate_static": lambda inputs: medusa(**inputs, max_new_tokens=n, **static),
        }
        longest = encode(max(texts, key=lambda text: len(tok(text)["input_ids"])))
        for call in calls.values():  # compile / capture outside the timed calls, for the longest prompt
            call(longest)
        totals = {name: [0, 0.0] for name in calls}
        for text in texts:
            inputs = encode(text)
            for name, call in calls.items():
                sync()
                t0 = time.perf_counter()
                out = call(inputs)
                sync()
                totals[name][0] += out.shape[1] - inputs["input_ids"].shape[1]
                totals[name][1] += time.perf_counter() - t0
        tps = {name: tokens / max(1e-9, s) for name, (tokens, s) in totals.items()}
        return {
            "ok": True,
            "tokens_per_s": tps,
            "speedup": tps["custom_generate"] / max(1e-9, tps["plain"]),
            "speedup_static": tps["custom_generate_static"] / max(1e-9, tps["plain_static"]),
        }

    medusa(**encode(texts[0]), max_new_tokens=4)  # warm-up: loads the module, the heads and kernels
    plain(encode(texts[0]))
    run_case(results, "greedy", greedy)
    run_case(results, "batch", batch)
    run_case(results, "sample", sampled)
    run_case(results, "typical", lambda: sampled(medusa_acceptance="typical"))
    run_case(results, "mismatch", mismatch)
    run_case(results, "static", static)
    run_case(results, "timing", timing)
    cases = [k for k, v in results.items() if isinstance(v, dict) and "ok" in v]
    results["ok"] = all(results[k]["ok"] for k in cases)
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
