"""stage=distill: self-distilled training data from the frozen backbone.

Medusa (Cai et al., 2024, section 3.2.1) trains the heads on the backbone's own replies. This stage
assembles the pieces with files and ranks: the source readers (:mod:`medusa_train.data.sources`),
the multi-turn loop (:mod:`medusa_train.data.regenerate`) over the in-process engine
(:mod:`medusa_train.engines.inprocess`), and the distilled format (:mod:`medusa_train.data.distilled`).

Run as:
    python -m medusa_train stage=distill                                  # embedded backbone + prompts, CPU
    python -m medusa_train stage=distill model=hf model.name_or_path=lmsys/vicuna-7b-v1.3 \\
        data=sharegpt data.path=sharegpt.json distill.temperature=0.7
    torchrun --nproc_per_node 8 -m medusa_train stage=distill model=hf ...   # data-parallel, one GPU per rank

Steps (every rank):
    1. read the source (``data=``): a missing file or bad format fails here, before any model loads;
    2. if ``workdir/distill`` is already complete with the same settings, return its figures
       (``distill.overwrite=true``: decided in step 4, after the backbone loads);
    3. refuse a backbone no tree decoder verifies (:func:`~medusa_train.decoding.attention.tree_refusal`),
       from the model built on the meta device from its config (no weights, nothing written yet; the
       in-process engine checks the loaded model too); load the frozen backbone, render every first
       prompt with the chat template, apply the long-prompt rule (``data.max_prompt_tokens``,
       ``data.long_prompts``);
    4. rank 0 checks ``distill/progress.json`` (same backbone fingerprint, tokenizer, generation
       settings and data?) and refuses a mismatch unless ``distill.overwrite=true`` (clears the folder);
    5. records, in source order, form shards of ``distill.shard_size``; rank r owns the shards with
       ``index % world_size == r``, skips those already on disk, regenerates the others and writes
       each to a temp file renamed atomically to ``shards/shard-{index:05d}.arrow`` -- so a run
       killed at any moment (SIGKILL included) and restarted with the same command ends with every
       record exactly once, and the result does not depend on the number of ranks;
    6. rank 0 writes ``manifest.json`` once every shard is on disk.

Several ranks synchronise through :mod:`medusa_train.dist` (a gloo group only when WORLD_SIZE > 1):
one broadcast after step 4 and one gather before step 6.

Settings compared (skip in step 2, resume in step 4): :func:`medusa_train.workdir.settings_of` of
``cfg.distill`` and ``cfg.data`` (every field but their ``run_only`` ones), the backbone (source and
files before it loads, weights fingerprint after), dtype, quantization, tokenizer and the records
read. Greedy runs ignore ``distill.top_p`` and ``distill.seed`` (neither changes a greedy reply),
and ``data.eval_fraction`` belongs to stage=train. A chat template that puts whitespace before EOS
after a reply (Llama-2), with data that has a later turn, adds ``spaced_eos`` (its contexts drop that
whitespace with the EOS text); one that puts whitespace after an EOS whose token has ``rstrip`` (Phi-3's
``<|end|>`` and newline), with such data, adds ``eos_rstrip`` (its contexts drop that whitespace, as the
tokenizer's own call does); data whose later user turns quote a special-token string, and every
run through a server's chat API (its replies may quote one), add ``quoted_special_tokens`` (encoded
as text; earlier versions encoded the special id). A folder
recorded without such an entry is refused while unfinished (resuming would mix two renderings) and
kept as it is once complete.

Context limits: the first prompt may hold at most ``min(data.max_prompt_tokens,
max_position_embeddings - distill.max_new_tokens)`` tokens (longer ones are skipped with a count, or
left-truncated with ``data.long_prompts=truncate``); a later turn whose context would exceed that
limit is not answered, the conversation ends with the previous reply (counted as turns dropped).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tqdm.auto import tqdm

from medusa_train import dist, launch
from medusa_train.backbone import (
    backbone_identity,
    checkpoint_fingerprint,
    hf_source,
    load_configured_backbone,
    load_tokenizer,
    loading,
    local_fingerprint,
    meta_backbone,
    older_fingerprint,
    other_code_fingerprint,
    resolve_device,
    resolve_dtype,
)
from medusa_train.backbone_source import check_backbone_source
from medusa_train.config import Config, DataConfig, DistillConfig, ModelConfig
from medusa_train.data.chat import ChatRenderer, eos_token_ids
from medusa_train.data.distilled import (
    FORMAT_VERSION,
    REGENERATE,
    comparable,
    complete_manifest,
    has_output,
    read_manifest,
    read_progress,
    read_shard_counts,
    shard_entries,
    shard_path,
    start_run,
    total_counts,
    verify_shards,
    write_manifest,
    write_shard,
)
from medusa_train.data.regenerate import distill_records
from medusa_train.data.sources import Conversation, ReadResult, read_records
from medusa_train.decoding.attention import AttentionBackendError, tree_refusal
from medusa_train.engines.inprocess import UNAPPLIED_SAMPLING_SETTINGS, UNAPPLIED_SETTINGS, ContinuousBatcher
from medusa_train.engines.server import (
    ServerClient,
    ServerEngine,
    check_endpoint,
    check_server,
    reply_end_id,
)
from medusa_train.errors import DamagedArtefactError, UserError
from medusa_train.tracking import Tracker, start_tracking
from medusa_train.workdir import (
    MANIFEST,
    PROGRESS,
    Workdir,
    describe_diff,
    read_json,
    remove_stale,
    settings_diff,
    settings_of,
)

log = logging.getLogger(__name__)


@dataclass
class _Plan:
    """What this invocation distills: shared by the generation (step 5) and the manifest (step 6)."""

    cfg: Config
    out: Path
    source: ReadResult
    records: list[Conversation]
    prompts: list[list[int]]
    long_skipped: list[str]
    eos_ids: list[int]
    max_context: int
    identity: dict
    settings: dict
    quick: dict
    num_shards: int
    server: dict | None = None
    """distill.engine=server: what :func:`medusa_train.engines.server.check_server` found."""


def run(cfg: Config) -> dict:
    """Regenerate every assistant turn of the data source with the frozen backbone (see module docstring)."""
    out = Workdir(Path(cfg.workdir)).distill

    # 1. The source: fails on a missing / unreadable file before the model loads.
    source = _read_source(cfg)
    check_backbone_source(cfg.model.name_or_path)
    quick = _quick_settings(cfg, source)

    # 2. Already complete with these settings?
    manifest = _complete_manifest(out, quick, cfg.distill.overwrite)
    if manifest is not None:
        return _figures(manifest, generated_now=0, resumed=True)

    # 3. A backbone no tree decoder verifies is refused from its config, before its weights load and
    #    anything is written; the backbone (distill.engine=server: its tokenizer and config only),
    #    prompts, long-prompt rule.
    meta = meta_backbone(cfg.model)
    if meta is not None:
        _check_verifiable(meta, cfg.model)
    plan, model, renderer = _load_and_plan(cfg, out, source, quick)

    created_group = dist.init_process_group()
    tracker = Tracker(None)
    try:
        # 4. The folder checked and prepared on rank 0, the decision shared with every rank.
        complete = _prepare_folder_everywhere(plan)
        if complete is not None:
            return _figures(complete, generated_now=0, resumed=True)

        # 5. This rank's shards. Shards on disk are a killed run's work: its wandb run goes on (rank 0 only).
        resumed = any(shard_path(plan.out, i).is_file() for i in range(plan.num_shards))
        tracker = start_tracking(cfg.tracking, cfg.workdir, "distill", asdict(cfg), resume=resumed)
        all_stats = dist.gather(_distill_shards(plan, model, renderer, tracker))

        # 6. One manifest, written by rank 0 once every shard is on disk.
        figures = _publish_manifest(plan, renderer.tokenizer, all_stats)
        tracker.summary({f"distill/{k}": v for k, v in figures.items() if isinstance(v, int | float)})
    except BaseException:
        tracker.finish(failed=True)
        raise
    finally:
        tracker.finish()
        dist.destroy_process_group(created_group)
    return figures


# ----------------------------------------------------------------------------------------------
# 1-3: source, settings, prompts


def _read_source(cfg: Config) -> ReadResult:
    """Step 1: the records of ``data=`` (rank 0 logs what was skipped or repaired)."""
    d = cfg.data
    source = read_records(
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
    if launch.is_main():
        source.log_warning(log)
    return source


def _complete_manifest(out: Path, quick: dict, overwrite: bool) -> dict | None:
    """Step 2: the manifest of ``out`` when it is complete with these settings (None: work to do).

    Rank 0 first deletes the temp files of writes a kill interrupted; no rank writes before the
    broadcast of step 4. With ``overwrite`` always None: the quick settings cannot see every
    setting (a Hub id's weights under the same name, the tokenizer), and overwrite must redo a
    folder whose settings differ in any; step 4 reuses one that is complete with all of them.
    """
    if launch.is_main():
        remove_stale(out)
    manifest = None if overwrite else complete_manifest(out, quick)
    if manifest is not None and launch.is_main():
        log.info(
            "distill: %s is complete with these settings (%d records); nothing to do",
            out,
            manifest["counts"]["records"],
        )
    return manifest


def _load_and_plan(
    cfg: Config, out: Path, source: ReadResult, quick: dict
) -> tuple[_Plan, object, ChatRenderer]:
    """Step 3: the backbone (distill.engine=server: its tokenizer and config only, every endpoint
    checked before any work), the first prompts under the long-prompt rule, the full settings.

    Returns:
        ``(plan, model, renderer)``: ``model`` is the loaded backbone, or for distill.engine=server an
        object with its ``config`` and ``generation_config`` only.
    """
    if cfg.distill.engine == "server":
        model, tokenizer, identity = _served_backbone(cfg)
    else:
        model, tokenizer = load_configured_backbone(cfg.model)
        _check_verifiable(model, cfg.model)  # the model itself, where it could not be built on meta
        identity = backbone_identity(
            model, cfg.model.name_or_path, cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
    renderer = ChatRenderer(tokenizer)
    eos_ids = eos_token_ids(model, tokenizer)
    max_context = _max_context(cfg, model)
    records, prompts, long_skipped = _prepare_prompts(cfg, renderer, source.records, max_context)
    if not records:
        raise UserError(
            f"every prompt is longer than {max_context} tokens: raise data.max_prompt_tokens or use data.long_prompts=truncate"
        )
    settings = _full_settings(quick, identity, tokenizer, eos_ids, max_context, prompts)
    later = next((conv for conv in records if len(conv.turns) > 1), None)
    if later is not None and renderer.spaced_eos(later, eos_ids):
        # The contexts of later turns drop the whitespace the template puts before EOS with the EOS
        # text (ChatRenderer.continuation_ids). Recorded where that applies only, so the folders of
        # other templates and of single-turn data keep their settings; a folder of this template and
        # data without it holds EOS, space, EOS there: unfinished, it does not resume into a mix of
        # both; complete, it is kept as it is (_complete_settings).
        settings[_SPACED_EOS] = "dropped"
    if later is not None and renderer.stripped_eos(later, eos_ids):
        # The contexts of later turns drop the whitespace the template puts after an EOS whose token has
        # rstrip (Phi-3's <|end|> and newline), as the tokenizer's own call on the whole conversation
        # does (ChatRenderer.continuation_ids). Recorded where that applies only, with the same rule as
        # spaced_eos (_complete_settings): a folder without it holds that whitespace there.
        settings[_EOS_RSTRIP] = "applied"
    chat_replies = cfg.distill.engine == "server" and cfg.distill.server.api == "chat"
    if chat_replies or any(renderer.quotes_special(turn) for conv in records for turn in conv.turns[1:]):
        # A later user turn quoting a special-token string ("<|im_end|>"): its context holds that text
        # as text (earlier versions: the special id). First prompts are in data.prompts_hash already.
        # A server's chat reply is text re-tokenised the same way, and which reply quotes one is known
        # only once it is generated: recorded for every such run. Recorded where that applies only,
        # with the same rule as spaced_eos (_complete_settings).
        settings[_QUOTED_SPECIALS] = "text"
    if cfg.distill.engine != "server":
        # The generation config's settings the in-process engine applies, as generate and the
        # servers do (the repetition penalty always, top-k and min-p when sampling). Recorded where
        # they apply only, so folders of models without them keep their settings; a folder
        # distilled before the engine applied one does not resume into one that does. The engine
        # applies what is recorded here (_distill_shards).
        settings.update(_generation_config_settings(model, sampled=cfg.distill.temperature > 0))
        _warn_unapplied(model, sampled=cfg.distill.temperature > 0)
    server = None
    if cfg.distill.engine == "server":  # every endpoint answers and serves the model: before any work
        probe = _probe_index(prompts)
        server = _check_server(cfg, renderer, records[probe], prompts[probe])
        # the model's top-k, sent to servers that would apply another (ServerEngine's top_k)
        server["top_k"] = _generation_config_settings(model, sampled=True).get("top_k", 0)
        settings["engine"] = {**quick["engine"], "served": sorted({e["root"] for e in server["endpoints"]})}
    num_shards = -(-len(records) // cfg.distill.shard_size)
    plan = _Plan(
        cfg, out, source, records, prompts, long_skipped, eos_ids, max_context, identity, settings, quick,
        num_shards, server,
    )  # fmt: skip
    return plan, model, renderer


def _check_verifiable(model, model_cfg: ModelConfig) -> None:
    """Step 3: refuse a backbone no tree decoder can verify trees on (:func:`tree_refusal`: ALiBi, layers
    of a type the decoders do not serve, a recurrent state, no position ids, ...): heads trained on the
    data distilled from it could never be used, and stage=train refuses it.

    Args:
        model: the backbone built on the meta device (:func:`~medusa_train.backbone.meta_backbone`),
            or loaded.

    Raises:
        AttentionBackendError: the backbone, why, and what to do, in one line.
    """
    reason = tree_refusal(model)
    if reason is not None:
        raise AttentionBackendError(
            f"model.name_or_path={model_cfg.name_or_path}: {reason}; heads trained on data distilled from it "
            "could never be verified by the tree decoders (stage=train refuses it): distill from another "
            "backbone"
        )


def _generation_config_settings(model, sampled: bool) -> dict:
    """What of ``model``'s generation config the in-process engine applies, as ``generate`` and the
    servers do: ``repetition_penalty`` (always) and, when ``sampled``, ``top_k`` and ``min_p`` (vLLM
    and ``transformers serve`` apply them from the generation config too). Only values that filter
    anything are returned."""
    config = getattr(model, "generation_config", None)
    out = {}
    penalty = float(getattr(config, "repetition_penalty", None) or 1.0)
    if penalty != 1.0:
        out["repetition_penalty"] = penalty
    if sampled:
        top_k = int(getattr(config, "top_k", None) or 0)
        min_p = float(getattr(config, "min_p", None) or 0.0)
        if top_k > 0:
            out["top_k"] = top_k
        if min_p > 0:
            out["min_p"] = min_p
    return out


def _warn_unapplied(model, sampled: bool) -> None:
    """Warn about settings of ``model``'s generation config that ``generate`` and the servers apply
    and the in-process engine does not (it applies :func:`_generation_config_settings`): its replies
    then differ from the model's own ``generate``. Common chat models set none of them."""
    config = getattr(model, "generation_config", None)
    checked = {**UNAPPLIED_SETTINGS, **(UNAPPLIED_SAMPLING_SETTINGS if sampled else {})}
    unapplied = [
        f"{name}={getattr(config, name)!r}"
        for name, off in checked.items()
        if getattr(config, name, None) not in (off, None)
    ]
    if unapplied:
        log.warning(
            "distill: the model's generation config sets %s, which the in-process engine does not apply "
            "(generate and the servers do): its replies can differ from the model's own generate",
            ", ".join(unapplied),
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


_SETTINGS_FILE_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".py")
"""The files of a model directory that :func:`_backbone_settings_files` reads: tokenizer, chat template,
generation config (and the model config, code), never the weights."""


def _backbone_settings_files(name_or_path: str) -> str | None:
    """The content of a local model directory's tokenizer, chat template and generation config files
    (every top-level file with a :data:`_SETTINGS_FILE_SUFFIXES` suffix), as 16 hex digits; None for a
    hub id. They change the records, and the backbone's fingerprint covers config.json, its remote code and
    the weights only."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _SETTINGS_FILE_SUFFIXES):
        content = f.read_bytes()
        h.update(f"{f.name}:{len(content)}:".encode() + content)
    return h.hexdigest()[:16]


def _quick_settings(cfg: Config, source: ReadResult) -> dict:
    """What can be checked without loading the model (decides the early return of a complete folder)."""
    distill = settings_of(distill=cfg.distill)["distill"]
    if cfg.distill.temperature == 0:
        distill.update(top_p=None, seed=None)  # neither changes a greedy reply
    data = settings_of(data=cfg.data)["data"]
    del data["eval_fraction"]  # stage=train's held-out split: the records do not depend on it
    data.update(
        path=str(Path(cfg.data.path).expanduser().resolve()) if cfg.data.path else None,
        records_read=len(source.records),
        records_hash=_records_hash(source.records),
    )
    backbone = {
        "name_or_path": cfg.model.name_or_path,  # recorded; compared only for a Hub id (see comparable)
        "revision": cfg.model.revision,
        "files": _backbone_files_signature(cfg.model.name_or_path),  # recorded, not compared
        "fingerprint": local_fingerprint(  # a local checkpoint's content
            cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code
        ),
        # A local checkpoint's tokenizer, chat template and generation config, by content.
        "settings_files": _backbone_settings_files(cfg.model.name_or_path),
    }
    served = cfg.distill.engine == "server"  # then the servers' own dtype and quantization apply
    quick = settings_of(
        backbone_source=backbone,
        dtype="server's" if served else resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device)),
        quantization="server's" if served else cfg.model.quantization,
        distill=distill,
        data=data,
    )
    if served:  # the served model, not URLs or client settings (run-only fields)
        s = cfg.distill.server
        quick["engine"] = {"kind": "server", "api": s.api, "model": s.model or cfg.model.name_or_path}
    return quick


def _max_context(cfg: Config, model) -> int:
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
    cfg, renderer: ChatRenderer, records: list[Conversation], max_context: int
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
    if skipped and launch.is_main():
        shown = ", ".join(skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        log.warning(
            "skipped %d records whose prompt is longer than %d tokens (%s); data.long_prompts=truncate keeps them",
            len(skipped),
            max_context,
            shown,
        )
    return kept, prompts, skipped


def _full_settings(
    quick: dict, identity: dict, tokenizer, eos_ids: list[int], max_context: int, prompts
) -> dict:
    """What a resumed run must share with the interrupted one (the backbone by fingerprint, not by path)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(p).encode())
    return settings_of(
        format_version=FORMAT_VERSION,
        backbone_fingerprint=identity["fingerprint"],
        dtype=quick["dtype"],
        quantization=quick["quantization"],
        tokenizer=_tokenizer_info(tokenizer, eos_ids),
        distill=quick["distill"],
        data={**quick["data"], "path": None, "prompts_hash": h.hexdigest()[:16], "max_context": max_context},
    )


