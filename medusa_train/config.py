"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore.

`conf/config.yaml` composes these with the groups in `conf/` (model, data, training, deepspeed,
tree, tracking). Every field is documented here, with units. Composition runs OmegaConf's type
checks (a misspelt key or a wrong type fails before any work, naming the key), then
``OmegaConf.to_object`` builds the dataclasses below, whose ``__post_init__`` checks the
combinations that types alone cannot express.

Only ``medusa_train/__main__.py`` and ``medusa_train/stages/`` read this config; reusable parts
(heads, decoding, losses, data readers) take plain arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from medusa_train.errors import ConfigError

STAGES = ("pretrain", "distill", "train", "export", "eval", "all")
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def _choice(key: str, value: Any, options: tuple) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, options))}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


@dataclass
class ModelConfig:
    """The backbone: any Hugging Face causal LM, or the embedded tiny one (`model=tiny`)."""

    name_or_path: str = MISSING
    """Hub id or local directory of the backbone. `model=tiny` points at `${workdir}/pretrain`,
    which `stage=pretrain` creates; everything downstream loads it like any other model. After
    `training=medusa2`, export and eval use the backbone trained with the heads (`heads/backbone`; a
    LoRA adapter is merged into this model) unless this names another checkpoint than the run's base."""
    embedded: bool = False
    """True only for `model=tiny`: `stage=pretrain` may (re)create the model at `name_or_path`."""
    dtype: str = "float32"
    """Weights dtype: float32 | bfloat16 | float16 | auto (the checkpoint's own)."""
    quantization: str = "none"
    """none | 8bit | 4bit (bitsandbytes; 4bit is nf4). Frozen backbone only, or QLoRA in medusa2."""
    trust_remote_code: bool = False
    """Passed to `from_pretrained`; leave False unless you trust the model repository."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when `name_or_path` is a hub id."""
    device: str = "auto"
    """auto (cuda if available, else cpu) | cpu | cuda | cuda:N. Distributed launches use the local rank."""

    def __post_init__(self) -> None:
        _choice("model.dtype", self.dtype, ("float32", "bfloat16", "float16", "auto"))
        _choice("model.quantization", self.quantization, ("none", "8bit", "4bit"))


@dataclass
class PretrainConfig:
    """`stage=pretrain`: train the embedded tiny Llama (model=tiny only), the backbone of the demo."""

    vocab_size: int = 2048
    """BPE vocabulary size of the embedded tokenizer."""
    hidden_size: int = 192
    """Width of the tiny Llama (3.05M parameters at the defaults). Chosen for the Medusa demo, not only
    for perplexity: a 128-wide 4-layer model (1.05M) learns the corpus faster per second, but its
    forward is so cheap (~1.4 ms on 2 cores) that the decoder's fixed per-step cost eats the gain
    (measured tau 2.45, speed-up 1.38x); at 192 x 6 layers the same pipeline measured tau 4.0 and
    2.4x (docs/benchmarks.md). A model the size of a real LLM is forward-bound anyway."""
    num_layers: int = 6
    """Decoder layers."""
    num_attention_heads: int = 6
    """Attention heads (head dim = hidden_size / num_attention_heads)."""
    intermediate_size: int = 512
    """MLP width."""
    max_position_embeddings: int = 1024
    """Context limit the tiny model declares, tokens. It only trains on `seq_len`-token windows, and
    past them its quality drops (held-out perplexity of the demo's model, measured 2026-11-22: 3.8 at
    positions 128-255, 5.2 at 256-383, 8.1 at 384-511, 13.9 at 512-767). 18 of the demo's 600
    distilled records run past 256 tokens (the longest: 309). The limit stays at 1024 so that
    `distill.max_new_tokens=256` still leaves room for prompts (distill caps prompts at this minus
    max_new_tokens)."""
    seq_len: int = 256
    """Training sequence length, tokens (documents are packed)."""
    batch_size: int = 8
    """Sequences per optimizer step; small batches give more steps in the short CPU budget."""
    lr: float = 4e-3
    """Peak AdamW learning rate; cosine decay to 10% of it over the step cap or the time budget."""
    warmup_steps: int = 30
    """Linear learning-rate warm-up, optimizer steps."""
    max_steps: int = 100000
    """Step cap; the wall-clock budget `max_minutes` usually ends training first."""
    max_minutes: float = 3.5
    """Wall-clock budget for the optimisation loop, minutes (tokenizer + eval come on top)."""
    num_conversations: int = 30000
    """Embedded corpus size (conversations) used to train tokenizer and model."""
    heldout_fraction: float = 0.05
    """Fraction of documents held out to measure perplexity."""
    overwrite: bool = False
    """Retrain even if `workdir/pretrain` is complete."""

    def __post_init__(self) -> None:
        for key in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "seq_len",
            "batch_size",
            "max_steps",
        ):
            _positive(f"pretrain.{key}", getattr(self, key))
        _positive("pretrain.max_minutes", self.max_minutes)
        if not 0 < self.heldout_fraction < 1:
            raise ConfigError(f"pretrain.heldout_fraction={self.heldout_fraction} must be in (0, 1)")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("pretrain.hidden_size must be divisible by pretrain.num_attention_heads")


