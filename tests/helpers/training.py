"""The tiny backbone, padded batch and hand-built Trainer checkpoint the training tests share."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from medusa_train.training.trainer import PadCollator
from tests.helpers.models import tiny_model

VOCAB = 64


def cpu_training_args(output_dir: Path, **settings) -> transformers.TrainingArguments:
    """``TrainingArguments`` for a quiet in-process run on the CPU (no reporting, no progress bar, no
    data-loader workers, the records' extra columns kept), with ``settings`` on top."""
    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        report_to="none",
        use_cpu=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **settings,
    )


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A random 2-layer, 32-wide Llama over 64 tokens (pad 0, EOS 1, no BOS), in eval mode."""
    return tiny_model("llama", seed, vocab=VOCAB, max_pos=128, eos_token_id=1, bos_token_id=None)


def batch(seed: int = 0, b: int = 3, t: int = 14) -> dict[str, torch.Tensor]:
    """``b`` random records of lengths ``t, t-3, ...`` (3 prompt tokens with loss_mask 0), padded."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(b):
        n = t - 3 * i
        ids = torch.randint(2, VOCAB, (n,), generator=g).tolist()
        records.append({"input_ids": ids, "loss_mask": [0] * 3 + [1] * (n - 3)})
    return PadCollator(0)(records)


LOGIT_STEP_ARCHS = ("gemma2", "gemma3n", "cohere", "granite")
"""Architectures whose forward changes ``lm_head(h)`` before its logits (``tiny_logit_step_model``)."""


def tiny_logit_step_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer, 32-wide model over 64 tokens (pad 0, EOS 1) of ``arch``, whose forward changes
    ``lm_head(h)``: Gemma-2 and Gemma 3n cap the logits, Cohere multiplies them, Granite divides them.
    The constants are sized to this model's logits (~0.3), so the step changes its distribution (real
    models' constants, a cap of 30 or a factor of 1/16, act on logits of tens); in eval mode. Gemma 3n's
    ``h`` is not its ``hidden_states[-1]`` (its AltUp streams stacked) but its ``last_hidden_state``."""
    shape = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=1,
    )
    if arch == "gemma2":
        config = transformers.Gemma2Config(**shape, head_dim=8, final_logit_softcapping=0.2)
    elif arch == "gemma3n":
        config = transformers.Gemma3nTextConfig(
            **shape, head_dim=8, final_logit_softcapping=0.2, sliding_window=6, num_kv_shared_layers=0,
            layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.95, 0.0],
            altup_num_inputs=2, laurel_rank=4, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
        )  # fmt: skip
    elif arch == "cohere":
        config = transformers.CohereConfig(**shape, logit_scale=4.0)
    elif arch == "granite":
        config = transformers.GraniteConfig(**shape, logits_scaling=0.25)
    else:
        raise ValueError(f"unknown arch {arch!r}: one of {', '.join(LOGIT_STEP_ARCHS)}")
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def trainer_checkpoint(train: Path, step: int, deepspeed: bool = False, ranks: int = 1) -> Path:
    """A checkpoint of the Trainer's files (DeepSpeed's ``global_stepN/`` and ``latest`` instead of
    optimizer.pt when ``deepspeed``), each a real file of its format, as ``ranks`` processes write it
    (several: one RNG state and one ZeRO optimizer shard per rank)."""
    path = train / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    save_file({"heads.0.weight": torch.zeros(4, 4)}, str(path / "model.safetensors"))
    torch.save({"last_epoch": step}, path / "scheduler.pt")
    for rank in range(ranks):
        name = "rng_state.pth" if ranks == 1 else f"rng_state_{rank}.pth"
        torch.save({"cpu": torch.zeros(8, dtype=torch.uint8)}, path / name)
    torch.save({"lr": 1e-3}, path / "training_args.bin")
    if deepspeed:
        tag = path / f"global_step{step}"
        tag.mkdir()
        torch.save({"module": {"w": torch.zeros(64)}}, tag / "mp_rank_00_model_states.pt")
        for rank in range(ranks):
            shard = tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            torch.save({"state": {"w": torch.zeros(256)}}, shard)
        (path / "latest").write_text(tag.name)
        (path / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script\n")
    else:
        torch.save({"state": {0: {"exp_avg": torch.zeros(256)}}}, path / "optimizer.pt")
    return path