def _tokenizer_info(tokenizer, eos_ids: list[int]) -> dict:
    return {
        "name_or_path": str(tokenizer.name_or_path),
        "vocab_size": len(tokenizer),
        "eos_token_ids": eos_ids,
        "pad_token_id": tokenizer.pad_token_id,
        "chat_template_sha256": hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:16],
    }


# ----------------------------------------------------------------------------------------------
# 4: the folder


def _prepare_folder_everywhere(plan: _Plan) -> dict | None:
    """Step 4: :func:`_prepare_folder` on rank 0, its answer (the manifest of a complete folder, or
    None) broadcast to every rank; its refusal raised on every rank."""
    error, complete = None, None
    if launch.is_main():
        try:
            complete = _prepare_folder(
                plan.out,
                plan.settings,
                plan.quick,
                plan.num_shards,
                plan.cfg.distill.overwrite,
                plan.cfg.model,
            )
        except UserError as err:
            error = str(err)
    error, complete = dist.broadcast((error, complete))
    if error:
        raise UserError(error)
    return complete


def _prepare_folder(
    out: Path, settings: dict, quick: dict, num_shards: int, overwrite: bool, model: ModelConfig
) -> dict | None:
    """Refuse to resume with other settings (unless overwrite), then record the settings.

    Settings are compared by content (:func:`~medusa_train.data.distilled.comparable`): a copied or
    moved workdir or backbone is the same. A damaged ``progress.json`` falls back to the manifest's
    settings. ``model``: the backbone's settings, which name a differing fingerprint (:func:`_difference`).

    Returns:
        The manifest when the folder is already complete with these settings (nothing to do: the
        quick check only missed it, e.g. a manifest of an older version), else None.
    """
    manifest = _readable_manifest(out)
    if out.exists() and any(out.iterdir()):
        progress = read_progress(out)
        previous = progress.get("settings") if isinstance(progress, dict) else None
        if previous is None and manifest is not None:
            previous = manifest.get("settings")
        if (
            manifest is not None
            and comparable(manifest.get("settings"))
            == comparable(settings if overwrite else _complete_settings(settings, manifest))
            and manifest.get("num_shards") == num_shards
            and not verify_shards(out, manifest)
        ):
            log.info("distill: %s is complete with these settings; nothing to do", out)
            if comparable(manifest.get("quick_settings")) != comparable(quick):  # the next run skips early
                write_manifest(out, {**manifest, "quick_settings": quick})
            return manifest
        if comparable(previous) != comparable(settings) and (previous is not None or has_output(out)):
            difference = _difference(previous, settings, model)
            if not overwrite:
                raise UserError(
                    f"{out} holds distilled data made with other settings ({difference}): "
                    "run with the old values to keep and finish it, pass distill.overwrite=true to discard it, "
                    "or use another workdir="
                )
            log.warning("distill.overwrite=true: clearing %s (%s)", out, difference)
            shutil.rmtree(out)
    removed = start_run(out, {"settings": settings, "quick_settings": quick, "num_shards": num_shards})
    for path in removed:
        log.warning("distill: %s was damaged: generating it again", path)
    return None


