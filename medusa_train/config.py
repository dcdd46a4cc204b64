"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore.

`conf/config.yaml` composes these with the groups in `conf/` (model, data, training, deepspeed,
tree, tracking). Every field is documented here, with units. Composition runs OmegaConf's type
checks (a misspelt key or a wrong type fails before any work, naming the key), then
``OmegaConf.to_object`` builds the dataclasses below, whose ``__post_init__`` checks the
combinations that types alone cannot express and the range of every number (sizes, counts, rates,
fractions, seeds; each field's docstring gives it; NaN and infinities never pass), so that no value
starts unbounded or empty work (tests/unit/test_config.py holds an out-of-range value for each).

``medusa_train/__main__.py`` and the stages read this config, and so do the building blocks that
take one of its groups as their settings (``backbone.load_configured_backbone``: ``cfg.model``;
``decoding.tree.tree_for_heads``: ``cfg.tree``; ``decoding.timing``'s ``tau_of``: ``cfg.eval``;
``tracking.start_tracking``: ``cfg.tracking``; ``training.recipes`` and ``training.medusa2``;
``workdir.settings_of``); the other reusable parts (heads, decoding, losses, data readers,
engines) take plain arguments.

What decides whether a stage skips, resumes or redoes its work (one rule, for every stage): the
stage's *settings*, a JSON dict that ``workdir.settings_of`` builds from the config groups it hands
over whole (``pretrain`` for stage=pretrain, ``data`` and ``distill`` for stage=distill,
``training`` for stage=train, ``tree`` for the train stage's calibration) and from its inputs'
identities; stored with the output, compared on the next run. Every field of those groups counts, a
field added later included, unless it is declared with :func:`run_only` (it steers how a run goes,
not what it produces: ``overwrite``, a batch split, a time budget); its class docstring says why. A
stage's docstring names the other values it adds (``model.dtype``, the backbone's fingerprint, ...).
The other groups' fields count only where a stage names them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from medusa_train.choices import MEDUSA_63, TreeError, normalise_choices
from medusa_train.errors import ConfigError
from medusa_train.head_loss import parse_head_loss
from medusa_train.workdir import RUN_ONLY

STAGES = ("pretrain", "distill", "train", "export", "eval", "all")
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
DEVICE_SPEC = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
"""The values `model.device` accepts (whether this machine has the device is checked when it is used)."""


def run_only(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field left out of its stage's skip/resume settings (see the module docstring).

    Used as the field's default: ``overwrite: bool = run_only(False)``; a changed value neither
    redoes nor refuses earlier work.
    """
    return field(default=default, default_factory=default_factory, metadata={RUN_ONLY: True})


def _choice(key: str, value: Any, options: tuple) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, options))}")


LR_SCHEDULERS = (
    "cosine",
    "linear",
    "constant",
    "constant_with_warmup",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
)
"""transformers' schedulers the trainer can build from a name alone (the others need
``lr_scheduler_kwargs`` or evaluation metrics)."""
SEED_MAX = 2**32 - 1
"""Largest seed: ``transformers.set_seed`` hands the seed to NumPy, which takes 0 .. 2**32 - 1."""


def _range(
    key: str,
    value: float | None,
    low: float,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise ConfigError unless ``low <= value <= high`` (``<`` where open); NaN and infinities fail too.

    ``None`` passes: fields typed ``X | None`` use it for "all" / "no limit".
    """
    if value is None:
        return
    above = value > low if low_open else value >= low
    below = high is None or (value < high if high_open else value <= high)
    if math.isfinite(value) and above and below:
        return
    if high is None:
        allowed = f"{'>' if low_open else '>='} {low}"
    else:
        allowed = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    finite = "" if math.isfinite(value) else "a finite number "
    raise ConfigError(f"{key}={value} must be {finite}{allowed}")


def _positive(key: str, value: float | None, allow_zero: bool = False) -> None:
    """``value > 0`` (``>= 0`` with ``allow_zero``), finite; None passes."""
    _range(key, value, 0, low_open=not allow_zero)


def _seed(key: str, value: int) -> None:
    _range(key, value, 0, SEED_MAX)


def _home(path: str | None) -> str | None:
    """``path`` with a leading ``~`` or ``~user`` expanded as a shell expands it (``os.path.expanduser``);
    any other path, and None, as they are (a Hub id never starts with ``~``)."""
    return os.path.expanduser(path) if path else path


@dataclass
class ModelConfig:
    """The backbone: any Hugging Face causal LM, or the embedded tiny one (`model=tiny`).

    Not handed to a stage's settings whole: the backbone counts by its weights' fingerprint, and
    stage=distill and stage=train add `dtype` and `quantization` by name (a field added here counts
    only where a stage adds it).
    """

    name_or_path: str = MISSING
    """Hub id or local directory of the backbone. `model=tiny` points at `${workdir}/pretrain`,
    which `stage=pretrain` creates; everything downstream loads it like any other model. After
    `training=medusa2`, export and eval use the backbone trained with the heads (`heads/backbone`; a
    LoRA adapter is merged into this model) unless this names another checkpoint than the run's base."""
    embedded: bool = False
    """True only for `model=tiny`: `stage=pretrain` may (re)create the model at `name_or_path`."""
    dtype: str = "float32"
    """Weights dtype: float32 | bfloat16 | float16 | auto (bfloat16 on a CUDA GPU that computes it natively,
    compute capability 8 or later; float32 elsewhere; the `model=hf` preset's default)."""
    quantization: str = "none"
    """none | 8bit | 4bit (bitsandbytes; 4bit is nf4). Frozen backbone only, or QLoRA in medusa2."""
    trust_remote_code: bool = False
    """Passed to `from_pretrained`; leave False unless you trust the model repository. For a model whose
    config.json has an `auto_map`, it also decides whether that code is part of the backbone's
    fingerprint (distilled data and heads of a run with it are another backbone's for a run without)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when `name_or_path` is a hub id."""
    device: str = "auto"
    """auto (cuda if available, else cpu) | cpu | cuda | cuda:N | mps. Under a launcher with several ranks
    auto and cuda are each rank's GPU (cuda:LOCAL_RANK) and another cuda:N is refused. A device this
    machine does not have fails before any work."""

    def __post_init__(self) -> None:
        self.name_or_path = _home(self.name_or_path)
        _choice("model.dtype", self.dtype, ("float32", "bfloat16", "float16", "auto"))
        _choice("model.quantization", self.quantization, ("none", "8bit", "4bit"))
        if not DEVICE_SPEC.fullmatch(self.device):
            raise ConfigError(f"model.device={self.device!r} is not one of auto, cpu, cuda, cuda:N, mps")


@dataclass
class PretrainConfig:
    """`stage=pretrain`: train the embedded tiny Llama (model=tiny only), the backbone of the demo.

    Part of stage=pretrain's settings (every field but the `run_only` one, `overwrite`; with the global
    `seed` and the corpus): a complete model made with other settings is refused, not reused.
    """

    vocab_size: int = 2048
    """BPE vocabulary size of the embedded tokenizer; >= 262 (the 256 byte tokens and 6 special tokens)."""
    hidden_size: int = 192
    """Width of the tiny Llama (3.05M parameters at the defaults). Chosen for the Medusa demo, not only
    for perplexity: a 128-wide 4-layer model (1.05M) learns the corpus faster per second, but its
    forward is so cheap (~1.4 ms on 2 cores) that the decoder's fixed per-step cost eats the gain
    (measured tau 2.45, speed-up 1.38x); at 192 x 6 layers the same pipeline measured tau 4.0 and
    2.4x (docs/benchmarks.md). A model the size of a real LLM is forward-bound anyway."""
    num_layers: int = 6
    """Decoder layers, >= 1."""
    num_attention_heads: int = 6
    """Attention heads, >= 1 (head dim = hidden_size / num_attention_heads)."""
    intermediate_size: int = 512
    """MLP width, >= 1."""
    max_position_embeddings: int = 1024
    """Context limit the tiny model declares, tokens. It only trains on `seq_len`-token windows, and
    past them its quality drops (held-out perplexity of the demo's model, measured 2026-11-22: 3.8 at
    positions 128-255, 5.2 at 256-383, 8.1 at 384-511, 13.9 at 512-767). 18 of the demo's 600
    distilled records run past 256 tokens (the longest: 309). The limit stays at 1024 so that
    `distill.max_new_tokens=256` still leaves room for prompts (distill caps prompts at this minus
    max_new_tokens). At least `seq_len`."""
    seq_len: int = 256
    """Training sequence length, tokens (documents are packed); 2 .. max_position_embeddings."""
    batch_size: int = 8
    """Sequences per optimizer step, >= 1; small batches give more steps in the short CPU budget."""
    lr: float = 4e-3
    """Peak AdamW learning rate, > 0; cosine decay to 10% of it over the step cap or the time budget."""
    warmup_steps: int = 30
    """Linear learning-rate warm-up, optimizer steps, >= 0."""
    max_steps: int = 100000
    """Step cap, >= 1; the wall-clock budget `max_minutes` usually ends training first."""
    max_minutes: float = 3.5
    """Wall-clock budget for the optimisation loop, minutes, > 0 (tokenizer + eval come on top)."""
    num_conversations: int = 30000
    """Embedded corpus size (conversations) used to train tokenizer and model, >= 1."""
    heldout_fraction: float = 0.05
    """Fraction of documents held out to measure perplexity, in (0, 1)."""
    overwrite: bool = run_only(False)
    """Retrain even if `workdir/pretrain` is complete (instead of reusing it, or refusing it when it was
    made with other settings)."""

    def __post_init__(self) -> None:
        _range("pretrain.vocab_size", self.vocab_size, 262)
        for key in (
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "batch_size",
            "max_steps",
            "num_conversations",
        ):
            _range(f"pretrain.{key}", getattr(self, key), 1)
        _range("pretrain.seq_len", self.seq_len, 2, self.max_position_embeddings)
        _positive("pretrain.lr", self.lr)
        _range("pretrain.warmup_steps", self.warmup_steps, 0)
        _positive("pretrain.max_minutes", self.max_minutes)
        _range("pretrain.heldout_fraction", self.heldout_fraction, 0, 1, low_open=True, high_open=True)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("pretrain.hidden_size must be divisible by pretrain.num_attention_heads")


@dataclass
class DataConfig:
    """Where prompts/conversations come from (`data=` group).

    Part of stage=distill's settings (every field but the `run_only` ones: `strict` only
    decides whether a bad record fails the run or is skipped; a run that completes distills the same
    records either way).
    """

    format: str = "embedded"
    """embedded | sharegpt | alpaca | mtbench | jsonl | text | hub."""
    path: str | None = None
    """File (or directory of files) for sharegpt/alpaca/mtbench/jsonl/text."""
    name: str | None = None
    """`datasets.load_dataset` name for format=hub (needs network)."""
    subset: str | None = None
    """Dataset config name for format=hub."""
    split: str = "train"
    """Split for format=hub."""
    hub_format: str = "sharegpt"
    """How to read hub records: sharegpt | alpaca | mtbench | jsonl."""
    prompt_key: str = "prompt"
    """format=jsonl: the key holding the prompt text."""
    max_records: int | None = None
    """Use at most this many records (after skipping bad ones), >= 1; null = all."""
    num_prompts: int = 600
    """format=embedded: how many prompts of the embedded train split to distill, >= 1."""
    text_prompt_chars: int = 400
    """format=text: prompts are consecutive chunks of about this many characters, >= 1."""
    max_prompt_tokens: int = 512
    """Token limit of a distillation context, >= 1 (capped at the model's max_position_embeddings minus
    distill.max_new_tokens): longer first prompts are handled by `long_prompts`; a later turn whose
    context would be longer is not answered (the conversation ends with the previous reply)."""
    long_prompts: str = "skip"
    """skip (count + warn) | truncate (keep the last max_prompt_tokens tokens of the first prompt)."""
    strict: bool = run_only(False)
    """Fail on the first bad record (malformed JSON, empty conversation, leading assistant turn, prompt
    too long) naming its line, instead of skipping it with one summary warning."""
    eval_fraction: float = 0.05
    """Fraction of distilled records held out for head accuracy / tree calibration, in [0, 1)."""

    def __post_init__(self) -> None:
        self.path, self.name = _home(self.path), _home(self.name)
        _choice(
            "data.format", self.format, ("embedded", "sharegpt", "alpaca", "mtbench", "jsonl", "text", "hub")
        )
        _choice("data.hub_format", self.hub_format, ("sharegpt", "alpaca", "mtbench", "jsonl"))
        _choice("data.long_prompts", self.long_prompts, ("skip", "truncate"))
        if self.format in ("sharegpt", "alpaca", "mtbench", "jsonl", "text") and not self.path:
            raise ConfigError(f"data.format={self.format} needs data.path=<file>")
        if self.format == "hub" and not self.name:
            raise ConfigError("data.format=hub needs data.name=<dataset id>")
        _range("data.max_records", self.max_records, 1)
        _range("data.num_prompts", self.num_prompts, 1)
        _range("data.text_prompt_chars", self.text_prompt_chars, 1)
        _range("data.max_prompt_tokens", self.max_prompt_tokens, 1)
        _range("data.eval_fraction", self.eval_fraction, 0, 1, high_open=True)


def _server_url_problem(url: str) -> str | None:
    """Why ``url`` is no base URL the client can send to, or None (the client takes a malformed one for a
    server that does not answer, and retries it for the whole budget)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as err:  # an unclosed IPv6 bracket, a port that is no number 0-65535
        return f"{err} (give http(s)://host:port/..., the port a number 1-65535)"
    if parts.scheme not in ("http", "https"):
        return "it must start with http:// or https://"
    if not (url.isascii() and url.isprintable()) or " " in url:
        return "it holds a space, a control or a non-ASCII character"
    if not parts.hostname:
        return "it has no host"
    if port == 0:
        return "its port must be a number 1-65535"
    if parts.query or parts.fragment:
        return "it has a query or fragment (?, #): give the base URL, e.g. http://host:8000/v1"
    return None


@dataclass
class DistillServerConfig:
    """`distill.engine=server`: OpenAI-compatible endpoints (vLLM, SGLang, TGI, `transformers serve`)."""

    urls: list[str] = field(default_factory=lambda: [])
    """Base URLs ending in /v1, e.g. `[http://gpu0:8000/v1,http://gpu1:8000/v1]`; requests are spread
    over them (the least busy first). No credentials in URLs: use `api_key_env`."""
    model: str | None = None
    """The served model name requests ask for (vLLM `--served-model-name`, the path given to
    `transformers serve`); null = `model.name_or_path`. Checked against `/v1/models` before any work."""
    api_key_env: str | None = None
    """NAME of the environment variable holding the API key (sent as `Authorization: Bearer`); the
    key itself is never stored in configs, manifests or logs. null = no key. Whitespace around the
    key (a mounted secret's trailing newline) is dropped; a named variable that is not set or blank,
    or a key with characters no HTTP header carries, fails before any work, without quoting it."""
    api: str = "chat"
    """chat: `/v1/chat/completions` with the conversation as messages; the server applies the chat
    template and returns text, which is re-tokenised (every server). tokens: `/v1/completions` with our
    exact token-id prompt and the generated ids returned (`return_token_ids` /
    `return_tokens_as_token_ids`, vLLM only): token-exact."""
    concurrency: int = 8
    """Requests in flight per endpoint (the server batches them)."""
    timeout_s: float = 600.0
    """Seconds one request may take (connect + generate) before it is retried."""
    max_retries: int = 6
    """Retries of a request after a connection error, a timeout, HTTP 408/424/425/429/500/502/503/504
    or an answer that is not JSON, with exponential backoff and jitter; after that its endpoint is
    marked down and its requests go to the other URLs (failover); when every URL is down the run stops
    with one line naming each (finished shards kept)."""
    backoff_s: float = 1.0
    """First retry delay, seconds; doubled per retry (x0.5-1.0 jitter), capped at `backoff_max_s`."""
    backoff_max_s: float = 60.0
    """Longest delay between two retries, seconds."""
    readmit_after_s: float = 30.0
    """Seconds a down endpoint waits before one `GET /v1/models` probes it; it rejoins when that gets
    an answer (an endpoint down since before any work: when it passes the model check)."""

    def __post_init__(self) -> None:
        _choice("distill.server.api", self.api, ("chat", "tokens"))
        for url in self.urls:
            if "@" in url.split("://", 1)[-1].split("/", 1)[0]:  # first: no message may quote it
                raise ConfigError(
                    "distill.server.urls must not hold credentials: put the key in an environment "
                    "variable and name it in distill.server.api_key_env"
                )
            problem = _server_url_problem(url)
            if problem:
                raise ConfigError(f"distill.server.urls: {url!r} is not a server URL: {problem}")
        _range("distill.server.concurrency", self.concurrency, 1, 4096)
        _range("distill.server.timeout_s", self.timeout_s, 0, low_open=True)
        _range("distill.server.max_retries", self.max_retries, 0, 100)
        _range("distill.server.backoff_s", self.backoff_s, 0)
        _range("distill.server.backoff_max_s", self.backoff_max_s, 0)
        _range("distill.server.readmit_after_s", self.readmit_after_s, 0)


@dataclass
class DistillConfig:
    """`stage=distill`: regenerate every assistant turn with the frozen backbone.

    Part of stage=distill's settings (every field but the `run_only` ones: `overwrite` steers
    the run; `batch_size` changes no record (greedy replies equal unbatched `generate`, and each
    record samples with its own seeded generator, both tested), so a run may resume with another
    batch size; `engine` and `server` enter the settings through the stage (with engine=server only:
    the api and served model, never URLs or the key), so in-process folders keep their settings).
    """

    max_new_tokens: int = 256
    """Per assistant turn, tokens, >= 1."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples (with top_p, and the top-k and min-p the model's generation config sets).
    Finite, >= 0."""
    top_p: float = 1.0
    """Nucleus sampling mass when temperature > 0, in (0, 1] (1.0 = off)."""
    batch_size: int = run_only(16)
    """Rows generated together, >= 1 (continuous batching: a finished row frees its slot for the next prompt)."""
    shard_size: int = 256
    """Records per Arrow shard, >= 1; a killed run loses at most the shard in progress."""
    seed: int = 0
    """Sampling seed, 0 .. 2**32 - 1 (per record and turn, so results do not depend on batching or rank)."""
    overwrite: bool = run_only(False)
    """Discard an existing distill folder made with other settings (backbone fingerprint, dtype,
    tokenizer, every distill.* and data.* field but batch_size, strict and eval_fraction, and with
    distill.engine=server the served model, not the URLs or client settings; top_p and seed
    only when sampling) instead of refusing; a folder with the same settings is always resumed or,
    when complete, reused as is."""
    engine: str = run_only("inprocess")
    """inprocess: the backbone generates in this process (continuous batching, `batch_size` rows).
    server: OpenAI-compatible servers generate (`distill.server`); this process loads only the
    tokenizer and config of `model.name_or_path` (which must be the served model's)."""
    server: DistillServerConfig = run_only(default_factory=DistillServerConfig)

    def __post_init__(self) -> None:
        _choice("distill.engine", self.engine, ("inprocess", "server"))
        if self.engine == "server" and not self.server.urls:
            raise ConfigError("distill.engine=server needs distill.server.urls=[http://host:port/v1,...]")
        _range("distill.max_new_tokens", self.max_new_tokens, 1)
        _positive("distill.temperature", self.temperature, allow_zero=True)
        _range("distill.top_p", self.top_p, 0, 1, low_open=True)
        _range("distill.batch_size", self.batch_size, 1)
        _range("distill.shard_size", self.shard_size, 1)
        _seed("distill.seed", self.seed)


@dataclass
class TrainingConfig:
    """`stage=train` (`training=medusa1|medusa2`).

    Part of the trained heads' settings (every field but the `run_only` ones: how a run goes,
    not what it trains. The batch split (the settings hold the global batch size instead), the time
    budget (a stopped run resumes under any budget), loss chunking and the hidden-state cache (same
    heads up to rounding), logging and checkpointing, ``overwrite``; and ``calibration_max_records``,
    which is part of the calibration's settings: a change re-runs only the calibration).

    The `medusa2` options are refused with training=medusa1: nothing reads them there, and a value
    given was meant for a Medusa-2 run.
    """

    mode: str = "medusa1"
    """medusa1 (frozen backbone, heads only) | medusa2 (joint training)."""
    num_heads: int = 4
    """K, >= 1: head k predicts token t+k+1."""
    num_layers: int = 1
    """Residual blocks per head, >= 0."""
    init_from_lm_head: bool = True
    """Initialise every head's vocab projection from the backbone's lm_head (truncated: its rows of the
    draft vocabulary; shared heads use the lm_head itself whatever this says). Refused over a backbone
    whose lm_head reads a prediction head's output of another width than the last hidden state the heads
    read (ELECTRA, RemBERT): set false there."""
    head_projection: str = "own"
    """How each head maps its features to tokens: own (a d x V projection per head, the paper's) | shared
    (every head reuses the backbone's lm_head: only the residual blocks are stored and trained; needs a
    backbone with an output embedding and num_layers >= 1) | truncated (a d x N projection per head over
    the N = draft_vocab_size most frequent target tokens of the distilled training split, saved as
    token_map; candidates are mapped back to full-vocabulary ids when decoding). See docs/training.md."""
    draft_vocab_size: int | None = None
    """head_projection=truncated: N, tokens in the draft vocabulary, 1..V-1 (V: the backbone's vocabulary
    size, checked before training; all V tokens are head_projection=own). Must be unset for own and
    shared."""
    decay: float = 0.8
    """Head-loss weights lambda_k = decay^(k-1), decay in (0, 1]."""
    head_loss: str = "ce"
    """What each head's prediction is compared with: ce (cross-entropy against the token the backbone
    generated) | kl (KL(p || q) to the backbone's own next-token distribution p at the position whose
    next token the head predicts: soft labels) | tv (total variation 0.5 * sum |p - q| to the same p) |
    a weighted sum of them, written like kl+0.5ce or 0.5*kl+0.5*tv. Truncated heads compare with p
    renormalised on their draft vocabulary. See docs/training.md."""
    head_loss_temperature: float = 1.0
    """Softmax temperature of the backbone's distribution p in the kl/tv terms, > 0 (1 = as decoded at
    T=1; < 1 sharpens p towards the generated token)."""
    lr: float = 1e-3
    """Learning rate of the heads (medusa1) / of the backbone (medusa2), > 0."""
    weight_decay: float = 0.0
    """AdamW weight decay, >= 0."""
    warmup_ratio: float = 0.05
    """Fraction of the total optimizer steps spent in linear warm-up, in [0, 1)."""
    lr_scheduler: str = "cosine"
    """A transformers scheduler that needs no extra arguments: cosine | linear | constant |
    constant_with_warmup | cosine_with_restarts | polynomial | inverse_sqrt."""
    per_device_batch_size: int = run_only(8)
    """Sequences per process per micro-batch, >= 1 (global batch = this x processes x accumulation)."""
    gradient_accumulation_steps: int = run_only(1)
    """Micro-batches per optimizer step, >= 1."""
    num_epochs: float = 1.0
    """Passes over the training split (fractions allowed), >= 0 (> 0 unless max_steps is set)."""
    max_steps: int = -1
    """Overrides num_epochs when >= 1; -1 = use num_epochs (no other value below 1)."""
    max_minutes: float | None = run_only(None)
    """Optional wall-clock budget, minutes, > 0: training stops cleanly (and saves) when reached; null = none."""
    max_seq_len: int = 512
    """Longer distilled records are truncated to this many tokens; >= num_heads + 2 (so that the last head
    has a target)."""
    loss_chunk_size: int = run_only(512)
    """Tokens per chunk in the chunked head cross-entropy (memory vs speed), >= 1."""
    logging_steps: int = run_only(10)
    """Log loss and per-head top-1/top-5 every N >= 1 optimizer steps."""
    save_steps: int = run_only(200)
    """Checkpoint every N >= 1 optimizer steps (resumable)."""
    save_total_limit: int = run_only(2)
    """Checkpoints kept in workdir/train, >= 1 (older ones are deleted)."""
    fsync_checkpoints: bool = run_only(True)
    """Flush each checkpoint to disk (fsync) when saved, before training goes on and before an older
    one is deleted: a power loss leaves a checkpoint to resume from. false saves as the HF Trainer does
    (without fsync): faster for large checkpoints (the flush can take as long as the save itself),
    but a power loss can leave the newest checkpoint damaged (skipped on resume) and, with
    save_total_limit=1, none at all."""
    cache_hidden_states: bool = run_only(False)
    """Medusa-1: compute the backbone's last hidden states once into a memory-mapped store and
    train the heads from it (no backbone forward per epoch)."""
    seed: int = 0
    """Seed of head init, data order and dropout, 0 .. 2**32 - 1."""
    overwrite: bool = run_only(False)
    """Retrain even if `workdir/heads` is complete for the same settings (also discards `workdir/train`)."""
    init_heads: str | None = None
    """Start from these heads (a heads directory, e.g. Medusa-1 heads before Medusa-2); null = fresh heads."""
    calibration_max_records: int = run_only(200)
    """Held-out records used for the top-k accuracy table and tree calibration after training, >= 1. A change
    (like one of `tree.max_nodes|topk|latency_context|tolerance`) re-runs only the calibration of finished heads."""
    # -- medusa2 -------------------------------------------------------------------------------
    head_lr_multiplier: float = 4.0
    """medusa2: heads lr = lr * head_lr_multiplier, > 0."""
    lambda0: float = 0.2
    """medusa2: final weight of the heads' loss next to the LM loss, > 0."""
    lambda_warmup: str = "sine"
    """medusa2: constant | linear | sine | sine_r schedule of lambda0 over lambda_warmup_steps."""
    lambda_warmup_steps: int = 100
    """medusa2: optimizer steps over which lambda0 rises to its final value, counted from the end of
    heads_only_steps; >= 0."""
    lm_loss: str = "kl"
    """medusa2: kl (to the frozen original, for self-distilled data) | ce (on the data)."""
    heads_only_steps: int = 0
    """medusa2 two-stage: train heads only for N >= 0 steps, then jointly (the lambda0 warm-up starts then)."""
    backbone_tuning: str = "full"
    """medusa2: full | lora | qlora."""
    lora_r: int = 16
    """medusa2 lora/qlora: adapter rank, >= 1."""
    lora_alpha: int = 32
    """medusa2 lora/qlora: adapter scaling numerator (scale = alpha / r), >= 1."""
    lora_dropout: float = 0.05
    """medusa2 lora/qlora: dropout on the adapter input, in [0, 1)."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """medusa2 lora/qlora: module names that get adapters (at least one; each must name a module of the
    backbone, checked when it is loaded)."""

    def __post_init__(self) -> None:
        self.init_heads = _home(self.init_heads)
        _choice("training.mode", self.mode, ("medusa1", "medusa2"))
        _choice("training.lambda_warmup", self.lambda_warmup, ("constant", "linear", "sine", "sine_r"))
        _choice("training.lm_loss", self.lm_loss, ("kl", "ce"))
        _choice("training.lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        _choice("training.backbone_tuning", self.backbone_tuning, ("full", "lora", "qlora"))
        for key in (
            "num_heads",
            "per_device_batch_size",
            "gradient_accumulation_steps",
            "loss_chunk_size",
            "logging_steps",
            "save_steps",
            "save_total_limit",
            "calibration_max_records",
            "lora_r",
            "lora_alpha",
        ):
            _range(f"training.{key}", getattr(self, key), 1)
        for key in ("num_layers", "lambda_warmup_steps", "heads_only_steps"):
            _range(f"training.{key}", getattr(self, key), 0)
        parse_head_loss(self.head_loss)
        for key in ("lr", "head_lr_multiplier", "lambda0", "max_minutes", "head_loss_temperature"):
            _positive(f"training.{key}", getattr(self, key))
        _positive("training.weight_decay", self.weight_decay, allow_zero=True)
        _range("training.decay", self.decay, 0, 1, low_open=True)
        _range("training.warmup_ratio", self.warmup_ratio, 0, 1, high_open=True)
        _range("training.lora_dropout", self.lora_dropout, 0, 1, high_open=True)
        _positive("training.num_epochs", self.num_epochs, allow_zero=True)
        if self.max_steps != -1:
            _range("training.max_steps", self.max_steps, 1)
        if self.max_steps == -1 and self.num_epochs <= 0:
            raise ConfigError("set training.num_epochs > 0 or training.max_steps >= 1")
        if self.max_seq_len < self.num_heads + 2:
            raise ConfigError(
                f"training.max_seq_len={self.max_seq_len} must be >= training.num_heads + 2 = "
                f"{self.num_heads + 2} (the last head needs a target token)"
            )
        _seed("training.seed", self.seed)
        if self.backbone_tuning in ("lora", "qlora") and not self.lora_target_modules:
            raise ConfigError(
                f"training.backbone_tuning={self.backbone_tuning} needs training.lora_target_modules=[q_proj,...]"
            )
        if self.cache_hidden_states and self.mode != "medusa1":
            raise ConfigError("training.cache_hidden_states=true needs a frozen backbone (training=medusa1)")
        _choice("training.head_projection", self.head_projection, ("own", "shared", "truncated"))
        if self.head_projection == "truncated":
            if self.draft_vocab_size is None:
                raise ConfigError(
                    "training.head_projection=truncated needs training.draft_vocab_size=<N tokens>"
                )
            _range("training.draft_vocab_size", self.draft_vocab_size, 1)
        elif self.draft_vocab_size is not None:
            raise ConfigError(
                f"training.draft_vocab_size={self.draft_vocab_size} is for training.head_projection=truncated "
                f"(not {self.head_projection}): drop it or set the projection"
            )
        if self.head_projection == "shared" and self.num_layers == 0:
            raise ConfigError(
                "training.head_projection=shared needs training.num_layers >= 1: with no residual block "
                "every head would be the lm_head itself, with nothing to train"
            )
        # Nothing reads the Medusa-2 options in Medusa-1: one given was meant to take effect
        # (training.backbone_tuning=lora without training=medusa2 trained Medusa-1 heads, backbone frozen).
        for name in _MEDUSA2_ONLY if self.mode == "medusa1" else ():
            value = getattr(self, name)
            if value != _default(TrainingConfig, name):
                shown = f"[{','.join(value)}]" if isinstance(value, list) else value
                raise ConfigError(
                    f"training.{name}={shown} is a Medusa-2 option, and training=medusa1 keeps the backbone "
                    "frozen: add training=medusa2, or drop it"
                )


_MEDUSA2_ONLY = (
    "head_lr_multiplier",
    "lambda0",
    "lambda_warmup",
    "lambda_warmup_steps",
    "lm_loss",
    "heads_only_steps",
    "backbone_tuning",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
)
"""The training fields only training=medusa2 reads."""


def _default(cls: type, name: str) -> Any:
    """The default of the dataclass field ``name`` of ``cls``."""
    found = next(f for f in dataclasses.fields(cls) if f.name == name)
    return found.default_factory() if found.default_factory is not dataclasses.MISSING else found.default


@dataclass
class DeepSpeedConfig:
    """`deepspeed=none|zero2|zero3`: how the trainer shards state across processes."""

    enabled: bool = False
    """Run the trainer under DeepSpeed (set by deepspeed=zero2|zero3)."""
    zero_stage: int = 0
    """ZeRO stage 0 | 1 | 2 | 3 (used only when enabled; without DeepSpeed, torchrun runs plain DDP)."""
    offload_optimizer: bool = False
    """ZeRO: keep optimizer state in CPU memory."""
    offload_param: bool = False
    """ZeRO-3: keep parameters in CPU memory."""

    def __post_init__(self) -> None:
        _choice("deepspeed.zero_stage", self.zero_stage, (0, 1, 2, 3))
        if self.offload_param and self.zero_stage != 3:
            raise ConfigError("deepspeed.offload_param=true needs deepspeed.zero_stage=3 (deepspeed=zero3)")


@dataclass
class TreeConfig:
    """`tree=calibrated|medusa63|chain|custom`: the candidate tree verified per step.

    Part of the tree calibration's settings (stage=train; every field but the `run_only` ones:
    they pick the tree at decode time, the calibration does not read them).
    """

    name: str = run_only("calibrated")
    """calibrated (chosen after training, saved in workdir/heads) | medusa63 | chain | custom."""
    choices: list[Any] | None = run_only(None)
    """tree=custom: list of index paths, e.g. [[0], [0, 0], [1]]: each a non-empty list of ranks >= 0, every
    path's parent in the list too, at most as deep as the heads are many (stage=all: training.num_heads,
    checked when the config is built; else the heads loaded); a rank must be below the heads' vocabulary
    size, draft_vocab_size for truncated heads (checked when the heads are loaded)."""
    chain_depth: int = run_only(4)
    """tree=chain: number of nodes, 1 .. the number of heads (stage=all: training.num_heads, checked when
    the config is built; else the heads loaded, e.g. eval.heads_dir's)."""
    max_nodes: int = 64
    """Calibration: largest tree considered, nodes, >= 1."""
    topk: int = 10
    """Calibration: candidates per head considered, 1 .. 10."""
    latency_context: int = 256
    """Calibration: KV-cache length at which tree forwards are timed, tokens, >= 1."""
    tolerance: float = 0.03
    """Calibration: pick the smallest tree whose expected tokens/s is within this fraction of the best
    one's, in [0, 1) (0: the best; a few percent keeps timing noise from choosing on a flat curve)."""

    def depth(self) -> int | None:
        """How many heads the tree named needs (its deepest path); None for ``calibrated``, chosen
        within the heads it is calibrated for."""
        if self.name == "chain":
            return self.chain_depth
        if self.name == "medusa63":
            return max(len(path) for path in MEDUSA_63)
        if self.name == "custom":
            return max(len(path) for path in self.choices)
        return None

    def depth_setting(self) -> str:
        """The setting that makes :meth:`depth`, for a message."""
        if self.name == "chain":
            return f"tree.chain_depth={self.chain_depth}"
        return f"tree={self.name} ({self.depth()} deep)"

    def __post_init__(self) -> None:
        _choice("tree.name", self.name, ("calibrated", "medusa63", "chain", "custom"))
        if self.name == "custom" and not self.choices:
            raise ConfigError("tree=custom needs tree.choices=[[0],[0,0],...]")
        if self.name == "custom":
            try:
                normalise_choices(self.choices)
            except TreeError as err:
                raise ConfigError(f"tree.choices: {err}") from None
        _range("tree.chain_depth", self.chain_depth, 1)
        _range("tree.max_nodes", self.max_nodes, 1)
        _range("tree.topk", self.topk, 1, 10)
        _range("tree.latency_context", self.latency_context, 1)
        _range("tree.tolerance", self.tolerance, 0, 1, high_open=True)


@dataclass
class TrackingConfig:
    """`tracking=offline|online|disabled` (wandb)."""

    mode: str = "offline"
    """online (needs `wandb login`) | offline (sync later with `wandb sync`) | disabled."""
    project: str = "medusa_train"
    """wandb project."""
    entity: str | None = None
    """wandb entity (team or user); null = your default."""
    run_name: str | None = None
    """Defaults to `<stage>-<workdir name>`."""

    def __post_init__(self) -> None:
        _choice("tracking.mode", self.mode, ("online", "offline", "disabled"))


@dataclass
class ExportConfig:
    """`stage=export`."""

    heads_dir: str | None = None
    """Heads to export; null = `workdir/heads`."""
    formats: list[str] = field(default_factory=lambda: ["medusa", "vllm"])
    """medusa (FasterDecoding / TGI / TensorRT-LLM) and/or vllm."""
    dtype: str = "auto"
    """Dtype of the exported weights (heads, and the Medusa-2 backbone): auto (as trained) | float32 |
    bfloat16 | float16."""
    write_pickle: bool = False
    """Also write `medusa/medusa_lm_head.pt` (the same tensors as a torch pickle), the only weights file
    FasterDecoding's `MedusaModel.from_pretrained` opens. Off by default: loading a pickle can run code
    (a warning says so); TGI, vLLM, TensorRT-LLM and medusa_train read the safetensors file."""

    def __post_init__(self) -> None:
        self.heads_dir = _home(self.heads_dir)
        for fmt in self.formats:
            _choice("export.formats[]", fmt, ("medusa", "vllm"))
        if not self.formats:
            raise ConfigError("export.formats is empty: give at least one of medusa, vllm")
        _choice("export.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))


@dataclass
class EvalConfig:
    """`stage=eval`: tree decoding vs plain greedy on the same prompts."""

    heads_dir: str | None = None
    """Heads to evaluate (either export layout or workdir/heads); null = `workdir/heads`."""
    prompts: str = "embedded"
    """embedded (held-out embedded prompts) | mtbench | jsonl."""
    path: str | None = None
    """prompts=mtbench|jsonl: the file (e.g. data/mt_bench/question.jsonl, data/prompts.jsonl)."""
    prompt_key: str = "prompt"
    """prompts=jsonl: the key holding the prompt."""
    all_turns: bool = False
    """mtbench: evaluate every turn (conditioned on the model's own earlier answers), not only the first."""
    num_prompts: int = 40
    """Prompts evaluated (the first N >= 1 of the source)."""
    max_new_tokens: int = 128
    """New tokens per prompt turn, for both decoders, >= 1."""
    acceptance_extra: bool = True
    """Also measure tau of typical acceptance and exact sampling."""
    temperature: float = 0.7
    """Temperature for the typical / sample tau measurement, > 0."""
    posterior_threshold: float = 0.09
    """Typical acceptance: the hard probability threshold epsilon, in [0, 1] (Medusa's default 0.09)."""
    posterior_alpha: float = 0.3
    """Typical acceptance: the entropy-scaled threshold factor, in [0, 1] (Medusa's default 0.3, i.e.
    sqrt(epsilon))."""
    sweep_tree_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """Tree sizes (nodes, each >= 1) for the tau / speed-up vs tree size plot (calibrated trees); [] to skip."""
    sweep_prompts: int = 6
    """Prompts used per point of the tree-size sweep, >= 1."""
    compare: list[str] = field(default_factory=lambda: [])
    """More heads to decode the same prompts with the same tree (with `tree=calibrated`, the evaluated
    heads' tree), each with its own backbone as `eval.heads_dir` would load it: heads folders or
    workdirs holding `heads/`, e.g. `['runs/m1','runs/m2']`. report.md gets a table of every set:
    tau, speed-up, identical outputs, held-out head top-1, and for a trained (Medusa-2) backbone its
    drift from `model.name_or_path` on held-out distilled positions: argmax agreement and mean KL."""
    seed: int = 0
    """Seed of the sampling runs, 0 .. 2**32 - 1."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    """Speed-up against batch size: for each B, plain batched `generate` (left padding) vs batched
    Medusa (`medusa_generate_batch`) on the evaluated turns in groups of B (the first floor(n/B)*B
    turns; B above the number of turns is skipped); B=1 is the main run's figures; [] to skip."""
    prompt_lookup_tokens: int = 10
    """Prompt-lookup decoding (transformers' `prompt_lookup_num_tokens`, no training), measured on
    every turn next to plain greedy and Medusa: candidate tokens copied from the prompt per step."""
    assistant_model: str | None = None
    """A draft model (Hugging Face name or directory, same vocabulary as the backbone) for
    transformers' assisted generation, measured on every turn next to plain greedy; null = skip."""
    fit_tree: bool = True
    """tree=calibrated: when the stored calibration (calibration.json) was measured on another device or
    dtype than this run's, or with another tree attention than `eval.attention` takes here, calibrate the
    tree again here from its stored head accuracies and a latency curve measured now (seconds), so a tree
    tuned on a CPU is not used on a GPU; false keeps the stored tree (with a warning). Pinned trees
    (tree=medusa63|chain|custom), and a stored tree that calibration.json did not choose (other paths
    than its tree.choices: an export of a pinned tree), are never changed."""
    compile: bool = False
    """Also measure the compiled decoders on every turn: plain greedy with transformers' static cache and
    compiled forward (`cache_implementation="static"`), and Medusa's static-shape decoder (its whole step
    a CUDA graph on CUDA, `torch.compile` on CPU), at batch 1 and with B rows at each of
    `eval.batch_sizes`; the report gives Medusa's speed-up against both baselines. Off by default: on CPU compilation costs about a minute per shape and the compiled step
    pays only over long runs; on a GPU turn it on."""
    attention: str = "sdpa"
    """Tree attention of Medusa's verification forwards: sdpa (PyTorch's SDPA with a dense float mask;
    grouped-query heads packed, K/V not expanded) | triton | cuda (fused kernels reading the tree's
    ancestor bits, no mask; GPU) | auto
    (the Triton kernel on a GPU for prompts + new tokens of 8,192 or more, 2,048 in a step replayed
    as a CUDA graph, where it measured faster; else sdpa, and always on a CPU). stage=train's tree
    calibration times its tree forwards with it too (auto: as an eager decoder's call of
    `tree.latency_context` keys), so the tree is chosen for the attention that decodes it;
    calibration.json records the one timed. Not a calibration setting, like the device: a change after
    training is fitted by eval (`eval.fit_tree`). With `eval.compile`, the static decoder resolves auto
    at its capacity with the captured threshold and may run the kernel on a tree timed on SDPA
    (report.json names its attention). See docs/decoding.md."""

    def __post_init__(self) -> None:
        self.heads_dir, self.path = _home(self.heads_dir), _home(self.path)
        self.assistant_model = _home(self.assistant_model)
        self.compare = [_home(entry) for entry in self.compare]
        _choice("eval.prompts", self.prompts, ("embedded", "mtbench", "jsonl"))
        _choice("eval.attention", self.attention, ("sdpa", "triton", "cuda", "auto"))
        for size in self.batch_sizes:
            _range("eval.batch_sizes[]", size, 1)
        _range("eval.prompt_lookup_tokens", self.prompt_lookup_tokens, 1)
        if self.prompts in ("mtbench", "jsonl") and not self.path:
            raise ConfigError(f"eval.prompts={self.prompts} needs eval.path=<file>")
        _range("eval.num_prompts", self.num_prompts, 1)
        _range("eval.max_new_tokens", self.max_new_tokens, 1)
        _positive("eval.temperature", self.temperature)
        _range("eval.posterior_threshold", self.posterior_threshold, 0, 1)
        _range("eval.posterior_alpha", self.posterior_alpha, 0, 1)
        for size in self.sweep_tree_sizes:
            _range("eval.sweep_tree_sizes[]", size, 1)
        _range("eval.sweep_prompts", self.sweep_prompts, 1)
        _seed("eval.seed", self.seed)


@dataclass
class Config:
    """The whole run. `python -m medusa_train stage=<stage> [group=option ...] [key=value ...]`.

    The options that name a local path take a leading `~` or `~user` as a shell does, wherever the value
    comes from (a conf file; an override, quoted or not: no shell expands `eval.heads_dir=~/x`, and the
    value is taken as quoted; `compose_config`): `workdir` (and so `model=tiny`'s
    `${workdir}/pretrain`), `model.name_or_path`, `data.path`, `data.name`, `training.init_heads`,
    `export.heads_dir`, `eval.heads_dir`, `eval.path`, `eval.compare`'s entries and `eval.assistant_model`
    are expanded once, when the config is built, so a run given `~/x` is the run given the absolute path
    (the same folders, the same recorded settings). `distill.server.model` is the server's name for its
    model and stays as given.
    """

    stage: str = "all"
    """pretrain | distill | train | export | eval | all."""
    workdir: str = "runs/default"
    """Run directory; every stage writes a fixed subfolder and reads its inputs from here."""
    seed: int = 0
    """Global seed, 0 .. 2**32 - 1 (stages derive their own seeds from their sections)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        _choice("stage", self.stage, STAGES)
        _seed("seed", self.seed)
        if not self.workdir.strip():
            raise ConfigError("workdir is empty: name the run's folder, e.g. workdir=runs/my_run")
        self.workdir = _home(self.workdir)
        if self.stage == "pretrain" and not self.model.embedded:
            raise ConfigError(
                "stage=pretrain trains the embedded tiny model only: use model=tiny (a real model needs no pretraining)"
            )
        depth, k = self.tree.depth(), self.training.num_heads
        if (
            self.stage == "all"
            and depth is not None
            and depth > k
            and not (self.export.heads_dir and self.eval.heads_dir)
        ):
            # The heads this run trains are exported or evaluated with this tree (else checked against the
            # heads loaded, whose own K counts: heads from elsewhere, a stage of its own).
            raise ConfigError(
                f"{self.tree.depth_setting()} exceeds training.num_heads={k} (the heads this run trains): "
                f"set training.num_heads={depth} or choose a tree at most {k} deep (tree=calibrated fits the heads)"
            )
        if (
            self.model.quantization != "none"
            and self.training.mode == "medusa2"
            and self.training.backbone_tuning != "qlora"
        ):
            raise ConfigError("a quantized backbone can only be trained with training.backbone_tuning=qlora")
        if (
            self.training.head_projection == "shared"
            and self.training.mode == "medusa2"
            and self.deepspeed.enabled
            and self.deepspeed.zero_stage == 3
        ):
            raise ConfigError(
                "training.head_projection=shared with training=medusa2 cannot run under deepspeed=zero3 (the "
                "shared lm_head is partitioned): use deepspeed=zero2 or head_projection=own|truncated"
            )
        if (
            self.stage == "all"
            and self.training.head_projection == "truncated"
            and "medusa" in self.export.formats
        ):
            raise ConfigError(
                "training.head_projection=truncated heads have no FasterDecoding/TGI layout (no token map "
                "there): pass export.formats=[vllm]"
            )
        if (
            self.stage == "all"
            and self.model.embedded
            and self.training.head_projection == "truncated"
            and self.training.draft_vocab_size >= self.pretrain.vocab_size
        ):
            # The embedded tokenizer this run trains has at most pretrain.vocab_size tokens.
            raise ConfigError(
                f"training.draft_vocab_size={self.training.draft_vocab_size} is not below the embedded "
                f"backbone's vocabulary (pretrain.vocab_size={self.pretrain.vocab_size} tokens at most): truncated "
                "heads need fewer tokens (vLLM reads their token map only then): choose fewer, or train "
                "full-vocabulary heads with training.head_projection=own and training.draft_vocab_size unset"
            )


def register_configs() -> None:
    """Register the schema so `conf/config.yaml` can extend it (`defaults: [schema, ...]`)."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)


def compose_config(overrides: list[str] | None = None) -> Config:
    """Compose `conf/` with command-line style overrides and return the checked, typed config.

    Raises:
        ConfigError: a misspelt key, a wrong type, a missing group option or a bad combination.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    register_configs()
    for i, override in enumerate(overrides or []):
        _check_override_syntax(override, (overrides or [])[i + 1 : i + 2])
        _check_added_key(override, list(overrides or []))
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            dict_cfg = compose(config_name="config", overrides=[_quote_home(o) for o in overrides or []])
        missing = sorted(OmegaConf.missing_keys(dict_cfg))
        if missing:
            raise ConfigError(f"{missing[0]} is required: pass {missing[0]}=<value>")
        obj = OmegaConf.to_object(dict_cfg)
    except ConfigError:
        raise
    except Exception as err:  # Hydra / OmegaConf errors: make them one actionable line
        hint = _close_match(f"{err}\n{err.__cause__ or ''}", list(overrides or []))
        raise ConfigError(_one_line(err, hint)) from None
    finally:
        GlobalHydra.instance().clear()
    assert isinstance(obj, Config)
    return obj


_UNKNOWN_KEY = re.compile(r"Could not override '([^']+)'\.(?s:.*?)Key '([^']+)' not in")
_UNKNOWN_OPTION = re.compile(r"Could not find '([^'/]+)/([^']+)'")
_NOT_A_LIST = re.compile(r"Error merging override ([\w.]+)=(\S*)(?s:.*)is not a ListConfig")
_SWEEP = re.compile(r"Ambiguous value for argument '([\w.]+)=(.*)'$", re.M)  # a,b: a multirun sweep to Hydra


def _close_match(message: str, overrides: list[str]) -> str | None:
    """A suggestion for a misspelt key or group option in a Hydra/OmegaConf error ``message``:
    ``did you mean distill.max_new_tokens?`` for ``distill.max_new_token``, ``did you mean data=text?``
    for ``data=txt`` (with the group's options), ``did you mean training=medusa2?`` for the override
    ``trainin=medusa2`` (``overrides``: the command line's), ``give a list: eval.batch_sizes=[1,4]`` for
    ``eval.batch_sizes=1,4`` or ``=3``; None when nothing is close."""
    found = _UNKNOWN_KEY.search(message)
    if found:
        parts = found.group(1).lstrip("+~").split(".")
        if found.group(2) not in parts:
            return None
        at = parts.index(found.group(2))
        names = _field_names(parts[:at])
        if at == 0:
            names += [d.name for d in CONF_DIR.iterdir() if d.is_dir()]  # groups: `data=text`
        match = difflib.get_close_matches(parts[at], names, n=1, cutoff=0.6)
        if not match:
            return None
        fixed = ".".join([*parts[:at], match[0], *parts[at + 1 :]])
        value = next(
            (
                o.split("=", 1)[1]
                for o in overrides
                if o.split("=", 1)[0].lstrip("+~") == found.group(1).lstrip("+~")
            ),
            None,
        )
        return f"did you mean {fixed}={value}?" if value is not None else f"did you mean {fixed}?"
    found = _NOT_A_LIST.search(message) or _SWEEP.search(message)
    if found and _is_list_field(found.group(1)):
        return f"give a list: {found.group(1)}=[{found.group(2)}]"
    found = _UNKNOWN_OPTION.search(message)
    if found and (CONF_DIR / found.group(1)).is_dir():
        group, option = found.groups()
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        match = difflib.get_close_matches(option, options, n=1, cutoff=0.5)
        listed = f"{group} is one of {', '.join(options)}"
        return f"did you mean {group}={match[0]}? ({listed})" if match else listed
    return None


def _check_override_syntax(arg: str, following: list[str]) -> None:
    """Refuse an argument that is no ``key=value`` override, with what the user likely meant: ``train``
    or ``--stage train`` / ``--stage=train`` for ``stage=train``, ``medusa2`` for ``training=medusa2``
    (Hydra said "Error parsing override 'train'" or "LexerNoViableAltException: --stage").
    ``following``: the next argument, the value of ``--key value``."""
    if arg.startswith("-"):
        key, eq, value = arg.lstrip("-").partition("=")
        if not eq and following and "=" not in following[0] and not following[0].startswith("-"):
            arg, value = f"{arg} {following[0]}", following[0]
        problem, meant = "arguments are key=value, without dashes", f"{key}={value or '<value>'}"
    elif "=" in arg or arg.startswith("~"):  # key=value, +key=value, ~key (deletes a key): Hydra's syntax
        return
    else:
        groups = sorted(d.name for d in CONF_DIR.iterdir() if d.is_dir() and (d / f"{arg}.yaml").is_file())
        problem = "not a key=value argument"
        meant = f"stage={arg}" if arg in STAGES else f"{groups[0]}={arg}" if groups else None
    hint = f": did you mean {meant}?" if meant else ""
    raise ConfigError(f"{arg!r}: {problem}{hint} — see `python -m medusa_train --help`")


_HOME_VALUE = re.compile(r"(^|[\[,]\s*)(~[^\s,\[\]'\"\\$]*)(?=\s*(?:$|[,\]]))")
"""An unquoted value, or list element, that starts with ``~`` (no quote, backslash or ``$`` in it)."""


def _quote_home(override: str) -> str:
    """``key=~/x`` as ``key='~/x'`` (and ``key=[~/a,b]`` as ``key=['~/a',b]``): Hydra's override grammar
    takes ``~`` only quoted, and a shell leaves it unexpanded after a dotted key (``eval.heads_dir=~/x``:
    no variable assignment), so the value reaches the config as written, to be expanded there. A
    ``~key`` (Hydra's deletion of a key) stays as it is."""
    key, eq, value = override.partition("=")
    if not eq or key.startswith("~"):
        return override
    return key + eq + _HOME_VALUE.sub(r"\1'\2'", value)


def _check_added_key(override: str, overrides: list[str]) -> None:
    """``+a.b=v`` / ``++a.b=v`` adds a key; the typed config has no room for one it does not define,
    and OmegaConf would drop it without a word: refuse it like a misspelt ``a.b=v``. So is ``+a=v``
    where ``a`` is neither a top-level key nor a config group (``+group=option`` adds a group)."""
    key = override.lstrip("+").split("=", 1)[0]
    parts = key.split(".")
    if not override.startswith("+"):
        return
    if len(parts) == 1:
        if key in _field_names([]) or (CONF_DIR / key).is_dir():
            return
        hint = _close_match(f"Could not override '{key}'. Key '{key}' not in", overrides)
        raise ConfigError(
            f"Key '{key}' is neither a config key nor a config group"
            + (f": {hint}" if hint else "")
            + " — see `python -m medusa_train --help`"
        )
    names = _field_names(parts[:-1])
    if names and parts[-1] not in names:
        hint = _close_match(f"Could not override '{key}'. Key '{parts[-1]}' not in", overrides)
        raise ConfigError(
            f"Key '{parts[-1]}' not in {'.'.join(parts[:-1])}"
            + (f": {hint}" if hint else "")
            + " — see `python -m medusa_train --help`"
        )


def _is_list_field(key: str) -> bool:
    """Whether the dotted ``key`` names a list field of :class:`Config`."""
    *path, name = key.split(".")
    cls: Any = Config
    for part in path:
        cls = typing.get_type_hints(cls).get(part)
        if not dataclasses.is_dataclass(cls):
            return False
    hint = typing.get_type_hints(cls).get(name)  # list[int], or list[...] | None
    return any(typing.get_origin(t) is list for t in (hint, *typing.get_args(hint)))


def _field_names(path: list[str]) -> list[str]:
    """The fields of the config dataclass at dotted ``path`` under :class:`Config` ([] if none is there)."""
    cls: Any = Config
    for part in path:
        hint = typing.get_type_hints(cls).get(part)
        if not dataclasses.is_dataclass(hint):
            return []
        cls = hint
    return [f.name for f in dataclasses.fields(cls)]


def _one_line(err: BaseException, hint: str | None = None) -> str:
    """Hydra and OmegaConf errors span several lines (and chain a cause); keep what names the key,
    then ``hint`` (a close match of a misspelt name)."""
    cause = err
    while cause.__cause__ is not None and not str(cause).strip():
        cause = cause.__cause__
    text = str(err).strip() or str(err.__cause__ or "").strip() or type(err).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0] if lines else type(err).__name__
    full_key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    inner = err.__cause__
    if inner is not None:
        inner_lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip()]
        if inner_lines and inner_lines[0] not in head:
            head = f"{head} {inner_lines[0]}"
        full_key = full_key or next(
            (ln.split(":", 1)[1].strip() for ln in inner_lines if ln.startswith("full_key:")), None
        )
    if full_key and full_key not in head:
        head = f"{head} (key: {full_key})"
    if hint:
        head = f"{head}: {hint}"
    return head + " — see `python -m medusa_train --help`"
