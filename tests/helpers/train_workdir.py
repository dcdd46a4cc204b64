"""A tiny workdir for the train-stage tests: random Llama backbone + synthetic distilled data.

``make_train_workdir`` writes a backbone to base_model/ (with a tokenizer; ``model=hf`` points there) and
what stage=distill leaves behind (distill/ with one Arrow shard and a manifest carrying the backbone
identity) in about a second. The records follow a pattern a head can learn from the current token alone
(``x_{t+1} = x_t + 1`` over a window of the vocabulary), after a 4-token "prompt" with loss_mask 0.
Also the DeepSpeed test helpers: ``launch`` (torchrun / deepspeed subprocess) and
``zero3_partitioning_everything`` (ZeRO-3 in this process with every parameter sharded), and
``run_killed_at_step`` (a training run interrupted mid-way, for the resume tests).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from medusa_train.backbone import backbone_identity, load_backbone
from medusa_train.config import Config, compose_config
from medusa_train.workdir import file_sha256
from tests.helpers.models import tiny_config
from tests.helpers.tiny_workdir import tiny_overrides

VOCAB = 64
HIDDEN = 32
REPO = Path(__file__).resolve().parents[2]


def make_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def make_backbone(
    directory: Path,
    seed: int = 0,
    hidden: int = HIDDEN,
    kv_heads: int = 2,
    tie: bool = False,
    arch: str = "llama",
) -> None:
    """``tie``: lm_head shares the input embedding (as the embedded tiny backbone and many small models);
    ``arch``: one of :func:`tests.helpers.models.tiny_config`'s."""
    torch.manual_seed(seed)
    config = tiny_config(
        arch,
        vocab=VOCAB,
        hidden=hidden,
        kv_heads=kv_heads,
        max_pos=256,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=tie,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)


def make_records(n: int, seed: int = 0, min_len: int = 12, max_len: int = 40) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        start = rng.randint(2, VOCAB - 1)
        ids = [2 + (start - 2 + j) % (VOCAB - 2) for j in range(length)]
        mask = [0] * 4 + [1] * (length - 4)
        out.append({"input_ids": ids, "loss_mask": mask, "source_id": f"synthetic:{i}"})
    return out


def write_distill(workdir: Path, records: list[dict], backbone_dir: Path) -> None:
    from datasets import Dataset

    distill = workdir / "distill"
    (distill / "shards").mkdir(parents=True, exist_ok=True)
    ds = Dataset.from_list(records)
    table = ds.with_format("arrow")[:]
    import pyarrow as pa

    with (
        pa.OSFile(str(distill / "shards" / "00000.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)
    model, _ = load_backbone(str(backbone_dir))
    shard = distill / "shards" / "00000.arrow"
    manifest = {
        "backbone": backbone_identity(model, str(backbone_dir)),
        "records": len(records),
        "shards": [  # what readers check the shards against (stage=distill writes the same)
            {
                "file": shard.name,
                "records": len(records),
                "bytes": shard.stat().st_size,
                "sha256": file_sha256(shard),
            }
        ],
    }
    (distill / "manifest.json").write_text(json.dumps(manifest, indent=2))


def make_train_workdir(root: Path, n_records: int = 48, **backbone: int | bool | str) -> Path:
    """Create ``root`` with base_model/ and distill/ (``backbone``: make_backbone options); returns ``root``."""
    make_backbone(root / "base_model", **backbone)
    write_distill(root, make_records(n_records), root / "base_model")
    return root


def train_overrides(workdir: Path, *overrides: str) -> list[str]:
    """Fast settings on ``workdir``: 3 heads, 6 steps of 4 records, checkpoints every 3 steps."""
    return tiny_overrides(
        workdir,
        "model.device=cpu",
        "data.eval_fraction=0.2",
        "training.num_heads=3",
        "training.lr=1e-2",
        "training.warmup_ratio=0.0",
        "training.max_steps=6",
        "training.save_steps=3",
        "training.logging_steps=2",
        "training.per_device_batch_size=4",
        "training.loss_chunk_size=16",
        "training.cache_hidden_states=false",  # online by default here; the cache is tested against it
        "tree.max_nodes=6",
        "tree.latency_context=16",
        *overrides,
    )


def train_cfg(workdir: Path, *overrides: str) -> Config:
    """:func:`train_overrides` composed into the typed config."""
    return compose_config(train_overrides(workdir, *overrides))


def run_killed_at_step(cfg: Config, monkeypatch, step: int = 4) -> None:
    """Run stage=train on ``cfg`` and interrupt it (``KeyboardInterrupt``) at optimizer step ``step``,
    after the checkpoints before it were written; the Trainer is restored afterwards."""
    import pytest

    from medusa_train.stages import train
    from medusa_train.training.trainer import MedusaTrainer

    original = MedusaTrainer.training_step

    def dies(self, *args, **kwargs):
        if self.state.global_step >= step:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MedusaTrainer, "training_step", dies)
    try:
        with pytest.raises(KeyboardInterrupt):
            train.run(cfg)
    finally:
        monkeypatch.setattr(MedusaTrainer, "training_step", original)


def launch(cmd: list[str], cwd: Path = REPO, timeout: float = 300) -> None:
    """Run a multi-process launcher command (torchrun, deepspeed), one thread per process.

    On timeout the launcher gets SIGTERM, so that it stops its ranks, then SIGKILL with its process
    group: a SIGKILLed launcher leaves its ranks behind, holding the rendezvous port, and every later
    run on that port hangs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(f"{cmd[0]} ran past {timeout:.0f} s: " + out[-3000:] + err[-3000:]) from None
    assert proc.returncode == 0, out[-3000:] + err[-3000:]


@contextlib.contextmanager
def zero3_partitioning_everything(monkeypatch) -> Iterator[None]:
    """``deepspeed=zero3`` in this process with every parameter really partitioned (persistence
    threshold 0: by default ZeRO-3 keeps small tensors, i.e. all of a tiny model, whole), and the
    process-wide state a 1-process DeepSpeed run leaves behind removed afterwards."""
    import torch

    import medusa_train.stages.train as train_stage

    original = train_stage.deepspeed_config

    def partition_everything(*args, **kwargs):
        config = original(*args, **kwargs)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return config

    monkeypatch.setattr(train_stage, "deepspeed_config", partition_everything)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # so that teardown removes what the stage sets
        monkeypatch.delenv(key)
    try:
        yield
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