_SPACED_EOS = "spaced_eos"
"""The settings entry of a template that puts whitespace before EOS after a reply, for data with a
later turn (:meth:`~medusa_train.data.chat.ChatRenderer.spaced_eos`)."""
_EOS_RSTRIP = "eos_rstrip"
"""The settings entry of a template that puts whitespace after an EOS whose token has ``rstrip``, for
data with a later turn (:meth:`~medusa_train.data.chat.ChatRenderer.stripped_eos`)."""
_QUOTED_SPECIALS = "quoted_special_tokens"
"""The settings entry of data whose later user turns quote a special-token string
(:meth:`~medusa_train.data.chat.ChatRenderer.quotes_special`), and of every ``distill.server.api=chat``
run (a reply may quote one): such strings are encoded as text."""
_RENDERINGS = (_SPACED_EOS, _EOS_RSTRIP, _QUOTED_SPECIALS)
"""Entries recorded for the data they apply to, which earlier versions rendered otherwise."""


def _complete_settings(settings: dict, manifest: dict) -> dict:
    """``settings`` as the complete folder of ``manifest`` is compared with them: without the entries of
    :data:`_RENDERINGS` its settings lack. Its later turns' contexts then hold the earlier rendering
    (the whitespace before the template's EOS: EOS, space, EOS; the whitespace after an EOS with
    ``rstrip``: EOS, newline; a quoted special-token string as the special id), every record alike:
    whole data the heads can train on, reused as it is (``distill.overwrite=true`` redoes it); an
    unfinished folder is refused instead, since resuming it would mix both kinds of records."""
    recorded = manifest.get("settings")
    if isinstance(recorded, dict):
        return {key: value for key, value in settings.items() if key not in _RENDERINGS or key in recorded}
    return settings


