"""stage=distill: self-distilled training data from the frozen backbone.

Run as:
    python -m medusa_train stage=distill                                  # embedded backbone + prompts, CPU
    python -m medusa_train stage=distill model=hf model.name_or_path=lmsys/vicuna-7b-v1.3 \\
        data=sharegpt data.path=sharegpt.json distill.temperature=0.7
    torchrun --nproc_per_node 8 -m medusa_train stage=distill model=hf ...   # data-parallel, one GPU per rank

Steps (every rank):
    1. read the source (``data=``): a missing file or bad format fails here, before any model loads;
    2. if ``workdir/distill`` is already complete with the same settings, return its figures;
    3. load the frozen backbone, render every first prompt with the chat template, apply the
       long-prompt rule (``data.max_prompt_tokens``, ``data.long_prompts``);
    4. rank 0 checks ``distill/progress.json`` (same backbone fingerprint, tokenizer, generation
       settings and data?) and refuses a mismatch unless ``distill.overwrite=true`` (clears the folder);
    5. records, in source order, form shards of ``distill.shard_size``; rank r owns the shards with
       ``index % world_size == r``, skips those already on disk, regenerates the others
       (:mod:`medusa_train.data.regenerate` over :mod:`medusa_train.engines.inprocess`) and writes each to a temp file renamed atomically to
       ``shards/shard-{index:05d}.arrow`` — so a run killed at any moment (SIGKILL included) and
       restarted with the same command ends with every record exactly once, and the result does not
       depend on the number of ranks;
    6. rank 0 writes ``manifest.json`` (format: :mod:`medusa_train.data.distilled`).

Several ranks synchronise through a gloo process group (created only when WORLD_SIZE > 1): one
broadcast after step 4 and one gather before step 6.

Context limits: the first prompt may hold at most ``min(data.max_prompt_tokens,
max_position_embeddings - distill.max_new_tokens)`` tokens (longer ones are skipped with a count, or
left-truncated with ``data.long_prompts=truncate``); a later turn whose context would exceed that
limit is not answered, the conversation ends with the previous reply (counted as turns dropped).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from medusa_train.backbone import backbone_identity, check_backbone_source
from medusa_train.data.distilled import MANIFEST, SHARDS
from medusa_train.data.sources import Conversation, ReadResult, read_records
from medusa_train.errors import UserError
from medusa_train.stages import load_configured_backbone
from medusa_train.tracking import start_tracking
from medusa_train.workdir import Workdir

log = logging.getLogger(__name__)

PROGRESS = "progress.json"
FORMAT_VERSION = 1
_STATS_KEY = b"medusa_distill"  # per-shard counts in the Arrow schema metadata


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


@dataclass
class _Plan:
    """What this invocation distills: shared by the generation (step 5) and the manifest (step 6)."""

    cfg: object
    out: Path
    source: ReadResult
    records: list[Conversation]
    prompts: list[list[int]]
    long_skipped: list
    eos_ids: list[int]
    max_context: int
    identity: dict
    settings: dict
    quick: dict
    num_shards: int


def run(cfg) -> dict:
    """Regenerate every assistant turn of the data source with the frozen backbone (see module docstring)."""
    out = Workdir(Path(cfg.workdir)).distill
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    # 1. the source: fails on a missing / unreadable file before the model loads
    source = _read_source(cfg)
    if rank == 0:
        source.log_warning(log)
    check_backbone_source(cfg.model.name_or_path)
    quick = _quick_settings(cfg, source)

    # 2. already complete with these settings?
    manifest = _complete_manifest(out, quick)
    if manifest is not None:
        if rank == 0:
            log.info(
                "distill: %s is complete with these settings (%d records); nothing to do",
                out,
                manifest["counts"]["records"],
            )
        return _figures(manifest, generated_now=0, resumed=True)

    # 3. backbone, prompts, long-prompt rule
    model, tokenizer = load_configured_backbone(cfg.model)
    from medusa_train.data.chat import ChatRenderer, eos_token_ids

    renderer = ChatRenderer(tokenizer)
    eos_ids = eos_token_ids(model, tokenizer)
    max_context = _max_context(cfg, model)
    records, prompts, long_skipped = _prepare_prompts(cfg, renderer, source.records, max_context)
    if not records:
        raise UserError(
            f"every prompt is longer than {max_context} tokens: raise data.max_prompt_tokens or use data.long_prompts=truncate"
        )
    identity = backbone_identity(model, cfg.model.name_or_path, cfg.model.revision)
    settings = _full_settings(cfg, quick, identity, tokenizer, eos_ids, max_context, prompts)
    num_shards = -(-len(records) // cfg.distill.shard_size)

    # 4. folder check / preparation on rank 0, decision shared with every rank
    created_group = _init_process_group(world)
    error = None
    if rank == 0:
        try:
            _prepare_folder(out, settings, quick, num_shards, cfg.distill.overwrite)
        except UserError as err:
            error = str(err)
    error = _broadcast(error, world)
    if error:
        _destroy_process_group(created_group)
        raise UserError(error)

    # 5. this rank's shards
    plan = _Plan(
        cfg,
        out,
        source,
        records,
        prompts,
        long_skipped,
        eos_ids,
        max_context,
        identity,
        settings,
        quick,
        num_shards,
    )
    tracker = start_tracking(cfg.tracking, cfg.workdir, "distill", asdict(cfg)) if rank == 0 else None
    try:
        stats = _distill_shards(plan, model, renderer, rank, world, tracker)
        all_stats = _gather(stats, world)
        # 6. one manifest, written by rank 0 once every shard is on disk
        if rank == 0:
            manifest = _write_manifest(plan, tokenizer, all_stats, world)
        _barrier(world)
        if rank != 0:
            manifest = json.loads((out / MANIFEST).read_text())
        figures = _figures(manifest, generated_now=sum(s["tokens"] for s in all_stats), resumed=False)
        if tracker is not None:
            tracker.summary({f"distill/{k}": v for k, v in figures.items() if isinstance(v, int | float)})
    finally:
        if tracker is not None:
            tracker.finish()
        _destroy_process_group(created_group)
    return figures


# ----------------------------------------------------------------------------------------------
# 1-3: source, settings, prompts


def _read_source(cfg) -> ReadResult:
    d = cfg.data
    return read_records(
        d.format,
        d.path,
        prompt_key=d.prompt_key,
        text_prompt_chars=d.text_prompt_chars,
        strict=d.strict,
        name=d.name,
        subset=d.subset,
        split=d.split,
        hub_format=d.hub_format,
        max_records=d.max_records,
        num_prompts=d.num_prompts,
        seed=cfg.seed,
    )


def _records_hash(records: list[Conversation]) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r.source_id, r.system, r.turns]).encode())
    return h.hexdigest()[:16]


def _backbone_files_signature(name_or_path: str) -> str | None:
    """Names, sizes and mtimes of a local model directory (cheap); None for a hub id."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.relative_to(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _generation_settings(cfg) -> dict:
    g = cfg.distill
    sampled = g.temperature > 0
    return {
        "max_new_tokens": g.max_new_tokens,
        "temperature": g.temperature,
        "top_p": g.top_p if sampled else None,
        "seed": g.seed if sampled else None,
        "shard_size": g.shard_size,
    }


