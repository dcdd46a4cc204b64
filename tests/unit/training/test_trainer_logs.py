"""MedusaTrainer's logs: what each logged figure covers, checked against values computed by hand."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import TrainingArguments

from medusa_train.head_targets import IGNORE_INDEX, medusa_targets
from medusa_train.heads import MedusaHeads
from medusa_train.training.losses import HeadLoss, lm_targets
from medusa_train.training.model import KLToOriginal, MedusaTrainingModel, lm_cross_entropy
from medusa_train.training.trainer import MedusaTrainer, MetricsScheduleCallback, PadCollator
from tests.helpers.training import VOCAB, cpu_training_args, tiny_llama

LENGTHS = [14, 5, 11, 7, 13, 6, 9, 12]
"""One record per micro-batch: their numbers of targets differ, so a mean of micro-batch means would
weigh their tokens unequally."""


def _records() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [
        {
            "input_ids": torch.randint(2, VOCAB, (n,), generator=g).tolist(),
            "loss_mask": [0] * 3 + [1] * (n - 3),
        }
        for n in LENGTHS
    ]


def _module(variant: str) -> MedusaTrainingModel:
    """Medusa-1 truncated heads trained on KL + 0.5 CE (per head two denominators: the CE counts only
    targets in the draft vocabulary), or Medusa-2 with an LM loss (a third)."""
    backbone = tiny_llama()
    torch.manual_seed(0)
    if variant == "medusa1":
        token_map = torch.arange(2, VOCAB, 2)  # half the vocabulary: the CE counts fewer targets
        heads = MedusaHeads(32, VOCAB, 3, 1, head_projection="truncated", token_map=token_map)
        heads.init_from_lm_head(backbone.get_output_embeddings().weight)
        return MedusaTrainingModel(heads, backbone, chunk_size=4, head_loss=HeadLoss.from_spec("kl+0.5ce"))
    heads = MedusaHeads(32, VOCAB, 3, 1)
    heads.init_from_lm_head(backbone.get_output_embeddings().weight)
    lm_loss = lm_cross_entropy
    if variant == "medusa2_kl":
        lm_loss = KLToOriginal(copy.deepcopy(backbone))
        with torch.no_grad():  # a student that already moved away from the original: the KL is not 0
            for p in backbone.parameters():
                p.add_(0.05 * torch.randn_like(p))
    backbone.requires_grad_(True)
    return MedusaTrainingModel(
        heads, backbone, backbone_trainable=True, lm_loss=lm_loss, lambda0=0.5, chunk_size=4
    )


def _by_hand(module: MedusaTrainingModel, batch: dict) -> dict[str, torch.Tensor]:
    """Summed per-row losses and their rows, per head and term, from whole logits (no chunking)."""
    ids, mask, attn = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    heads = module.heads
    backbone = module._backbone()
    k_heads = heads.num_heads
    with torch.no_grad():
        out = backbone(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        h = out.hidden_states[-1].reshape(-1, 32)  # (B*T, d)
        targets = medusa_targets(ids, mask, attn, k_heads).reshape(-1, k_heads)  # (B*T, K)
        logits = heads(h).float()  # (K, B*T, V')
        lm_head = backbone.get_output_embeddings().weight
        if heads.token_map is not None:
            lm_head = lm_head[heads.token_map]  # (V', d): the target renormalised on the draft vocabulary
        rows = torch.arange(h.shape[0])
        res = {key: torch.zeros(k_heads) for key in ("ce", "ce_rows", "kl", "kl_rows", "top1", "top5", "n")}
        for k in range(k_heads):
            y = targets[:, k]
            y_draft = heads.draft_targets(y)
            on = y_draft != IGNORE_INDEX
            res["ce"][k] = F.cross_entropy(logits[k][on], y_draft[on], reduction="sum")
            res["ce_rows"][k] = on.sum()
            counted = y != IGNORE_INDEX
            p = F.log_softmax((h[rows[counted] + k + 1] @ lm_head.t()).float(), dim=-1)  # backbone at t+k+1
            q = F.log_softmax(logits[k][counted], dim=-1)
            res["kl"][k] = (p.exp() * (p - q)).sum()
            res["kl_rows"][k] = counted.sum()
            top = logits[k][on].topk(5, dim=-1).indices
            res["top1"][k] = (top[:, 0] == y_draft[on]).sum()
            res["top5"][k] = (top == y_draft[on][:, None]).any(-1).sum()
            res["n"][k] = (
                counted.sum()
            )  # top-k: every full-vocabulary target counts (outside the draft: a miss)
        if module.lm_loss is not None:
            y_lm = lm_targets(ids, mask, attn).reshape(-1)  # (B*T,)
            on = y_lm != IGNORE_INDEX
            student = out.logits.reshape(-1, VOCAB)[on].float()
            if isinstance(module.lm_loss, KLToOriginal):
                t = F.log_softmax(module.lm_loss.teacher(input_ids=ids, attention_mask=attn).logits, -1)
                t = t.reshape(-1, VOCAB)[on]
                res["lm"] = (t.exp() * (t - F.log_softmax(student, -1))).sum()
            else:
                res["lm"] = F.cross_entropy(student, y_lm[on], reduction="sum")
            res["lm_rows"] = on.sum().float()
    return res


@pytest.mark.parametrize("variant", ["medusa1", "medusa2_ce", "medusa2_kl"])
def test_logged_figures_cover_the_steps_since_the_previous_log(tmp_path, variant):
    """2 records per optimizer step (one per micro-batch, of unequal target counts), a log every 2 steps:
    each log's per-head loss (and Medusa-2's lm_loss) is the per-token mean of every micro-batch since
    the previous log, each term over its own rows (the CE over the draft vocabulary's targets, the KL
    over all), as the optimised loss is normalised; its top-1/top-5 are those of the logging step's
    micro-batches alone (step 1's are not pooled into step 2's log)."""
    module = _module(variant)
    seen: list[tuple[int, bool, dict]] = []  # (optimizer step, top-k counted, by-hand figures)
    trainer = None

    def record(mod, args, kwargs):
        if mod.training:
            seen.append((trainer.state.global_step + 1, mod.with_metrics, _by_hand(mod, kwargs)))

    module.register_forward_pre_hook(record, with_kwargs=True)
    args = cpu_training_args(
        tmp_path,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=4,
        logging_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        save_strategy="no",
    )
    trainer = MedusaTrainer(
        model=module,
        args=args,
        train_dataset=_records(),
        data_collator=PadCollator(0),
        callbacks=[MetricsScheduleCallback()],
    )
    trainer.train()
    logs = {entry["step"]: entry for entry in trainer.head_history}
    assert sorted(logs) == [2, 4] and len(seen) == 8

    for step, since in ((2, 0), (4, 2)):
        window = [f for s, _, f in seen if since < s <= step]
        total = {key: sum(f[key] for f in window) for key in window[0]}
        for k in range(3):
            if variant == "medusa1":
                want = total["kl"][k] / total["kl_rows"][k] + 0.5 * total["ce"][k] / total["ce_rows"][k]
            else:
                want = total["ce"][k] / total["ce_rows"][k]
            assert logs[step][f"head{k + 1}/loss"] == pytest.approx(float(want), rel=1e-5, abs=2e-5)
        if variant != "medusa1":
            want = total["lm"] / total["lm_rows"]
            assert logs[step]["lm_loss"] == pytest.approx(float(want), rel=1e-5, abs=2e-5)
        counted = [f for s, on, f in seen if on and since < s <= step]
        assert [s for s, on, _ in seen if on and since < s <= step] == [step, step]
        hits = {key: sum(f[key] for f in counted) for key in ("top1", "top5", "n")}
        for k in range(3):
            assert logs[step][f"head{k + 1}/top1"] == pytest.approx(
                float(hits["top1"][k] / hits["n"][k]), abs=1e-5
            )
            assert logs[step][f"head{k + 1}/top5"] == pytest.approx(
                float(hits["top5"][k] / hits["n"][k]), abs=1e-5
            )


@pytest.mark.parametrize(
    ("logging_steps", "resumed_with", "first_step"), [(2, 2, False), (3, 3, True), (2, 3, False)]
)
def test_top_k_is_counted_on_exactly_the_steps_the_trainer_logs(
    tmp_path, logging_steps, resumed_with, first_step
):
    """Top-k is counted on the steps the Trainer logs (every ``state.logging_steps``-th, step 1 with
    ``logging_first_step``) and the last: a run resumed with another ``logging_steps`` logs on the
    checkpoint's (its trainer state's), and a step counted but not logged would be pooled into the next
    log."""
    from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState

    args = TrainingArguments(
        output_dir=str(tmp_path), logging_steps=resumed_with, logging_first_step=first_step, report_to="none"
    )
    state = TrainerState(max_steps=7, logging_steps=logging_steps)
    module = SimpleNamespace(with_metrics=True)
    schedule, flow = MetricsScheduleCallback(), DefaultFlowCallback()
    for step in range(1, 8):
        control = TrainerControl()
        schedule.on_step_begin(args, state, control, model=module)
        state.global_step = step
        control = flow.on_step_end(args, state, control)
        control = schedule.on_step_end(args, state, control)
        assert module.with_metrics == control.should_log, step