def _readable_manifest(out: Path) -> dict | None:
    if not (out / MANIFEST).is_file():
        return None
    try:
        return read_json(out / MANIFEST, repair=REGENERATE)
    except DamagedArtefactError as err:
        log.warning("%s", err)
        return None


_SETTABLE = {
    "distill": {f.name for f in fields(DistillConfig)},
    "data": {f.name for f in fields(DataConfig)},
}
"""The sections of distill's settings key that hold config fields (the rest of their entries, and
the other sections but :data:`_SETTABLE_KEYS`, are derived: hashes, counts, identities)."""
_SETTABLE_KEYS = {"dtype", "quantization", "backbone_source.revision", "engine.api", "engine.model"}


def _settable(name: str) -> bool:
    """True for an entry of distill's settings key that the user sets (``distill.max_new_tokens``), False
    for one derived from the settings and inputs (``data.records_hash``, ``backbone_fingerprint``)."""
    section, _, field = name.partition(".")
    return name in _SETTABLE_KEYS or field.partition(".")[0] in _SETTABLE.get(section, ())


def _difference(previous: dict | None, current: dict, model: ModelConfig | None = None) -> str:
    """The differing settings, never empty (``a different backbone`` for the weights' fingerprint).

    ``model``: this run's backbone settings. A fingerprint that differs and is the one the same
    backbone has with ``model.trust_remote_code`` the other way (:func:`_other_code`) is named as that
    setting.
    """
    if previous is None:
        return f"no readable {PROGRESS} or {MANIFEST} says which"
    old, new = comparable(previous), comparable(current)
    text = describe_diff(old, new, settable=_settable)
    differing = settings_diff(old, new)
    if "backbone_fingerprint" in differing and older_fingerprint(
        old.get("backbone_fingerprint"), new.get("backbone_fingerprint")
    ):
        text = (
            "a backbone fingerprint an earlier medusa_train computed from other bytes than this version reads: "
            + text
        )
    elif (
        "backbone_fingerprint" in differing
        and model is not None
        and _other_code(old.get("backbone_fingerprint"), model)
    ):
        trust = model.trust_remote_code
        text = (
            f"the same backbone loaded with model.trust_remote_code={str(not trust).lower()}, where this run "
            f"sets model.trust_remote_code={str(trust).lower()} (the remote code its config.json's auto_map "
            "names counts only with it): " + text
        )
    elif "backbone_fingerprint" in differing:
        text = "a different backbone: " + text
    elif "engine.served" in differing:
        text = "another served model: " + text
    elif _SPACED_EOS in differing:
        text = (
            "later turns' contexts that keep the whitespace before the template's EOS (EOS, space, EOS): "
            + text
        )
    elif _EOS_RSTRIP in differing:
        text = (
            "later turns' contexts that keep the whitespace after an EOS whose rstrip drops it "
            "(EOS, newline): " + text
        )
    elif (
        _QUOTED_SPECIALS in differing
        and _QUOTED_SPECIALS not in old
        and not any(name.partition(".")[0] == "engine" for name in differing)
    ):  # a folder of an earlier version, not of another engine
        text = (
            "later user turns or a server's chat replies that quote a special-token string, encoded as the "
            "special id: " + text
        )
    return text