def _data_settings(cfg, source: ReadResult) -> dict:
    d = cfg.data
    return {
        "format": d.format,
        "path": str(Path(d.path).expanduser().resolve()) if d.path else None,
        "name": d.name,
        "subset": d.subset,
        "split": d.split,
        "hub_format": d.hub_format,
        "prompt_key": d.prompt_key,
        "text_prompt_chars": d.text_prompt_chars,
        "max_records": d.max_records,
        "num_prompts": d.num_prompts,
        "max_prompt_tokens": d.max_prompt_tokens,
        "long_prompts": d.long_prompts,
        "records_read": len(source.records),
        "records_hash": _records_hash(source.records),
    }


def _quick_settings(cfg, source: ReadResult) -> dict:
    """What can be checked without loading the model (decides the early return of a complete folder)."""
    return {
        "backbone_source": {
            "name_or_path": cfg.model.name_or_path,
            "revision": cfg.model.revision,
            "files": _backbone_files_signature(cfg.model.name_or_path),
        },
        "dtype": cfg.model.dtype,
        "quantization": cfg.model.quantization,
        "generation": _generation_settings(cfg),
        "data": _data_settings(cfg, source),
    }


def _max_context(cfg, model) -> int:
    limit = cfg.data.max_prompt_tokens
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions:
        room = positions - cfg.distill.max_new_tokens
        if room <= 0:
            raise UserError(
                f"distill.max_new_tokens={cfg.distill.max_new_tokens} leaves no room for a prompt in the "
                f"backbone's {positions}-token context: lower it"
            )
        limit = min(limit, room)
    return limit


