"""Timed decoding for eval and the benchmarks: plain greedy ``generate`` and Medusa tree decoding with
the same stopping rule, each call timed whole (the speed-up is tokens/s of one over the other, same
prompts, same process), and the same comparison for batches of prompts.

Plain decoding is transformers' own ``model.generate(do_sample=False)`` (prompt lookup and assisted
generation are the same call with their ``generate`` arguments); Medusa is :func:`medusa_generate`
(batch 1) and :func:`medusa_generate_batch`. With ``compile=True`` two more: plain greedy through
transformers' static cache with a compiled forward (``cache_implementation="static"``, the fair GPU
baseline) and greedy Medusa through a :class:`StaticDecoder` (a CUDA graph on CUDA, ``torch.compile``
elsewhere), one decoder per capacity bucket, captured on first use.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import CompileConfig

from medusa_train.decoding.batched import medusa_generate_batch
from medusa_train.decoding.generate import attention_backends, medusa_generate
from medusa_train.decoding.static import StaticDecoder

log = logging.getLogger(__name__)


@dataclass
class Decoded:
    """One decoder call: new token ids (one list per row for the batched calls) and the wall-clock
    seconds of the whole call."""

    tokens: list[int]
    seconds: float
    accepted_lengths: list[int] | None = None


class TimedDecoders:
    """Plain greedy ``generate`` and ``medusa_generate`` with the same stopping rule, timed whole.

    ``attention``: the Medusa decoders' tree attention ("sdpa", "triton", "cuda" or "auto").
    """

    def __init__(
        self, model, packed, tree, eos: list[int], pad_token_id: int | None, attention: str = "sdpa"
    ) -> None:
        self.model, self.packed, self.tree, self.eos, self.pad = model, packed, tree, eos, pad_token_id
        self.attention = attention
        self.device = next(model.parameters()).device
        self._static: dict[int, StaticDecoder] = {}  # capacity -> captured decoder

    def compiled_generate_args(self) -> dict:
        """``generate`` arguments of the compiled plain baseline: transformers' static cache, whose forward
        transformers compiles itself on CUDA (``mode="reduce-overhead"``); elsewhere compiled here with
        the default mode (transformers compiles on accelerators only unless told)."""
        extra: dict = {"cache_implementation": "static"}
        if self.device.type != "cuda":
            config = CompileConfig(mode="default")
            config._compile_all_devices = True
            extra["compile_config"] = config
        return extra

    @property
    def static_capture(self) -> str:
        """How the static decoder's step is captured here: a CUDA graph on CUDA, torch.compile elsewhere."""
        return "cuda_graph" if self.device.type == "cuda" else "compile"

    @torch.inference_mode()
    def medusa_static(self, ids: torch.Tensor, max_new_tokens: int) -> Decoded:
        """Greedy Medusa through a captured :class:`StaticDecoder` (capacity: the next power of two >= 256
        that holds prompt + budget + tree; each capacity is captured once, on first use)."""
        need = ids.shape[1] + max_new_tokens + self.tree.num_nodes
        capacity = max(256, 1 << (need - 1).bit_length())
        if capacity not in self._static:
            self._static[capacity] = StaticDecoder(
                self.model, self.packed, self.tree, capacity, capture=self.static_capture
            )
        out, seconds = self._timed(
            self._static[capacity].generate, ids, max_new_tokens=max_new_tokens, eos_token_id=self.eos
        )
        return Decoded(out.tokens.tolist(), seconds, list(out.accepted_lengths))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, decode, *args, **kwargs) -> tuple:
        """``decode(*args, **kwargs)`` and its wall-clock seconds (the device synchronised at both ends),
        under the attention backends the Medusa decoders use, so plain and Medusa run the same kernels."""
        self._sync()
        t0 = time.perf_counter()
        with attention_backends(self.device):
            out = decode(*args, **kwargs)
        self._sync()
        return out, time.perf_counter() - t0

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, **extra) -> tuple:
        """Plain greedy ``generate`` ``(B, T + new)`` and its seconds; ``extra``: more ``generate`` arguments."""
        return self._timed(
            self.model.generate,
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,  # the model's generation_config may set one: plain greedy here
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos,
            pad_token_id=self.pad_id,
            **extra,
        )

    @torch.inference_mode()
    def plain(self, ids: torch.Tensor, max_new_tokens: int, **extra) -> Decoded:
        """Greedy ``generate``; ``extra`` turns it into prompt lookup or assisted generation."""
        out, seconds = self._generate(ids, torch.ones_like(ids), max_new_tokens, **extra)
        return Decoded(out[0, ids.shape[1] :].tolist(), seconds)

    @property
    def pad_id(self) -> int:
        return self.pad if self.pad is not None else self.eos[0]

    @torch.inference_mode()
    def plain_batch(self, rows: list[torch.Tensor], max_new_tokens: int) -> Decoded:
        """Greedy ``generate`` on left-padded ``(1, T)`` prompts; each row's tokens up to its EOS."""
        width = max(r.shape[1] for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - r.shape[1] :] = r[0]
            mask[i, width - r.shape[1] :] = 1
        out, seconds = self._generate(ids, mask, max_new_tokens)
        eos = set(self.eos)
        tokens = []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            tokens.append(row[:cut])
        return Decoded(tokens, seconds)

    @torch.inference_mode()
    def medusa_batch(self, rows: list[torch.Tensor], max_new_tokens: int) -> Decoded:
        """Greedy ``medusa_generate_batch`` on the same prompts; ``accepted_lengths`` of all rows."""
        out, seconds = self._timed(
            medusa_generate_batch,
            self.model,
            self.packed,
            rows,
            max_new_tokens=max_new_tokens,
            tree=self.tree,
            eos_token_id=self.eos,
            pad_token_id=self.pad_id,
            attention=self.attention,
        )
        steps = [n for r in out.rows for n in r.accepted_lengths]
        return Decoded([r.tokens.tolist() for r in out.rows], seconds, steps)

    @torch.inference_mode()
    def medusa(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        tree=None,
        acceptance: str = "greedy",
        ecfg=None,
        generator=None,
    ) -> Decoded:
        extra = {}
        if ecfg is not None:
            extra = {
                "temperature": ecfg.temperature,
                "posterior_threshold": ecfg.posterior_threshold,
                "posterior_alpha": ecfg.posterior_alpha,
            }
        out, seconds = self._timed(
            medusa_generate,
            self.model,
            self.packed,
            ids,
            max_new_tokens=max_new_tokens,
            tree=self.tree if tree is None else tree,
            acceptance=acceptance,
            eos_token_id=self.eos,
            generator=generator,
            attention=self.attention,
            **extra,
        )
        return Decoded(out.tokens.tolist(), seconds, list(out.accepted_lengths))

    def tau_of(self, inputs: list[tuple[torch.Tensor, int]], acceptance: str, ecfg) -> float:
        """Tokens per step of ``acceptance`` at ``ecfg.temperature`` over the same prompts."""
        gen = torch.Generator(device=self.device).manual_seed(ecfg.seed)
        tokens = steps = 0
        for ids, budget in inputs:
            out = self.medusa(ids, budget, acceptance=acceptance, ecfg=ecfg, generator=gen)
            tokens += len(out.tokens)
            steps += len(out.accepted_lengths or [])
        return tokens / max(1, steps)