def _other_code(recorded: object, model: ModelConfig) -> bool:
    """``recorded`` is the fingerprint of ``model``'s backbone loaded with ``model.trust_remote_code``
    the other way (:func:`~medusa_train.backbone.other_code_fingerprint`: of a model with remote code
    only, config.json all it reads of one without)."""
    return isinstance(recorded, str) and recorded == other_code_fingerprint(
        model.name_or_path, model.revision, trust_remote_code=model.trust_remote_code
    )


# ----------------------------------------------------------------------------------------------
# 5: generation


_LOGGED_COUNTS = ("records", "records_dropped_not_token_exact", "tokens_generated")
"""Shard counts logged (``distill/<count>``) after each shard, summed over this rank's shards on disk:
the records written, the source records written as nothing (``distill.engine=server``: no reply was
token-exact, see :func:`_exactness_counts`), the generated tokens they hold."""


def _distill_shards(plan: _Plan, model, renderer: ChatRenderer, tracker: Tracker) -> dict:
    g, records, prompts = plan.cfg.distill, plan.records, plan.prompts
    rank, world, size = launch.rank(), launch.world_size(), g.shard_size
    mine = [i for i in range(plan.num_shards) if i % world == rank]
    todo = [i for i in mine if not shard_path(plan.out, i).is_file()]
    total = sum(len(records[i * size : (i + 1) * size]) for i in mine)
    done = total - sum(len(records[i * size : (i + 1) * size]) for i in todo)
    if done and launch.is_main():
        log.info(
            "distill: resuming, %d of %d shards of rank 0 already on disk", len(mine) - len(todo), len(mine)
        )
    stats = {"tokens": 0, "seconds": 0.0, "shards": len(todo)}
    # Logged: totals of this rank's shards on disk, a killed attempt's included (the run goes on with
    # them), and the tokens/s of this attempt alone. `records` are the records written, as in the
    # manifest and the run's summary; the source records handled are those plus the dropped ones.
    on_disk = dict.fromkeys(_LOGGED_COUNTS, 0)

    def add_counts(index: int) -> None:
        counts = read_shard_counts(shard_path(plan.out, index))
        for key in on_disk:
            on_disk[key] += counts.get(key, 0)  # the in-process engine's shards drop no record

    for index in mine:
        if index not in todo:
            add_counts(index)
    # mininterval: at most 2 redraws a second (a log file gets a line per redraw)
    bar = tqdm(
        total=total, initial=done, unit="rec", desc="distill", disable=not launch.is_main(), mininterval=0.5
    )
    start = time.perf_counter()
    counted = [0]  # records of the current shard already counted on the bar

    def on_reply(tokens: int, record_done: bool) -> None:
        stats["tokens"] += tokens
        bar.set_postfix(
            tok_s=f"{stats['tokens'] / max(time.perf_counter() - start, 1e-9):.0f}", refresh=False
        )
        if record_done:  # the bar counts source records handled (written or dropped) as they finish
            counted[0] += 1
            bar.update(1)

    if plan.server is not None:
        engine = _server_engine(plan, renderer)
    else:
        engine = ContinuousBatcher(
            model,
            batch_size=g.batch_size,
            pad_id=renderer.tokenizer.pad_token_id,
            eos_ids=plan.eos_ids,
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=plan.settings.get("top_k", 0),
            min_p=plan.settings.get("min_p", 0.0),
            repetition_penalty=plan.settings.get("repetition_penalty", 1.0),
        )
    before = dict(engine.stats)
    try:  # the bar ends its line also when generation fails (an error then starts a line of its own)
        # n: this rank's shards on disk, the step its figures are logged at (a resumed run goes on counting)
        for n, index in enumerate(todo, start=len(mine) - len(todo) + 1):
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
            handled = len(rows)
            if plan.server is None:
                write_shard(shard_path(plan.out, index), rows)
            else:  # with this shard's share of the server engine's exactness counts
                extra = _exactness_counts(engine.stats, before, rows)
                before = dict(engine.stats)
                rows = [r for r in rows if r.turns]  # first reply not token-exact: nothing to train on
                write_shard(shard_path(plan.out, index), rows, extra)
            bar.update(handled - counted[0])  # records with nothing to generate
            counted[0] = 0
            add_counts(index)
            elapsed = time.perf_counter() - start
            tracker.log(
                {
                    **{f"distill/{key}": value for key, value in on_disk.items()},
                    "distill/tokens_per_s": stats["tokens"] / elapsed,
                },
                step=n,
            )
    finally:
        bar.close()
    stats["seconds"] = time.perf_counter() - start
    if plan.server is not None:
        stats["endpoints"] = engine.endpoint_counts()
    return stats


