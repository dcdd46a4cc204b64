"""Stage `pretrain`: train the embedded tiny Llama from scratch, offline (model=tiny only).

This model becomes the backbone the later stages train heads on (`model=tiny` points at
`workdir/pretrain`); with a real model (`model=hf`) there is nothing to pretrain.

Run as:
    python -m medusa_train stage=pretrain                     # embedded corpus, ~5 minutes on 2 CPU cores
    python -m medusa_train stage=pretrain data=text data.path=data/text/harbour.txt
    python -m medusa_train stage=pretrain pretrain.overwrite=true pretrain.max_minutes=10

One process only: a launch of several (torchrun, the deepspeed launcher) is refused before any work,
stage=all with model=tiny included, as every rank would pretrain and publish the same folder.

Steps: (1) the output folder: a complete model made with the same settings is reused (one made
with other settings refused; `pretrain.overwrite=true` retrains), a folder of files this stage did
not write refused; (2) documents: the embedded conversations rendered with the chat template (train
split; the eval split is held out), or chunks of a plain text file (its last `heldout_fraction` held
out), and a byte-level BPE tokenizer trained on the training documents; (3) the documents tokenised
and packed into one token stream per split; (4) AdamW with warmup then cosine decay on random
windows of `seq_len + 1` tokens, until `max_minutes` or `max_steps`; (5) held-out perplexity, bits
per byte and next-token accuracy (plus, for the embedded corpus, how often greedy decoding
reproduces the reference reply exactly); (6) a standard Hugging
Face model directory (model, tokenizer, generation config, `train_report.json`) written into a
temporary folder and renamed into place, so a killed run never leaves a half-written `pretrain/`.

The cosine schedule runs on the larger of step progress and wall-clock progress, so the learning
rate reaches its floor exactly when the budget ends, whatever the speed of the machine.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_train import launch
from medusa_train.backbone import resolve_device
from medusa_train.data.embedded import conversation_texts, embedded_conversations
from medusa_train.data.sources import text_lines
from medusa_train.data.tokenizer import train_tokenizer
from medusa_train.errors import UserError
from medusa_train.transformers4 import add_legacy_config_keys, save_tokenizer
from medusa_train.workdir import (
    PRETRAIN_REPORT,
    Workdir,
    atomic_write_json,
    describe_diff,
    file_sha256,
    publish_dir,
    read_json,
    remove_stale,
    settings_of,
    staging_dir,
)

if TYPE_CHECKING:  # annotations only: config imports Hydra, which this stage does not need at run time
    from medusa_train.config import Config

log = logging.getLogger(__name__)

_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    PRETRAIN_REPORT,
)
_MAX_EVAL_TOKENS = 32_768  # held-out tokens scored at most
_TEXT_DOC_CHARS = 2000  # format=text: document size, characters
_EXACT_PROMPTS = 8  # embedded: held-out prompts decoded greedily for the exact-match rate
_MIN_LR_RATIO = 0.1  # cosine floor, fraction of the peak learning rate


def is_complete(path: Path) -> bool:
    """True when `path` holds a finished pretrained model (every file, report written last)."""
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def run(cfg: Config) -> dict:
    """Pretrain (or reuse) the embedded tiny LM and return its figures.

    Args:
        cfg: the typed `medusa_train.config.Config`; reads `cfg.pretrain`, `cfg.model`, `cfg.data`
            (`format`, `path`), `cfg.seed`.

    Returns:
        The report also saved as `pretrain/train_report.json`: steps, minutes, train loss first/last,
        held-out perplexity / bits per byte / top-1, uniform perplexity, parameter count ...
        `skipped: True` when an existing complete model was reused.

    Raises:
        UserError: not the embedded model, a launch of several processes (each would pretrain and
            publish the same folder), a `model.name_or_path` that holds another model (it would be
            replaced), a complete model made with other settings, or an unusable `data.path` for
            format=text.
    """
    if not cfg.model.embedded:
        raise UserError("stage=pretrain trains the embedded tiny model only: use model=tiny")
    if launch.world_size() > 1:
        raise UserError(
            f"stage=pretrain (also stage=all's first step with model=tiny) runs in one process, not the "
            f"{launch.world_size()} of this launch: run `python -m medusa_train stage=pretrain` without "
            "torchrun or the deepspeed launcher, then launch the stages after it one by one"
        )
    bc = cfg.pretrain
    out_dir = Path(cfg.model.name_or_path)

    # 1. The output folder: a complete model is reused, a folder of other files refused.
    done = _pretrained(cfg, out_dir)
    if done is not None:
        return {**done, "skipped": True}
    start = time.time()
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.model.device)

    # 2. Documents, and the byte-level BPE tokenizer trained on the training ones.
    docs = _documents(cfg)
    tokenizer = train_tokenizer(
        docs.tokenizer_texts, bc.vocab_size, model_max_length=bc.max_position_embeddings
    )

    # 3. Pack: one token stream per split.
    train_ids, heldout_ids = _token_streams(tokenizer, docs, bc.seq_len)
    prep_seconds = time.time() - start

    # 4. Model and training.
    model = _build_model(bc, tokenizer).to(device)
    losses, steps, train_seconds, tokens_seen = _train(model, train_ids, bc, device, cfg.seed)

    # 5. Held-out figures.
    model.eval()
    figures = _evaluate(model, tokenizer, heldout_ids, bc.seq_len, bc.batch_size, device)
    if docs.conversations:
        figures["heldout_greedy_exact"] = _greedy_exact(
            model, tokenizer, docs.heldout[:_EXACT_PROMPTS], device
        )
    report = {
        "data_format": "text" if cfg.data.format == "text" else "embedded",  # the corpus it was trained on
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "uniform_ppl": float(len(tokenizer)),
        "hidden_size": bc.hidden_size,
        "num_layers": bc.num_layers,
        "seq_len": bc.seq_len,
        "batch_size": bc.batch_size,
        "steps": steps,
        "tokens_seen": tokens_seen,
        "train_tokens_available": len(train_ids),
        "train_loss_first": losses[0],
        "train_loss_last": sum(losses[-10:]) / len(losses[-10:]),
        **figures,
        "prep_minutes": round(prep_seconds / 60, 3),
        "train_minutes": round(train_seconds / 60, 3),
        "minutes": round((time.time() - start) / 60, 3),
        "device": str(device),
        "settings": _settings(cfg),
    }

    # 6. Publish atomically.
    _save(model.cpu(), tokenizer, report, out_dir)
    log.info(
        "pretrain: %d params, %d steps, held-out ppl %.2f (uniform %d), %.3f bits/byte -> %s",
        report["params"],
        steps,
        report["heldout_ppl"],
        len(tokenizer),
        report["heldout_bits_per_byte"],
        out_dir,
    )
    return report


def _settings(cfg: Config) -> dict:
    """What the pretrained model depends on (stored in its report, compared before it is reused):
    every `pretrain.*` field but the run-only ones, the global `seed`, and the corpus: the embedded
    one, or the `data=text` file by content (a moved or renamed copy is the same corpus)."""
    corpus: dict = {"format": "embedded"}
    if cfg.data.format == "text":
        path = Path(cfg.data.path or "")
        corpus = {"format": "text", "sha256": file_sha256(path) if path.is_file() else None}
    return settings_of(pretrain=cfg.pretrain, seed=cfg.seed, data=corpus)


def _settable(name: str) -> bool:
    """Whether a dotted settings name is a config key (the file's checksum is derived from data.path)."""
    return name != "data.sha256"


def _pretrained(cfg: Config, out_dir: Path) -> dict | None:
    """Step 1: the report of the complete model in `out_dir` (None: pretrain it), after putting back
    the previous model a kill left aside.

    Raises:
        UserError: `out_dir` is not the workdir's own folder and holds files this stage did not write
            (pretraining would replace them), or it holds a complete model made with other settings
            (a report written before settings were recorded is reused as it is).
    """
    remove_stale(out_dir)  # a run killed while publishing: the previous model comes back
    if is_complete(out_dir) and not cfg.pretrain.overwrite:
        report = read_json(
            out_dir / PRETRAIN_REPORT,
            repair="run `python -m medusa_train stage=pretrain pretrain.overwrite=true` to pretrain again",
        )
        stored, current = report.get("settings"), _settings(cfg)
        if stored is not None and stored != current:
            raise UserError(
                f"{out_dir} holds a model pretrained with other settings: "
                f"{describe_diff(stored, current, settable=_settable)}: rerun with its settings to use it, "
                "or pass pretrain.overwrite=true to pretrain again"
            )
        log.info("embedded model already pretrained at %s (pretrain.overwrite=true retrains)", out_dir)
        return report
    own = out_dir.absolute() == Workdir(Path(cfg.workdir)).pretrain.absolute()  # the workdir's own folder
    if not own and out_dir.exists() and not (out_dir / PRETRAIN_REPORT).is_file() and any(out_dir.iterdir()):
        # elsewhere, and not written by this stage (it publishes a whole folder, report included, or nothing)
        raise UserError(
            f"model.name_or_path={out_dir} holds files stage=pretrain did not write (no {PRETRAIN_REPORT}), "
            "which pretraining would replace: leave model.name_or_path at its model=tiny default "
            "(${workdir}/pretrain) or point it at a new folder"
        )
    return None


@dataclass
class _Documents:
    """Step 2's training and held-out documents: strings (format=text) or conversations (embedded,
    rendered with the tokenizer's chat template once it is trained)."""

    train: list
    heldout: list
    tokenizer_texts: list[str]
    """What the tokenizer learns from."""
    conversations: bool

    def texts(self, tokenizer) -> tuple[list[str], list[str]]:
        """The training and held-out documents as strings."""
        if not self.conversations:
            return self.train, self.heldout

        def render(convs: list) -> list[str]:
            return [tokenizer.apply_chat_template(c, tokenize=False) for c in convs]

        return render(self.train), render(self.heldout)


def _documents(cfg: Config) -> _Documents:
    """Step 2: chunks of a plain text file (its last `heldout_fraction` held out), or the embedded
    conversations (train split; the eval split held out)."""
    bc = cfg.pretrain
    if cfg.data.format == "text":
        train_docs, heldout_docs, tok_texts = _text_documents(cfg.data.path, bc.heldout_fraction)
        return _Documents(train_docs, heldout_docs, tok_texts, conversations=False)
    train_convs = embedded_conversations("train", bc.num_conversations, cfg.seed)
    heldout_convs = embedded_conversations(
        "eval", max(1, round(bc.num_conversations * bc.heldout_fraction)), cfg.seed
    )
    return _Documents(train_convs, heldout_convs, list(conversation_texts(train_convs)), conversations=True)


def _token_streams(tokenizer, docs: _Documents, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: the training and held-out documents packed into one token stream each.

    Returns:
        ``(train_ids, heldout_ids)``: (N_train,) and (N_heldout,) int64, the held-out stream cut to
        `_MAX_EVAL_TOKENS` + 1.

    Raises:
        UserError: too little text for one training window of `seq_len` tokens.
    """
    train_docs, heldout_docs = docs.texts(tokenizer)
    train_ids = _pack(tokenizer, train_docs)  # (N_train,)
    heldout_ids = _pack(tokenizer, heldout_docs)[: _MAX_EVAL_TOKENS + 1]  # (N_heldout,)
    if len(train_ids) < seq_len + 2 or len(heldout_ids) < 2:
        raise UserError(
            f"too little text to train on: {len(train_ids)} training tokens for pretrain.seq_len={seq_len}"
        )
    log.info(
        "tokenizer %d tokens; %d training tokens, %d held-out",
        len(tokenizer),
        len(train_ids),
        len(heldout_ids),
    )
    return train_ids, heldout_ids


def _text_documents(path: str | None, heldout_fraction: float) -> tuple[list[str], list[str], list[str]]:
    """Split a plain text file into training / held-out documents of about `_TEXT_DOC_CHARS` characters."""
    file = Path(path or "")
    if not file.is_file():
        raise UserError(f"data.path={path!r} is not a file: give a plain text file for data.format=text")
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte-order mark dropped, as the prompt reader does
    except UnicodeDecodeError as err:
        raise UserError(
            f"data.path={path!r} is not a UTF-8 text file (byte {err.start}): convert it to UTF-8"
        ) from None
    cut = text.rfind("\n", 0, int(len(text) * (1 - heldout_fraction))) + 1 or int(
        len(text) * (1 - heldout_fraction)
    )
    train_text, heldout_text = text[:cut], text[cut:]
    if not train_text.strip() or not heldout_text.strip():
        raise UserError(f"data.path={path!r} is too short to split into training and held-out text")

    def chunks(t: str) -> list[str]:
        out, pos = [], 0
        while pos < len(t):
            end = t.find("\n", pos + _TEXT_DOC_CHARS)
            end = len(t) if end < 0 else end + 1
            out.append(t[pos:end])
            pos = end
        return out

    train_docs = chunks(train_text)
    return train_docs, chunks(heldout_text), text_lines(train_text)


def _pack(tokenizer, docs: list[str]) -> torch.Tensor:
    """Concatenate the documents' token ids into one stream (documents carry their own BOS/EOS).

    Returns:
        (N,) int64 tensor.
    """
    ids: list[int] = []
    for start in range(0, len(docs), 2048):
        for seq in tokenizer(docs[start : start + 2048], add_special_tokens=False, verbose=False)[
            "input_ids"
        ]:
            ids.extend(seq)
    return torch.tensor(ids, dtype=torch.long)


def _build_model(bc, tokenizer) -> LlamaForCausalLM:
    """The tiny Llama of `pretrain.*` (tied embeddings), random, with the tokenizer's special ids."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=bc.hidden_size,
        intermediate_size=bc.intermediate_size,
        num_hidden_layers=bc.num_layers,
        num_attention_heads=bc.num_attention_heads,
        num_key_value_heads=bc.num_attention_heads,
        max_position_embeddings=bc.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _lr_factor(step: int, progress: float, warmup_steps: int) -> float:
    """Linear warmup over `warmup_steps`, then cosine from 1 to `_MIN_LR_RATIO` as `progress` goes 0 -> 1."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    cosine = _MIN_LR_RATIO + (1 - _MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return warm * cosine


def _train(
    model, ids: torch.Tensor, bc, device: torch.device, seed: int
) -> tuple[list[float], int, float, int]:
    """Optimise on random windows of the packed stream until the step cap or the time budget.

    Returns:
        (per-step losses, steps, seconds spent, tokens seen)
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=bc.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(seed)
    budget = bc.max_minutes * 60
    T, B = bc.seq_len, bc.batch_size
    offsets = torch.arange(T + 1)  # (T+1,)
    losses: list[float] = []
    model.train()
    start = time.time()
    bar = tqdm(total=bc.max_steps, desc="pretrain", unit="step", dynamic_ncols=True)
    step = 0
    while step < bc.max_steps:
        elapsed = time.time() - start
        if elapsed >= budget:
            break
        progress = max(step / bc.max_steps, elapsed / budget)
        lr = bc.lr * _lr_factor(step, progress, bc.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(ids) - T - 1, (B,), generator=gen)  # (B,)
        window = ids[starts[:, None] + offsets].to(device)  # (B, T+1)
        logits = model(input_ids=window[:, :-1]).logits  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        losses.append(loss.item())
        seconds = time.time() - start
        # the bar's total is the step count the budget allows at the speed so far (or the step cap)
        bar.total = min(bc.max_steps, max(step, round(step * budget / max(seconds, 1e-9))))
        bar.set_postfix(  # refresh=False: drawn by update(), at most every tqdm mininterval
            loss=f"{losses[-1]:.3f}",
            lr=f"{lr:.1e}",
            tok_s=f"{step * B * T / max(seconds, 1e-9):.0f}",
            refresh=False,
        )
        bar.update(1)
    bar.close()
    return losses, step, time.time() - start, step * B * T


def _token_bytes(tokenizer) -> torch.Tensor:
    """UTF-8 bytes each token stands for: byte-level tokens have one character per byte; special tokens count
    as their literal text. Returns (V,) float tensor."""
    special = set(tokenizer.all_special_ids)
    out = torch.zeros(len(tokenizer))
    for token, idx in tokenizer.get_vocab().items():
        out[idx] = len(token.encode("utf-8")) if idx in special else len(token)
    return out


@torch.no_grad()
def _evaluate(
    model, tokenizer, ids: torch.Tensor, seq_len: int, batch_size: int, device: torch.device
) -> dict:
    """Perplexity, bits per byte and top-1 accuracy over the held-out stream (non-overlapping windows)."""
    T = seq_len
    n_windows = max(1, (len(ids) - 1) // T)
    token_bytes = _token_bytes(tokenizer)
    nll = correct = count = n_bytes = 0.0
    for first in range(0, n_windows, batch_size):
        rows = [ids[w * T : w * T + T + 1] for w in range(first, min(n_windows, first + batch_size))]
        rows = [r for r in rows if len(r) > 1]
        width = min(len(r) for r in rows)
        window = torch.stack([r[:width] for r in rows]).to(device)  # (b, width)
        logits = model(input_ids=window[:, :-1]).logits.float()  # (b, width-1, V)
        targets = window[:, 1:]  # (b, width-1)
        nll += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum"
        ).item()
        correct += (logits.argmax(-1) == targets).sum().item()
        count += targets.numel()
        n_bytes += token_bytes[targets.cpu()].sum().item()
    return {
        "heldout_tokens": int(count),
        "heldout_loss": nll / count,
        "heldout_ppl": math.exp(nll / count),
        "heldout_bits_per_byte": nll / math.log(2) / n_bytes,
        "heldout_top1": correct / count,
    }


@torch.no_grad()
def _greedy_exact(model, tokenizer, convs: list, device: torch.device) -> float:
    """Fraction of held-out first replies that greedy decoding reproduces exactly."""
    if not convs:
        return 0.0
    prompts = [
        tokenizer.apply_chat_template(c[:1], tokenize=False, add_generation_prompt=True) for c in convs
    ]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, add_special_tokens=False, return_tensors="pt", padding=True).to(device)
    tokenizer.padding_side = side
    room = model.config.max_position_embeddings - batch["input_ids"].shape[1]
    out = model.generate(**batch, max_new_tokens=max(1, min(160, room)), do_sample=False)  # (B, P + new)
    replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(r == c[1]["content"] for r, c in zip(replies, convs, strict=True)) / len(convs)


def _save(model, tokenizer, report: dict, out_dir: Path) -> None:
    """Write into a staging folder beside `out_dir` (report last), then swap it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out_dir)
    tmp = staging_dir(out_dir)
    model.save_pretrained(tmp)
    # A Medusa-1 export names this folder as its base model: consumers on transformers 4.x read it too.
    add_legacy_config_keys(tmp)
    save_tokenizer(tokenizer, tmp)
    atomic_write_json(tmp / PRETRAIN_REPORT, report)
    publish_dir(tmp, out_dir)