def batch_table(
    decode: TimedDecoders, inputs: list[tuple[torch.Tensor, int]], sizes, report: dict
) -> list[dict]:
    """Plain batched ``generate`` vs batched Medusa at each batch size in ``sizes``, same turns.

    B = 1 is the main run (4.); for B > 1 the first ``floor(n / B) * B`` turns are decoded in
    consecutive groups of B, plain then Medusa per group, with the group's smallest budget for both.
    ``identical`` is the fraction of rows whose Medusa tokens equal the plain batched row.
    """
    rows = []
    for bsz in sorted({int(b) for b in sizes}):
        if bsz == 1:
            rows.append(
                {
                    "batch_size": 1,
                    "tokens_per_s_baseline": report["tokens_per_s_baseline"],
                    "tokens_per_s_medusa": report["tokens_per_s_medusa"],
                    "speedup": report["speedup"],
                    "tau": report["tau"],
                    "identical": report["greedy_identical"],
                    "turns": report["num_turns"],
                }
            )
            continue
        if bsz > len(inputs):
            log.warning("eval.batch_sizes: %d is more than the %d evaluated turns: skipped", bsz, len(inputs))
            continue
        groups = [inputs[i : i + bsz] for i in range(0, len(inputs) - bsz + 1, bsz)]
        warm = [ids for ids, _ in groups[0]]
        decode.plain_batch(warm, 4)
        decode.medusa_batch(warm, 4)
        base_tok = med_tok = steps = same = 0
        base_s = med_s = 0.0
        for group in groups:
            ids = [i for i, _ in group]
            budget = min(b for _, b in group)
            base = decode.plain_batch(ids, budget)
            med = decode.medusa_batch(ids, budget)
            base_tok += sum(len(t) for t in base.tokens)
            med_tok += sum(len(t) for t in med.tokens)
            steps += len(med.accepted_lengths or [])
            same += sum(a == b for a, b in zip(base.tokens, med.tokens, strict=True))
            base_s, med_s = base_s + base.seconds, med_s + med.seconds
        base_tps, med_tps = base_tok / max(1e-9, base_s), med_tok / max(1e-9, med_s)
        rows.append(
            {
                "batch_size": bsz,
                "tokens_per_s_baseline": base_tps,
                "tokens_per_s_medusa": med_tps,
                "speedup": med_tps / base_tps if base_tps > 0 else 0.0,
                "tau": med_tok / max(1, steps),
                "identical": same / (len(groups) * bsz),
                "turns": len(groups) * bsz,
            }
        )
        log.info("batch %d: speed-up %.2fx, tau %.2f", bsz, rows[-1]["speedup"], rows[-1]["tau"])
    return rows