# ----------------------------------------------------------------------------------------------
# 6: manifest and figures


def _publish_manifest(plan: _Plan, tokenizer, all_stats: list[dict]) -> dict:
    """Step 6: rank 0 writes the manifest once every rank's shards are on disk; every rank returns
    the figures read back from it."""
    if launch.is_main():
        _write_manifest(plan, tokenizer, all_stats)
    dist.barrier()
    manifest = read_manifest(plan.out)
    return _figures(manifest, generated_now=sum(s["tokens"] for s in all_stats), resumed=False)


def _write_manifest(plan: _Plan, tokenizer, all_stats: list[dict]) -> None:
    cfg, source, max_context = plan.cfg, plan.source, plan.max_context
    counts = total_counts(plan.out, plan.num_shards)
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
            **plan.quick["distill"],
            "top_p": cfg.distill.top_p,
            "batch_size": cfg.distill.batch_size,
            "dtype": plan.quick["dtype"],
            "quantization": plan.quick["quantization"],
            "max_context": max_context,
            "eos_token_ids": plan.eos_ids,
            **{
                key: "server's" if plan.server is not None else plan.settings.get(key, off)
                for key, off in (("repetition_penalty", 1.0), ("top_k", 0), ("min_p", 0.0))
            },
        },
        "data": {**plan.quick["data"], "repaired": {k: len(v) for k, v in source.repaired.items()}},
        "counts": {**counts, "skipped": skipped, "records_skipped": sum(skipped.values())},
        "tokens_per_s": round(tokens_now / seconds, 1) if tokens_now and seconds > 0 else None,
        "tokens_per_s_note": "generated tokens / wall seconds of the last invocation, all ranks together",
        "world_size": launch.world_size(),
        "engine": _engine_manifest(plan, all_stats),
        "num_shards": plan.num_shards,
        "shards": shard_entries(plan.out, plan.num_shards),
        "shard_size": cfg.distill.shard_size,
        "settings": plan.settings,
        "quick_settings": plan.quick,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_manifest(plan.out, manifest)
    log.info(
        "distill: %d records written (%d dropped, %d skipped), %d tokens generated, %s tokens/s -> %s",
        counts.get("records", 0),
        counts.get("records_dropped_not_token_exact", 0),
        manifest["counts"]["records_skipped"],
        counts.get("tokens_generated", 0),
        manifest["tokens_per_s"],
        plan.out,
    )