@dataclass
class DataConfig:
    """Where prompts/conversations come from (`data=` group)."""

    RUN_ONLY: ClassVar[tuple[str, ...]] = ("strict",)
    """Not part of a stage's skip/resume key: `strict` only decides whether a bad record fails the run
    or is skipped; a run that completes distills the same records either way."""

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
    """Use at most this many records (after skipping bad ones); null = all."""
    num_prompts: int = 600
    """format=embedded: how many prompts of the embedded train split to distill."""
    text_prompt_chars: int = 400
    """format=text: prompts are consecutive chunks of about this many characters."""
    max_prompt_tokens: int = 512
    """Token limit of a distillation context (capped at the model's max_position_embeddings minus
    distill.max_new_tokens): longer first prompts are handled by `long_prompts`; a later turn whose
    context would be longer is not answered (the conversation ends with the previous reply)."""
    long_prompts: str = "skip"
    """skip (count + warn) | truncate (keep the last max_prompt_tokens tokens of the first prompt)."""
    strict: bool = False
    """Fail on the first bad record (malformed JSON, empty conversation, leading assistant turn, prompt
    too long) naming its line, instead of skipping it with one summary warning."""
    eval_fraction: float = 0.05
    """Fraction of distilled records held out for head accuracy / tree calibration."""

    def __post_init__(self) -> None:
        _choice(
            "data.format", self.format, ("embedded", "sharegpt", "alpaca", "mtbench", "jsonl", "text", "hub")
        )
        _choice("data.hub_format", self.hub_format, ("sharegpt", "alpaca", "mtbench", "jsonl"))
        _choice("data.long_prompts", self.long_prompts, ("skip", "truncate"))
        if self.format in ("sharegpt", "alpaca", "mtbench", "jsonl", "text") and not self.path:
            raise ConfigError(f"data.format={self.format} needs data.path=<file>")
        if self.format == "hub" and not self.name:
            raise ConfigError("data.format=hub needs data.name=<dataset id>")
        _positive("data.max_prompt_tokens", self.max_prompt_tokens)
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1)")