def _prepare_prompts(
    cfg, renderer, records: list[Conversation], max_context: int
) -> tuple[list[Conversation], list[list[int]], list[str]]:
    """First-turn prompt ids; prompts over ``max_context`` tokens are skipped or left-truncated."""
    kept, prompts, skipped = [], [], []
    for conv in records:
        ids = renderer.prompt_ids(conv)
        if len(ids) > max_context:
            if cfg.data.strict:
                raise UserError(
                    f"record {conv.source_id}: prompt of {len(ids)} tokens is longer than {max_context} "
                    "(data.max_prompt_tokens / the model context; data.strict=true)"
                )
            if cfg.data.long_prompts == "skip":
                skipped.append(conv.source_id)
                continue
            ids = ids[-max_context:]
        kept.append(conv)
        prompts.append(ids)
    if skipped and int(os.environ.get("RANK", "0")) == 0:
        shown = ", ".join(skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        log.warning(
            "skipped %d records whose prompt is longer than %d tokens (%s); data.long_prompts=truncate keeps them",
            len(skipped),
            max_context,
            shown,
        )
    return kept, prompts, skipped


def _full_settings(
    cfg, quick: dict, identity: dict, tokenizer, eos_ids: list[int], max_context: int, prompts
) -> dict:
    """What a resumed run must share with the interrupted one (the backbone by fingerprint, not by path)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(p).encode())
    return {
        "format_version": FORMAT_VERSION,
        "backbone_fingerprint": identity["fingerprint"],
        "dtype": quick["dtype"],
        "quantization": quick["quantization"],
        "tokenizer": _tokenizer_info(tokenizer, eos_ids),
        "generation": quick["generation"],
        "data": {
            **quick["data"],
            "path": None,
            "prompts_hash": h.hexdigest()[:16],
            "max_context": max_context,
        },
    }


def _tokenizer_info(tokenizer, eos_ids: list[int]) -> dict:
    return {
        "name_or_path": str(tokenizer.name_or_path),
        "vocab_size": len(tokenizer),
        "eos_token_ids": eos_ids,
        "pad_token_id": tokenizer.pad_token_id,
        "chat_template_sha256": hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:16],
    }


# ----------------------------------------------------------------------------------------------
# 2/4: the folder


def _complete_manifest(out: Path, quick: dict) -> dict | None:
    """The manifest if ``out`` is complete with the same quick settings, else None."""
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if manifest.get("quick_settings") != quick:
        return None
    shards = out / SHARDS
    if all((shards / shard_name(i)).is_file() for i in range(manifest["num_shards"])):
        return manifest
    return None


def _prepare_folder(out: Path, settings: dict, quick: dict, num_shards: int, overwrite: bool) -> None:
    """Refuse to resume with other settings (unless overwrite), clear stale temp files, record the settings."""
    progress = out / PROGRESS
    if out.exists() and any(out.iterdir()):
        previous = None
        if progress.is_file():
            try:
                previous = json.loads(progress.read_text()).get("settings")
            except json.JSONDecodeError:
                previous = None
        started = any((out / SHARDS).glob("*.arrow")) or (out / MANIFEST).exists()
        if previous != settings and (previous is not None or started):
            if not overwrite:
                what = _difference(previous, settings)
                raise UserError(
                    f"{out} holds distilled data made with other settings ({what}): pass distill.overwrite=true "
                    "to discard it, or use another workdir="
                )
            log.warning("distill.overwrite=true: clearing %s (%s)", out, _difference(previous, settings))
            shutil.rmtree(out)
    shards = out / SHARDS
    shards.mkdir(parents=True, exist_ok=True)
    for stale in [*shards.glob(".*.tmp-*"), *out.glob(".*.tmp-*")]:  # partial files of a killed run
        stale.unlink()
    (out / MANIFEST).unlink(missing_ok=True)  # rewritten once every shard is on disk
    _atomic_write_text(
        progress,
        json.dumps({"settings": settings, "quick_settings": quick, "num_shards": num_shards}, indent=2),
    )


def _difference(previous: dict | None, current: dict) -> str:
    if previous is None:
        return "no readable progress.json"
    keys = []
    for key in sorted(set(previous) | set(current)):
        a, b = previous.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += [f"{key}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            keys.append(key)
    labels = {"backbone_fingerprint": "a different backbone"}
    return "differs in " + ", ".join(labels.get(k, k) for k in keys[:4]) if keys else "unknown difference"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# 5: generation


def _distill_shards(plan: _Plan, model, renderer, rank: int, world: int, tracker) -> dict:
    from tqdm.auto import tqdm

    from medusa_train.data.regenerate import distill_records
    from medusa_train.engines.inprocess import ContinuousBatcher

    g, records, prompts = plan.cfg.distill, plan.records, plan.prompts
    shards_dir = plan.out / SHARDS
    size = g.shard_size
    mine = [i for i in range(-(-len(records) // size)) if i % world == rank]
    todo = [i for i in mine if not (shards_dir / shard_name(i)).is_file()]
    total = sum(len(records[i * size : (i + 1) * size]) for i in mine)
    done = total - sum(len(records[i * size : (i + 1) * size]) for i in todo)
    if done and rank == 0:
        log.info(
            "distill: resuming, %d of %d shards of rank 0 already on disk", len(mine) - len(todo), len(mine)
        )
    stats = {"tokens": 0, "seconds": 0.0, "shards": len(todo)}
    # mininterval: at most 2 redraws a second (a log file gets a line per redraw)
    bar = tqdm(total=total, initial=done, unit="rec", desc="distill", disable=rank != 0, mininterval=0.5)
    start = time.perf_counter()
    counted = [0]  # records of the current shard already counted on the bar

    def on_reply(tokens: int, record_done: bool) -> None:
        stats["tokens"] += tokens
        bar.set_postfix(
            tok_s=f"{stats['tokens'] / max(time.perf_counter() - start, 1e-9):.0f}", refresh=False
        )
        if record_done:  # the bar counts generated records; they reach disk with their shard
            counted[0] += 1
            bar.update(1)

    engine = ContinuousBatcher(
        model,
        batch_size=g.batch_size,
        pad_id=renderer.tokenizer.pad_token_id,
        eos_ids=plan.eos_ids,
        max_new_tokens=g.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
    )
    for n, index in enumerate(todo, start=1):
        chunk = slice(index * size, (index + 1) * size)
        rows = distill_records(
            engine,
            renderer,
            records[chunk],
            prompts[chunk],
            max_context=plan.max_context,
            eos_ids=plan.eos_ids,
            seed=g.seed,
            on_reply=on_reply,
        )
        write_shard(shards_dir / shard_name(index), rows)
        bar.update(len(rows) - counted[0])  # records with nothing to generate
        counted[0] = 0
        if tracker is not None:
            elapsed = time.perf_counter() - start
            tracker.log(
                {
                    "distill/records": bar.n,
                    "distill/tokens_generated": stats["tokens"],
                    "distill/tokens_per_s": stats["tokens"] / elapsed,
                },
                step=n,
            )
    bar.close()
    stats["seconds"] = time.perf_counter() - start
    return stats


def write_shard(path: Path, rows) -> None:
    """Write one shard as a datasets-readable Arrow stream: temp file, fsync, atomic rename."""
    import datasets
    import pyarrow as pa

    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            "source_id": datasets.Value("string"),
        }
    )
    counts = {
        "records": len(rows),
        "tokens_generated": sum(sum(r.loss_mask) for r in rows),
        "tokens_total": sum(len(r.input_ids) for r in rows),
        "turns": sum(r.turns for r in rows),
        "turns_dropped": sum(r.turns_dropped for r in rows),
        "turns_cut_at_max_new_tokens": sum(r.cut for r in rows),
    }
    schema = features.arrow_schema
    schema = schema.with_metadata({**(schema.metadata or {}), _STATS_KEY: json.dumps(counts).encode()})
    table = pa.table(
        {
            "input_ids": [r.input_ids for r in rows],
            "loss_mask": [r.loss_mask for r in rows],
            "source_id": [r.source_id for r in rows],
        },
        schema=schema,
    )
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        with pa.ipc.new_stream(f, schema) as writer:
            writer.write_table(table)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _shard_counts(path: Path) -> dict:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        schema = pa.ipc.open_stream(source).schema
    return json.loads(schema.metadata[_STATS_KEY])


# ----------------------------------------------------------------------------------------------
# 6: manifest and figures


def _write_manifest(plan: _Plan, tokenizer, all_stats: list[dict], world: int) -> dict:
    cfg, out, source, max_context = plan.cfg, plan.out, plan.source, plan.max_context
    counts: dict = {}
    for i in range(plan.num_shards):
        path = out / SHARDS / shard_name(i)
        if not path.is_file():
            raise UserError(
                f"shard {path.name} is missing after every rank finished: run the same command again"
            )
        for key, value in _shard_counts(path).items():
            counts[key] = counts.get(key, 0) + value
    skipped = {reason: len(lines) for reason, lines in source.skipped.items()}
    if plan.long_skipped:
        skipped[f"prompt longer than {max_context} tokens"] = len(plan.long_skipped)
    tokens_now = sum(s["tokens"] for s in all_stats)
    seconds = max((s["seconds"] for s in all_stats), default=0.0)
    manifest = {
        "format_version": FORMAT_VERSION,
        "backbone": plan.identity,
        "tokenizer": _tokenizer_info(tokenizer, plan.eos_ids),
        "generation": {
            **_generation_settings(cfg),
            "top_p": cfg.distill.top_p,
            "batch_size": cfg.distill.batch_size,
            "dtype": cfg.model.dtype,
            "quantization": cfg.model.quantization,
            "max_context": max_context,
            "eos_token_ids": plan.eos_ids,
        },
        "data": {**plan.quick["data"], "repaired": {k: len(v) for k, v in source.repaired.items()}},
        "counts": {**counts, "skipped": skipped, "records_skipped": sum(skipped.values())},
        "tokens_per_s": round(tokens_now / seconds, 1) if tokens_now and seconds > 0 else None,
        "tokens_per_s_note": "generated tokens / wall seconds of the last invocation, all ranks together",
        "world_size": world,
        "num_shards": plan.num_shards,
        "shard_size": cfg.distill.shard_size,
        "settings": plan.settings,
        "quick_settings": plan.quick,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2))
    log.info(
        "distill: %d records, %d tokens generated, %s tokens/s -> %s",
        counts.get("records", 0),
        counts.get("tokens_generated", 0),
        manifest["tokens_per_s"],
        out,
    )
    return manifest


def _figures(manifest: dict, *, generated_now: int, resumed: bool) -> dict:
    c = manifest["counts"]
    return {
        "records": c.get("records", 0),
        "records_skipped": c.get("records_skipped", 0),
        "turns": c.get("turns", 0),
        "tokens_generated": c.get("tokens_generated", 0),
        "tokens_generated_now": generated_now,
        "tokens_per_s": manifest.get("tokens_per_s"),
        "num_shards": manifest["num_shards"],
        "world_size": manifest["world_size"],
        "already_complete": resumed,
    }


# ----------------------------------------------------------------------------------------------
# ranks (gloo only for the two synchronisation points; nothing when WORLD_SIZE == 1)


def _init_process_group(world: int) -> bool:
    if world <= 1:
        return False
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    # generation can take hours on a rank: the final gather must not time out
    dist.init_process_group("gloo", timeout=timedelta(days=7))
    return True


def _destroy_process_group(created: bool) -> None:
    if created:
        import torch.distributed as dist

        dist.destroy_process_group()


def _broadcast(value, world: int):
    if world <= 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(stats: dict, world: int) -> list[dict]:
    if world <= 1:
        return [stats]
    import torch.distributed as dist

    boxes: list = [None] * world
    dist.all_gather_object(boxes, stats)
    return boxes


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