def _figures(manifest: dict, *, generated_now: int, resumed: bool) -> dict:
    """The stage's figures (and its wandb run's summary, ``distill/<name>``), from the manifest: the
    records written (``records``), the source records never distilled (``records_skipped``: refused by
    the reader, or a prompt over the context limit) and those distilled into nothing
    (``records_dropped_not_token_exact``: distill.engine=server, no reply token-exact); the three add
    up to the source records read or refused by the reader."""
    c = manifest["counts"]
    return {
        "records": c.get("records", 0),
        "records_skipped": c.get("records_skipped", 0),
        "records_dropped_not_token_exact": c.get("records_dropped_not_token_exact", 0),
        "turns": c.get("turns", 0),
        "tokens_generated": c.get("tokens_generated", 0),
        "tokens_generated_now": generated_now,
        "tokens_per_s": manifest.get("tokens_per_s"),
        "num_shards": manifest["num_shards"],
        "world_size": manifest["world_size"],
        "already_complete": resumed,
    }


# ----------------------------------------------------------------------------------------------
# distill.engine=server: the backbone's weights stay with the servers; this process needs
# its tokenizer (records are built with it), its config (context length, EOS ids) and the files'
# fingerprint (stage=train checks the data came from the backbone it loads).


def _served_backbone(cfg: Config):
    """``(model-like, tokenizer, identity)`` of ``model.name_or_path`` without loading its weights."""
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    m = cfg.model
    if cfg.data.long_prompts == "truncate" and cfg.distill.server.api == "chat":
        raise UserError(
            "data.long_prompts=truncate cannot be sent as chat messages: use data.long_prompts=skip, "
            "or distill.server.api=tokens (vLLM)"
        )
    with loading(m.name_or_path):
        config = AutoConfig.from_pretrained(
            hf_source(m.name_or_path), revision=m.revision, trust_remote_code=m.trust_remote_code
        )
        try:
            generation = GenerationConfig.from_pretrained(hf_source(m.name_or_path), revision=m.revision)
        except OSError:  # no generation_config.json: the model config's EOS
            generation = GenerationConfig.from_model_config(config)
        tokenizer = load_tokenizer(m.name_or_path, trust_remote_code=m.trust_remote_code, revision=m.revision)
    fingerprint = checkpoint_fingerprint(m.name_or_path, m.revision, trust_remote_code=m.trust_remote_code)
    if fingerprint is None:
        raise UserError(
            f"distill.engine=server needs the checkpoint files of {m.name_or_path} on this machine (a directory "
            "or the hub cache): the manifest records their fingerprint for stage=train; no weights are loaded"
        )
    text = config.get_text_config()
    identity = {
        "name_or_path": str(m.name_or_path),
        "architecture": (config.architectures or [config.model_type])[0],
        "hidden_size": int(text.hidden_size),
        "vocab_size": int(text.vocab_size),
        "fingerprint": fingerprint,
    }
    return SimpleNamespace(config=text, generation_config=generation), tokenizer, identity