@dataclass
class DistillConfig:
    """`stage=distill`: regenerate every assistant turn with the frozen backbone."""

    RUN_ONLY: ClassVar[tuple[str, ...]] = ("overwrite", "batch_size")
    """Not part of the skip/resume key: `overwrite` steers the run; `batch_size` changes no record
    (greedy replies equal unbatched `generate`, and each record samples with its own seeded generator,
    both tested), so a run may resume with another batch size."""

    max_new_tokens: int = 256
    """Per assistant turn, tokens."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples (with top_p)."""
    top_p: float = 1.0
    """Nucleus sampling mass when temperature > 0 (1.0 = off)."""
    batch_size: int = 16
    """Rows generated together (continuous batching: a finished row frees its slot for the next prompt)."""
    shard_size: int = 256
    """Records per Arrow shard; a killed run loses at most the shard in progress."""
    seed: int = 0
    """Sampling seed (per record and turn, so results do not depend on batching or rank)."""
    overwrite: bool = False
    """Discard an existing distill folder made with other settings (backbone fingerprint, dtype,
    tokenizer, every distill.* and data.* field but batch_size, strict and eval_fraction; top_p and seed
    only when sampling) instead of refusing; a folder with the same settings is always resumed or,
    when complete, reused as is."""

    def __post_init__(self) -> None:
        _positive("distill.max_new_tokens", self.max_new_tokens)
        _positive("distill.temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"distill.top_p={self.top_p} must be in (0, 1]")
        _positive("distill.batch_size", self.batch_size)
        _positive("distill.shard_size", self.shard_size)


@dataclass
class TrainingConfig:
    """`stage=train` (`training=medusa1|medusa2`)."""

    RUN_ONLY: ClassVar[tuple[str, ...]] = (
        "per_device_batch_size",
        "gradient_accumulation_steps",
        "max_minutes",
        "loss_chunk_size",
        "logging_steps",
        "save_steps",
        "save_total_limit",
        "cache_hidden_states",
        "overwrite",
        "calibration_max_records",
    )
    """Fields left out of the trained heads' skip/resume key (``workdir.settings_key``): how a run goes,
    not what it trains. The batch split (the key holds the global batch size instead), the time
    budget (a stopped run resumes under any budget), loss chunking and the hidden-state cache
    (same heads up to rounding), logging and checkpointing, ``overwrite``; and
    ``calibration_max_records``, which is part of the calibration's key (a change re-runs only the
    calibration). Every other field, new ones included, is compared."""

    mode: str = "medusa1"
    """medusa1 (frozen backbone, heads only) | medusa2 (joint training)."""
    num_heads: int = 4
    """K: head k predicts token t+k+1."""
    num_layers: int = 1
    """Residual blocks per head."""
    init_from_lm_head: bool = True
    """Initialise every head's vocab projection from the backbone's lm_head."""
    decay: float = 0.8
    """Head-loss weights lambda_k = decay^(k-1)."""
    lr: float = 1e-3
    """Learning rate of the heads (medusa1) / of the backbone (medusa2)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_ratio: float = 0.05
    """Fraction of the total optimizer steps spent in linear warm-up."""
    lr_scheduler: str = "cosine"
    """Any transformers scheduler name: cosine | linear | constant | constant_with_warmup ..."""
    per_device_batch_size: int = 8
    """Sequences per process per micro-batch (global batch = this x processes x accumulation)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    num_epochs: float = 1.0
    """Passes over the training split (fractions allowed)."""
    max_steps: int = -1
    """Overrides num_epochs when > 0."""
    max_minutes: float | None = None
    """Optional wall-clock budget, minutes: training stops cleanly (and saves) when reached."""
    max_seq_len: int = 512
    """Longer distilled records are truncated to this many tokens."""
    loss_chunk_size: int = 512
    """Tokens per chunk in the chunked head cross-entropy (memory vs speed)."""
    logging_steps: int = 10
    """Log loss and per-head top-1/top-5 every N optimizer steps."""
    save_steps: int = 200
    """Checkpoint every N optimizer steps (resumable)."""
    save_total_limit: int = 2
    """Checkpoints kept in workdir/train (older ones are deleted)."""
    cache_hidden_states: bool = False
    """Medusa-1: compute the backbone's last hidden states once into a memory-mapped store and
    train the heads from it (no backbone forward per epoch)."""
    seed: int = 0
    """Seed of head init, data order and dropout."""
    overwrite: bool = False
    """Retrain even if `workdir/heads` is complete for the same settings (also discards `workdir/train`)."""
    init_heads: str | None = None
    """Start from these heads (a heads directory, e.g. Medusa-1 heads before Medusa-2); null = fresh heads."""
    calibration_max_records: int = 200
    """Held-out records used for the top-k accuracy table and tree calibration after training. A change
    (like one of `tree.max_nodes|topk|latency_context`) re-runs only the calibration of finished heads."""
    # -- medusa2 -------------------------------------------------------------------------------
    head_lr_multiplier: float = 4.0
    """medusa2: heads lr = lr * head_lr_multiplier."""
    lambda0: float = 0.2
    """medusa2: final weight of the heads' loss next to the LM loss."""
    lambda_warmup: str = "sine"
    """medusa2: constant | linear | sine | sine_r schedule of lambda0 over lambda_warmup_steps."""
    lambda_warmup_steps: int = 100
    """medusa2: optimizer steps over which lambda0 rises to its final value, counted from the end of
    heads_only_steps."""
    lm_loss: str = "kl"
    """medusa2: kl (to the frozen original, for self-distilled data) | ce (on the data)."""
    heads_only_steps: int = 0
    """medusa2 two-stage: train heads only for N steps, then jointly (the lambda0 warm-up starts then)."""
    backbone_tuning: str = "full"
    """medusa2: full | lora | qlora."""
    lora_r: int = 16
    """medusa2 lora/qlora: adapter rank."""
    lora_alpha: int = 32
    """medusa2 lora/qlora: adapter scaling numerator (scale = alpha / r)."""
    lora_dropout: float = 0.05
    """medusa2 lora/qlora: dropout on the adapter input."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """medusa2 lora/qlora: module names that get adapters."""

    def __post_init__(self) -> None:
        _choice("training.mode", self.mode, ("medusa1", "medusa2"))
        _choice("training.lambda_warmup", self.lambda_warmup, ("constant", "linear", "sine", "sine_r"))
        _choice("training.lm_loss", self.lm_loss, ("kl", "ce"))
        _choice("training.backbone_tuning", self.backbone_tuning, ("full", "lora", "qlora"))
        _positive("training.num_heads", self.num_heads)
        _positive("training.num_layers", self.num_layers, allow_zero=True)
        _positive("training.lr", self.lr)
        _positive("training.per_device_batch_size", self.per_device_batch_size)
        _positive("training.gradient_accumulation_steps", self.gradient_accumulation_steps)
        _positive("training.loss_chunk_size", self.loss_chunk_size)
        _positive("training.save_steps", self.save_steps)
        _positive("training.logging_steps", self.logging_steps)
        if not 0 < self.decay <= 1:
            raise ConfigError(f"training.decay={self.decay} must be in (0, 1]")
        if self.max_steps <= 0 and self.num_epochs <= 0:
            raise ConfigError("set training.num_epochs > 0 or training.max_steps > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"training.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if self.cache_hidden_states and self.mode != "medusa1":
            raise ConfigError("training.cache_hidden_states=true needs a frozen backbone (training=medusa1)")


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
    """`tree=calibrated|medusa63|chain|custom`: the candidate tree verified per step."""

    RUN_ONLY: ClassVar[tuple[str, ...]] = ("name", "choices", "chain_depth")
    """Fields left out of the tree calibration's key (stage=train): they pick the tree at decode time,
    the calibration does not read them. Every other field, new ones included, is compared."""

    name: str = "calibrated"
    """calibrated (chosen after training, saved in workdir/heads) | medusa63 | chain | custom."""
    choices: list[Any] | None = None
    """tree=custom: list of index paths, e.g. [[0], [0, 0], [1]]."""
    chain_depth: int = 4
    """tree=chain: number of nodes (at most the number of heads)."""
    max_nodes: int = 64
    """Calibration: largest tree considered."""
    topk: int = 10
    """Calibration: candidates per head considered."""
    latency_context: int = 256
    """Calibration: KV-cache length at which tree forwards are timed, tokens."""

    def __post_init__(self) -> None:
        _choice("tree.name", self.name, ("calibrated", "medusa63", "chain", "custom"))
        if self.name == "custom" and not self.choices:
            raise ConfigError("tree=custom needs tree.choices=[[0],[0,0],...]")
        _positive("tree.chain_depth", self.chain_depth)
        _positive("tree.max_nodes", self.max_nodes)
        if not 1 <= self.topk <= 10:
            raise ConfigError(f"tree.topk={self.topk} must be in 1..10")


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

    def __post_init__(self) -> None:
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
    """Prompts evaluated (the first N of the source)."""
    max_new_tokens: int = 128
    """New tokens per prompt turn, for both decoders."""
    acceptance_extra: bool = True
    """Also measure tau of typical acceptance and exact sampling."""
    temperature: float = 0.7
    """Temperature for the typical / sample tau measurement."""
    posterior_threshold: float = 0.09
    """Typical acceptance: the hard probability threshold epsilon (Medusa's default 0.09)."""
    posterior_alpha: float = 0.3
    """Typical acceptance: the entropy-scaled threshold factor (Medusa's default 0.3, i.e. sqrt(epsilon))."""
    sweep_tree_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """Tree sizes for the tau / speed-up vs tree size plot (calibrated trees); [] to skip."""
    sweep_prompts: int = 6
    """Prompts used per point of the tree-size sweep."""
    compare: list[str] = field(default_factory=lambda: [])
    """More heads to decode the same prompts with the same tree (with `tree=calibrated`, the evaluated
    heads' tree), each with its own backbone as `eval.heads_dir` would load it: heads folders or
    workdirs holding `heads/`, e.g. `['runs/m1','runs/m2']`. report.md gets a table of every set:
    tau, speed-up, identical outputs, held-out head top-1, and for a trained (Medusa-2) backbone its
    drift from `model.name_or_path` on held-out distilled positions: argmax agreement and mean KL."""
    seed: int = 0
    """Seed of the sampling runs."""

    def __post_init__(self) -> None:
        _choice("eval.prompts", self.prompts, ("embedded", "mtbench", "jsonl"))
        if self.prompts in ("mtbench", "jsonl") and not self.path:
            raise ConfigError(f"eval.prompts={self.prompts} needs eval.path=<file>")
        _positive("eval.num_prompts", self.num_prompts)
        _positive("eval.max_new_tokens", self.max_new_tokens)
        _positive("eval.temperature", self.temperature)


@dataclass
class Config:
    """The whole run. `python -m medusa_train stage=<stage> [group=option ...] [key=value ...]`."""

    stage: str = "all"
    """pretrain | distill | train | export | eval | all."""
    workdir: str = "runs/default"
    """Run directory; every stage writes a fixed subfolder and reads its inputs from here."""
    seed: int = 0
    """Global seed (stages derive their own seeds from their sections)."""
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
        if self.stage == "backbone":
            raise ConfigError("stage=backbone is now called stage=pretrain (its settings: pretrain.*)")
        _choice("stage", self.stage, STAGES)
        if self.stage == "pretrain" and not self.model.embedded:
            raise ConfigError(
                "stage=pretrain trains the embedded tiny model only: use model=tiny (a real model needs no pretraining)"
            )
        if self.training.num_heads < self.tree.chain_depth and self.tree.name == "chain":
            raise ConfigError(
                f"tree.chain_depth={self.tree.chain_depth} exceeds training.num_heads={self.training.num_heads}"
            )
        if (
            self.model.quantization != "none"
            and self.training.mode == "medusa2"
            and self.training.backbone_tuning != "qlora"
        ):
            raise ConfigError("a quantized backbone can only be trained with training.backbone_tuning=qlora")


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
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            dict_cfg = compose(config_name="config", overrides=list(overrides or []))
        missing = sorted(OmegaConf.missing_keys(dict_cfg))
        if missing:
            raise ConfigError(f"{missing[0]} is required: pass {missing[0]}=<value>")
        obj = OmegaConf.to_object(dict_cfg)
    except ConfigError:
        raise
    except Exception as err:  # Hydra / OmegaConf errors: make them one actionable line
        raise ConfigError(_one_line(err)) from None
    finally:
        GlobalHydra.instance().clear()
    assert isinstance(obj, Config)
    return obj


def _one_line(err: BaseException) -> str:
    """Hydra and OmegaConf errors span several lines (and chain a cause); keep what names the key."""
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
    return head + " — see `python -m medusa_train --help`"
