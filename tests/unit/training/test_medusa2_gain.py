"""The Medusa-2 mechanism on a tiny fixed-seed setup: training the backbone with the heads lowers the
held-out heads loss more than the same Medusa-1 steps from the same start, while the KL term keeps
the backbone's next-token distribution close to the original's.

The data needs what a frozen random backbone does not give the heads: every sequence repeats a
random 5-token pattern, so token ``t+k+1`` is a copy of an earlier token, which a head reading the
random backbone's last hidden state can hardly recover, and which attention trained by Medusa-2 can
fetch. Both runs: same backbone and heads at step 0, same batches, same heads learning rate.
"""

from __future__ import annotations

import copy
import functools

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_train.heads import MedusaHeads
from medusa_train.training.model import KLToOriginal, MedusaTrainingModel, lm_cross_entropy
from medusa_train.training.optim import FreezableAdamW, param_groups
from medusa_train.training.trainer import PadCollator

VOCAB, PERIOD, LENGTH, STEPS, LR, LAMBDA0 = 32, 5, 24, 30, 3e-3, 1.0
KL_BOUND = 0.02
"""Nats: mean KL(original || trained) of the next-token distribution on held-out positions after the
Medusa-2 steps (measured 0.0046-0.0056 over backbone seeds 0-3)."""


def _repeats(seed: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(n):
        pattern = torch.randint(2, VOCAB, (PERIOD,), generator=g)  # (PERIOD,)
        ids = pattern.repeat(LENGTH // PERIOD + 1)[:LENGTH].tolist()
        records.append({"input_ids": ids, "loss_mask": [0] * PERIOD + [1] * (LENGTH - PERIOD)})
    return PadCollator(0)(records)


def _backbone() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


@functools.cache
def _train(mode: str, lm_loss: str = "kl", lambda0: float = LAMBDA0) -> tuple[float, float]:
    """``(held-out heads loss sum_k decay^(k-1) CE_k, held-out KL to the original)`` after STEPS steps."""
    backbone = _backbone()
    original = copy.deepcopy(backbone)  # KLToOriginal freezes it
    torch.manual_seed(1)
    heads = MedusaHeads(32, VOCAB, 3, 1)
    heads.init_from_lm_head(backbone.get_output_embeddings().weight.detach())
    if mode == "medusa2":
        backbone.requires_grad_(True).train()
        model = MedusaTrainingModel(
            heads,
            backbone,
            backbone_trainable=True,
            lm_loss=KLToOriginal(original) if lm_loss == "kl" else lm_cross_entropy,
            lambda0=lambda0,
            chunk_size=64,
        )
    else:
        model = MedusaTrainingModel(heads, backbone, chunk_size=64)
    optimizer = FreezableAdamW(param_groups(model, LR), lr=LR)  # heads and backbone at LR
    for step in range(STEPS):
        out = model(**_repeats(100 + step, 8))
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        held = _repeats(999, 32)
        out = model(**held)
        weights = torch.tensor([0.8**k for k in range(3)])
        heads_loss = float((out["head_ce"] * weights).sum())
        probe = MedusaTrainingModel(
            heads, backbone, backbone_trainable=True, lm_loss=KLToOriginal(original), chunk_size=64
        )  # the KL of whatever backbone this run ended with (Medusa-1: the original itself, 0)
        kl = float(probe(**held)["lm_loss"])
    return heads_loss, kl


def test_medusa2_lowers_the_heldout_heads_loss_more_than_medusa1_and_stays_near_the_original():
    m1_loss, m1_kl = _train("medusa1")
    m2_loss, m2_kl = _train("medusa2")
    assert m1_kl < 1e-6  # Medusa-1 left the backbone as it was
    # Measured: 8.17 -> 7.60 (seed 0; 0.6-0.8 lower over backbone seeds 0-3).
    assert m2_loss < m1_loss - 0.3, (m1_loss, m2_loss)
    assert 0 < m2_kl < KL_BOUND, m2_kl


def test_lambda0_weighs_the_heads_against_the_kl():
    """The KL term is what holds the backbone: with the heads' weight lambda0 at 1/1000 of the above,
    the KL to the original stays several times smaller (measured 0.00035 vs 0.0046), and so does the
    gain over Medusa-1 (heads loss 8.15 vs Medusa-1's 8.17)."""
    loss, kl = _train("medusa2")
    held_loss, held_kl = _train("medusa2", lambda0=LAMBDA0 / 1000)
    assert held_kl < kl / 4, (kl, held_kl)
    assert held_loss > loss + 0.3, (loss, held_loss)