def _server_client(cfg: Config) -> ServerClient:
    s = cfg.distill.server
    return ServerClient(
        list(s.urls),
        api_key_env=s.api_key_env,
        timeout_s=s.timeout_s,
        max_retries=s.max_retries,
        backoff_s=s.backoff_s,
        backoff_max_s=s.backoff_max_s,
    )


def _probe_index(prompts: list[list[int]]) -> int:
    """The record whose first prompt the endpoints' checks send (a one-token request): the shortest,
    the first of equals. The cheapest request, and not the first record by rule: a context that
    fails on every server (HTTP 500 after every retry) would otherwise, as the first record, fail
    every endpoint's check on every run, where in the work it is only dropped (undeliverable)."""
    return min(range(len(prompts)), key=lambda i: len(prompts[i]))


def _check_server(cfg: Config, renderer: ChatRenderer, conv: Conversation, prompt: list[int]) -> dict:
    s = cfg.distill.server
    messages = renderer.messages(conv, [], True)
    server = check_server(_server_client(cfg), s.model or cfg.model.name_or_path, s.api, messages, prompt)
    if launch.is_main():
        log.info(
            "distill: %d server endpoint(s) serve %s (%s API)",
            len(server["endpoints"]),
            ", ".join(sorted({e["root"] for e in server["endpoints"]})),
            s.api,
        )
    return server


def _server_engine(plan: _Plan, renderer: ChatRenderer) -> ServerEngine:
    cfg, s = plan.cfg, plan.cfg.distill.server
    client = _server_client(cfg)
    roots = {e["root"] for e in plan.server["endpoints"]}
    probe = _probe_index(plan.prompts)
    messages, prompt = renderer.messages(plan.records[probe], [], True), plan.prompts[probe]

    def check(url: str) -> dict:  # an endpoint down since before any work, before it joins
        return check_endpoint(client, url, plan.server["model"], s.api, messages, prompt, roots=roots)

    return ServerEngine(
        client,
        model=plan.server["model"],
        tokenizer=renderer.tokenizer,
        api=s.api,
        max_new_tokens=cfg.distill.max_new_tokens,
        eos_ids=plan.eos_ids,
        end_id=reply_end_id(renderer.tokenizer, plan.eos_ids),
        temperature=cfg.distill.temperature,
        top_p=cfg.distill.top_p,
        top_k=plan.server["top_k"],
        concurrency=s.concurrency,
        down=plan.server["down"],
        readmit_after_s=s.readmit_after_s,
        check=check,
    )


def _exactness_counts(stats: dict, before: dict, rows) -> dict:
    """One shard's counts of replies that were not token-exact (see medusa_train.engines.server)."""
    delta = {k: v - before.get(k, 0) for k, v in stats.items()}
    return {
        "replies_dropped_not_round_trip": delta["not_round_trip"],
        "replies_token_count_differs": delta["token_count_differs"],
        "replies_prompt_tokens_differ": delta["prompt_tokens_differ"],
        "replies_dropped_unfinished": delta["unfinished"],
        "replies_dropped_split_by_server": delta["split_by_server"],
        "replies_dropped_undeliverable": delta["undeliverable"],
        "records_dropped_not_token_exact": sum(1 for r in rows if not r.turns),
    }


def _engine_manifest(plan: _Plan, all_stats: list[dict]) -> dict:
    if plan.server is None:
        return {"kind": "inprocess", "batch_size": plan.cfg.distill.batch_size}
    s = plan.cfg.distill.server
    counts: dict[str, dict] = {}  # every rank's engine, summed per URL
    for rank_stats in all_stats:
        for entry in rank_stats.get("endpoints", []):
            total = counts.setdefault(entry["url"], {"replies": 0, "failures": 0, "went_down": 0})
            for key in total:
                total[key] += entry[key]
    return {
        "kind": "server",
        "api": s.api,
        "model": plan.server["model"],
        "endpoints": plan.server["endpoints"],
        "concurrency_per_endpoint": s.concurrency,
        "token_exact": s.api == "tokens",
        "endpoint_counts": [{"url": url, **c} for url, c in counts.items()],
        "endpoint_counts_note": "replies, failed or moved requests and went-down events of the last invocation",
    }
