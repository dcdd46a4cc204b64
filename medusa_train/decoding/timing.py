"""Timed decoding for eval and the benchmarks: plain greedy ``generate`` and Medusa tree decoding with
the same stopping rule, each call timed whole, and the protocol every speed-up of the project is
measured with.

Plain decoding is transformers' own ``model.generate(do_sample=False)`` (prompt lookup and assisted
generation are the same call with their ``generate`` arguments); Medusa is :func:`medusa_generate`
(batch 1) and :func:`medusa_generate_batch`. With ``compile=True`` two more: plain greedy through
transformers' static cache with a compiled forward (``cache_implementation="static"``, the fair GPU
baseline) and greedy Medusa through a :class:`StaticDecoder` (a CUDA graph on CUDA, ``torch.compile``
elsewhere), one decoder per capacity bucket and number of rows, captured on first use; both at batch 1
and, in the batch-size table, with B rows.

The protocol (eval's main row, its batch-size table and tree-size sweep, ``scripts/bench_decode.py``):

1. Warm-up: every decoder first runs the first :data:`WARMUP_TURNS` turns at their full budget,
   untimed, so kernels, the allocator and (on a GPU) attention plans are ready for the shapes the
   timed turns use.
2. Interleaving: per turn, the decoders run back to back in an order that rotates from turn to turn
   (:func:`interleaved`: turn t starts with the (t mod n)-th of n decoders; plain and Medusa alone
   alternate, plain first on even turns), each call timed whole
   with the device synchronised at both ends; a burst of load on a shared host then hits one turn of
   each decoder, not a block of one decoder's turns.
3. Figures (:func:`speedup_figures`): the speed-up of every turn (its Medusa tokens/s over its plain
   tokens/s); the headline is their median, with the quartiles as its spread; the ratio of tokens/s
   summed over all turns is kept beside it (a few disturbed turns can move it far).
4. Plausibility: a turn of n tokens costs plain decoding ``P + n * c_plain`` and Medusa
   ``P + (n / tau) * c_medusa`` (P: the prefill, c: one decode step), so its speed-up lies between 1
   and ``tau * c_plain / c_medusa``. With the step costs measured on the same turns (their medians,
   so a burst does not move them), a headline above ``max(1, tau * c_plain / c_medusa) * (1 +
   PLAUSIBILITY_MARGIN)`` cannot come from the decoders: it is kept in the figures, flagged
   (``speedup_plausible: false``) and not printed as the headline. Without measured step costs a
   tree step is taken to cost at least a plain step (``c_plain / c_medusa = 1``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from transformers import CompileConfig

from medusa_train.decoding.attention.triton_kernel import tuning_frozen
from medusa_train.decoding.batched import medusa_generate_batch
from medusa_train.decoding.generate import attention_backends, medusa_generate
from medusa_train.decoding.static import StaticDecoder, capacity_for, host_synced_rope

if TYPE_CHECKING:  # annotations only: config imports Hydra, which this module must not need
    from medusa_train.config import EvalConfig

log = logging.getLogger(__name__)

WARMUP_TURNS = 2
"""Turns every decoder runs untimed at their full budget before the timed ones."""
SPREAD = (0.25, 0.75)
"""Quantiles of the per-turn speed-ups reported as the headline's spread (``speedup_q25``/``_q75``)."""
PLAUSIBILITY_MARGIN = 0.2
"""Relative margin over the speed-up that tau and the measured step costs allow (timing noise)."""


@dataclass
class Decoded:
    """One decoder call: new token ids (one list per row for the batched calls), the wall-clock
    seconds of the whole call, and for Medusa the accepted lengths, the prefill's seconds and the
    verification forwards (the steps whose cost the plausibility check compares)."""

    tokens: list
    seconds: float
    accepted_lengths: list[int] | None = None
    prefill_s: float = 0.0
    forwards: int = 0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter's length if one is a prefix of
    the other), None when they are equal: how far a half-precision Medusa row follows plain greedy."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def pair_record(base: Decoded, med: Decoded) -> dict:
    """What one turn decoded plainly (``base``) and with Medusa (``med``) says: whether the tokens are
    identical, counts and seconds of both, Medusa's steps and accepted lengths, its speed-up, and the
    seconds of one decode step of each (the prefill, Medusa's, taken out of both calls)."""
    flat = not base.tokens or not isinstance(base.tokens[0], list)
    base_tokens = len(base.tokens) if flat else sum(len(t) for t in base.tokens)
    med_tokens = len(med.tokens) if flat else sum(len(t) for t in med.tokens)
    plain_steps = len(base.tokens) if flat else max(len(t) for t in base.tokens)  # generate: a token a step
    base_tps, med_tps = base_tokens / max(1e-9, base.seconds), med_tokens / max(1e-9, med.seconds)
    return {
        "identical": base.tokens == med.tokens,
        "first_difference": first_difference(base.tokens, med.tokens) if flat else None,
        "tokens": med_tokens,
        "steps": len(med.accepted_lengths or []),
        "baseline_tokens": base_tokens,
        "baseline_s": base.seconds,
        "medusa_s": med.seconds,
        "speedup": med_tps / base_tps if base_tps > 0 else 0.0,
        "plain_step_s": max(0.0, base.seconds - med.prefill_s) / max(1, plain_steps)
        if med.forwards
        else None,
        "medusa_step_s": max(0.0, med.seconds - med.prefill_s) / med.forwards if med.forwards else None,
        "accepted_lengths": med.accepted_lengths,
    }


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``values`` (linear interpolation between order statistics)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def speedup_ceiling(tau: float, step_cost_ratio: float | None) -> float:
    """The largest speed-up tau and the step costs allow, with :data:`PLAUSIBILITY_MARGIN`
    (``step_cost_ratio``: plain step seconds over Medusa step seconds; None: taken as 1)."""
    ratio = 1.0 if step_cost_ratio is None else step_cost_ratio
    return max(1.0, tau * ratio) * (1.0 + PLAUSIBILITY_MARGIN)


def speedup_figures(turns: Sequence[Mapping]) -> dict:
    """The protocol's figures over turns (:func:`pair_record` dicts, or eval's records, which hold them).

    Returns:
        ``tau``; ``tokens_per_s_baseline``/``_medusa`` and ``speedup_tokens_per_s`` (summed over the
        turns); ``speedup`` (the median per-turn speed-up, the headline), ``speedup_q25``/``_q75``;
        ``step_cost_ratio`` (median plain step over median Medusa step seconds, None when not
        measured), ``speedup_ceiling``, ``speedup_plausible`` and ``speedup_note`` (one line, None
        when there is nothing to say).
    """
    tokens = sum(t["tokens"] for t in turns)
    steps = sum(t["steps"] for t in turns)
    base_tokens = sum(t["baseline_tokens"] for t in turns)
    base_s, med_s = sum(t["baseline_s"] for t in turns), sum(t["medusa_s"] for t in turns)
    tps_base, tps_med = base_tokens / max(1e-9, base_s), tokens / max(1e-9, med_s)
    summed = tps_med / tps_base if tps_base > 0 else 0.0
    per_turn = [t["speedup"] for t in turns]
    tau = tokens / max(1, steps)
    plain_step = [t["plain_step_s"] for t in turns if t.get("plain_step_s") is not None]
    med_step = [t["medusa_step_s"] for t in turns if t.get("medusa_step_s")]
    ratio = statistics.median(plain_step) / statistics.median(med_step) if plain_step and med_step else None
    ceiling = speedup_ceiling(tau, ratio)
    median = statistics.median(per_turn) if per_turn else 0.0
    plausible = median <= ceiling
    note = None
    why = f"tau {tau:.2f} x plain/Medusa step cost {ratio:.2f}" if ratio is not None else f"tau {tau:.2f}"
    if not plausible:
        note = (
            f"median speed-up {median:.2f}x is above the {ceiling:.2f}x that {why} allow (+"
            f"{PLAUSIBILITY_MARGIN:.0%}): the host's load changed during the run; rerun on a quiet machine"
        )
    elif summed > ceiling:
        note = (
            f"the summed tokens/s ratio ({summed:.2f}x) is above the {ceiling:.2f}x that {why} allow: "
            "a few turns were disturbed (the median per-turn speed-up is the headline)"
        )
    return {
        "tau": tau,
        "tokens_per_s_baseline": tps_base,
        "tokens_per_s_medusa": tps_med,
        "speedup": median,
        "speedup_q25": quantile(per_turn, SPREAD[0]),
        "speedup_q75": quantile(per_turn, SPREAD[1]),
        "speedup_tokens_per_s": summed,
        "step_cost_ratio": ratio,
        "speedup_ceiling": ceiling,
        "speedup_plausible": plausible,
        "speedup_note": note,
        "new_tokens_medusa": tokens,
        "new_tokens_baseline": base_tokens,
        "steps": steps,
        "seconds_baseline": base_s,
        "seconds_medusa": med_s,
    }


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (Dynamo's count; it grows on every
    compilation and recompilation)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def interleaved(turn: int, calls: Sequence[Callable[[], Decoded]]) -> list[Decoded]:
    """Run ``calls`` back to back starting at ``calls[turn % len(calls)]`` (two calls: alternating
    order from turn to turn); the results in the order of ``calls``."""
    n = len(calls)
    out: list[Decoded | None] = [None] * n
    for j in range(n):
        i = (turn + j) % n
        out[i] = calls[i]()
    return out  # type: ignore[return-value]


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
        self._static: dict[tuple[int, int], StaticDecoder] = {}  # (capacity, rows) -> captured decoder
        self.static_attention: dict[int, str] = {}
        """The tree attention each capacity's static decoder resolved ``attention`` to (``auto``: at its
        capacity, with the threshold of a captured step), for the report: it may differ from the
        eager decoders' and the calibration's."""
        self._warming = False

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """Calls inside this block may tune the Triton tree-attention kernel for their shapes; the
        timed calls outside it never do (:func:`~medusa_train.decoding.attention.triton_kernel.tuning_frozen`:
        a shape no warm-up met takes the kernel's default configuration), so that no tuning run is timed."""
        saved, self._warming = self._warming, True
        try:
            yield
        finally:
            self._warming = saved

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
        """How the static decoder's step is captured here: a CUDA graph on CUDA (eager for a model whose
        RoPE a graph cannot capture: :func:`host_synced_rope`), torch.compile elsewhere."""
        if self.device.type != "cuda":
            return "compile"
        return "eager" if host_synced_rope(self.model) else "cuda_graph"

    def static_decoder(self, capacity: int, batch_size: int = 1) -> StaticDecoder:
        """The :class:`StaticDecoder` of ``capacity`` with ``batch_size`` rows, built (and so captured, on its
        first call) once."""
        key = (capacity, batch_size)
        if key not in self._static:
            self._static[key] = StaticDecoder(
                self.model,
                self.packed,
                self.tree,
                capacity,
                batch_size=batch_size,
                capture=self.static_capture,
                attention=self.attention,
            )
            self.static_attention[capacity] = self._static[key].attention
        return self._static[key]

    def release_static(self, batch_size: int) -> None:
        """Drop the static decoders with ``batch_size`` rows (their caches and captured graphs)."""
        for key in [k for k in self._static if k[1] == batch_size]:
            del self._static[key]

    @torch.inference_mode()
    def medusa_static(self, ids: torch.Tensor, max_new_tokens: int) -> Decoded:
        """Greedy Medusa through a captured :class:`StaticDecoder` (capacity: the next power of two >= 256
        that holds prompt + budget + tree; each capacity is captured once, on first use)."""
        decoder = self.static_decoder(self.static_capacity(ids.shape[1], max_new_tokens))
        out, seconds = self._timed(
            decoder.generate, ids, max_new_tokens=max_new_tokens, eos_token_id=self.eos
        )
        return Decoded(out.tokens.tolist(), seconds, list(out.accepted_lengths))

    @torch.inference_mode()
    def medusa_static_batch(self, rows: list[torch.Tensor], max_new_tokens: int) -> Decoded:
        """Greedy Medusa through a captured :class:`StaticDecoder` with ``len(rows)`` rows (``(1, T)``
        prompts, no padding; capacity as :meth:`medusa_static` for the longest); ``accepted_lengths`` of
        all rows, ``forwards`` the steps run (every row takes part in every step)."""
        capacity = self.static_capacity(max(r.shape[1] for r in rows), max_new_tokens)
        decoder = self.static_decoder(capacity, len(rows))
        out, seconds = self._timed(
            decoder.generate_batch, rows, max_new_tokens=max_new_tokens, eos_token_id=self.eos
        )
        steps = [n for r in out.rows for n in r.accepted_lengths]
        return Decoded([r.tokens.tolist() for r in out.rows], seconds, steps, out.prefill_s, out.num_forwards)

    def warm_up_compiled(self, turns: Sequence[tuple[torch.Tensor, int]], compiled_args: dict) -> None:
        """Compile and capture, untimed, every shape the compiled decoders meet on ``turns`` (``(ids,
        budget)`` pairs): transformers' static-cache ``generate`` once on the turn needing the longest cache
        (later calls reuse a cache at least that long, so they do not recompile), and the static decoder
        once per capacity, on that capacity's longest turn. Without this a compile would land inside a
        timed turn and slow the compiled baseline, inflating Medusa's speed-up over it."""
        if turns:
            with self.warming_up():
                self.plain(*max(turns, key=lambda t: t[0].shape[1] + t[1]), **compiled_args)
                for ids, budget in self._longest_per_capacity(turns, lambda t: t[0].shape[1]):
                    self.medusa_static(ids, budget)

    def warm_up_compiled_batch(
        self, groups: Sequence[tuple[list[torch.Tensor], int]], compiled_args: dict
    ) -> None:
        """:meth:`warm_up_compiled` for groups of B rows (``(prompts, budget)`` pairs, every group the same
        B): the static-cache ``generate`` on the group needing the longest cache, the static decoder
        with B rows once per capacity, on that capacity's longest group."""
        if groups:
            with self.warming_up():
                self.plain_batch(
                    *max(groups, key=lambda g: max(r.shape[1] for r in g[0]) + g[1]), **compiled_args
                )
                for rows, budget in self._longest_per_capacity(
                    groups, lambda g: max(r.shape[1] for r in g[0])
                ):
                    self.medusa_static_batch(rows, budget)

    def _longest_per_capacity(
        self, items: Sequence[tuple], prompt_len: Callable[[tuple], int]
    ) -> list[tuple]:
        """Of ``(prompts, budget)`` items, the one needing the most columns for each static capacity."""
        chosen: dict[int, tuple] = {}
        for item in items:
            need = prompt_len(item) + item[1]
            cap = self.static_capacity(prompt_len(item), item[1])
            if cap not in chosen or need > prompt_len(chosen[cap]) + chosen[cap][1]:
                chosen[cap] = item
        return list(chosen.values())

    def static_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """The static decoder's cache capacity for a turn: the next power of two >= 256 that holds the
        prompt, the budget and one tree."""
        return capacity_for(prompt_len + max_new_tokens + self.tree.num_nodes)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, decode, *args, **kwargs) -> tuple:
        """``decode(*args, **kwargs)`` and its wall-clock seconds (the device synchronised at both ends),
        under the attention backends the Medusa decoders use, so plain and Medusa run the same kernels."""
        self._sync()
        t0 = time.perf_counter()
        with attention_backends(self.device), contextlib.nullcontext() if self._warming else tuning_frozen():
            out = decode(*args, **kwargs)
        self._sync()
        return out, time.perf_counter() - t0

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, **extra) -> tuple:
        """Plain greedy ``generate`` ``(B, T + new)`` and its seconds; ``extra``: more ``generate`` arguments.

        A call of the compiled baseline that compiled (torch.compile made a new graph: a turn needing a
        longer static cache than any before, as a later turn of ``eval.all_turns`` can, since the
        warm-up sees first turns only) is run again and the second call timed: compilation is not
        what the baseline is timed for, and it would inflate Medusa's speed-up over it."""
        kwargs = dict(
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
        compiled = extra.get("cache_implementation") == "static"
        graphs = compiled_graphs()
        out = self._timed(self.model.generate, **kwargs)
        if compiled and compiled_graphs() != graphs:
            log.info("the compiled baseline compiled inside a timed turn: timing that turn again")
            out = self._timed(self.model.generate, **kwargs)
        return out

    @torch.inference_mode()
    def plain(self, ids: torch.Tensor, max_new_tokens: int, **extra) -> Decoded:
        """Greedy ``generate``; ``extra`` turns it into prompt lookup or assisted generation."""
        out, seconds = self._generate(ids, torch.ones_like(ids), max_new_tokens, **extra)
        return Decoded(out[0, ids.shape[1] :].tolist(), seconds)

    @property
    def pad_id(self) -> int:
        return self.pad if self.pad is not None else self.eos[0]

    @torch.inference_mode()
    def plain_batch(self, rows: list[torch.Tensor], max_new_tokens: int, **extra) -> Decoded:
        """Greedy ``generate`` on left-padded ``(1, T)`` prompts; each row's tokens up to its EOS; ``extra``:
        more ``generate`` arguments (:meth:`compiled_generate_args`: the compiled baseline)."""
        width = max(r.shape[1] for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - r.shape[1] :] = r[0]
            mask[i, width - r.shape[1] :] = 1
        out, seconds = self._generate(ids, mask, max_new_tokens, **extra)
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
        return Decoded([r.tokens.tolist() for r in out.rows], seconds, steps, out.prefill_s, out.num_forwards)

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
        return Decoded(
            out.tokens.tolist(), seconds, list(out.accepted_lengths), out.prefill_s, out.num_forwards
        )

    def tau_of(self, inputs: list[tuple[torch.Tensor, int]], acceptance: str, ecfg: EvalConfig) -> float:
        """Tokens per step of ``acceptance`` at ``ecfg.temperature`` over the same prompts."""
        gen = torch.Generator(device=self.device).manual_seed(ecfg.seed)
        tokens = steps = 0
        for ids, budget in inputs:
            out = self.medusa(ids, budget, acceptance=acceptance, ecfg=ecfg, generator=gen)
            tokens += len(out.tokens)
            steps += len(out.accepted_lengths or [])
        return tokens / max(1, steps)


def batch_table(
    decode: TimedDecoders,
    inputs: list[tuple[torch.Tensor, int]],
    sizes,
    report: dict,
    compiled_args: dict | None = None,
) -> list[dict]:
    """Plain batched ``generate`` vs batched Medusa at each batch size in ``sizes``, same turns.

    B = 1 is the main run (``report``); for B > 1 the first ``floor(n / B) * B`` turns are decoded
    in consecutive groups of B with the group's smallest budget for both, after a warm-up on the
    first group; plain and Medusa alternate which goes first from group to group, and the speed-up is
    the median over groups (:func:`speedup_figures`). ``identical`` is the fraction of rows whose
    Medusa tokens equal the plain batched row.

    With ``compiled_args`` (:meth:`TimedDecoders.compiled_generate_args`, eval.compile) two more
    decoders join every group, in the same rotation: the static-cache compiled ``generate`` with B
    rows (left padding) and a :class:`StaticDecoder` with B rows, each compiled or captured untimed
    first (:meth:`TimedDecoders.warm_up_compiled_batch`); a row then also holds
    :data:`BATCH_COMPILED_KEYS` (B = 1: the main run's ``alternatives``).
    """
    rows = []
    for bsz in sorted({int(b) for b in sizes}):
        if bsz == 1:
            rows.append(
                {
                    "batch_size": 1,
                    **{k: report[k] for k in BATCH_ROW_FIGURES},
                    "identical": report["greedy_identical"],
                    "turns": report["num_turns"],
                    **(_compiled_at_batch_1(report["alternatives"]) if compiled_args is not None else {}),
                }
            )
            continue
        if bsz > len(inputs):
            log.warning("eval.batch_sizes: %d is more than the %d evaluated turns: skipped", bsz, len(inputs))
            continue
        groups = [inputs[i : i + bsz] for i in range(0, len(inputs) - bsz + 1, bsz)]
        batches = [([ids for ids, _ in group], min(b for _, b in group)) for group in groups]
        with decode.warming_up():
            decode.plain_batch(*batches[0])
            decode.medusa_batch(*batches[0])
        if compiled_args is not None:
            decode.warm_up_compiled_batch(batches, compiled_args)
        records, static_records, compiled_records, static_vs_compiled = [], [], [], []
        same = same_static = same_compiled = 0
        for g, (ids, budget) in enumerate(batches):
            calls = [partial(decode.plain_batch, ids, budget), partial(decode.medusa_batch, ids, budget)]
            if compiled_args is not None:
                calls.append(partial(decode.plain_batch, ids, budget, **compiled_args))
                calls.append(partial(decode.medusa_static_batch, ids, budget))
            base, med, *compiled = interleaved(g, calls)
            records.append(pair_record(base, med))
            same += sum(a == b for a, b in zip(base.tokens, med.tokens, strict=True))
            if compiled:
                comp, static = compiled
                compiled_records.append(pair_record(base, comp))
                static_records.append(pair_record(base, static))
                static_vs_compiled.append(pair_record(comp, static)["speedup"])
                same_compiled += sum(a == b for a, b in zip(base.tokens, comp.tokens, strict=True))
                same_static += sum(a == b for a, b in zip(base.tokens, static.tokens, strict=True))
        figures = speedup_figures(records)
        n_rows = len(groups) * bsz
        row = {
            "batch_size": bsz,
            **{k: figures[k] for k in BATCH_ROW_FIGURES},
            "identical": same / n_rows,
            "turns": n_rows,
        }
        if compiled_args is not None:
            static_fig, compiled_fig = speedup_figures(static_records), speedup_figures(compiled_records)
            row |= {
                "static_tokens_per_s": static_fig["tokens_per_s_medusa"],
                "static_speedup": static_fig["speedup"],
                "static_identical": same_static / n_rows,
                "compiled_tokens_per_s": compiled_fig["tokens_per_s_medusa"],
                "compiled_speedup": compiled_fig["speedup"],
                "compiled_identical": same_compiled / n_rows,
                "static_speedup_vs_compiled": statistics.median(static_vs_compiled),
            }
            decode.release_static(bsz)
        rows.append(row)
        log.info("batch %d: speed-up %.2fx, tau %.2f", bsz, row["speedup"], row["tau"])
    return rows


def _compiled_at_batch_1(alternatives: Mapping[str, Mapping]) -> dict:
    """:data:`BATCH_COMPILED_KEYS` of the batch-1 row, from the main run's ``compiled_plain`` and
    ``static_medusa`` alternatives."""
    static, compiled = alternatives["static_medusa"], alternatives["compiled_plain"]
    return {
        "static_tokens_per_s": static["tokens_per_s"],
        "static_speedup": static["speedup"],
        "static_identical": static["identical"],
        "compiled_tokens_per_s": compiled["tokens_per_s"],
        "compiled_speedup": compiled["speedup"],
        "compiled_identical": compiled["identical"],
        "static_speedup_vs_compiled": static["speedup_vs_compiled"],
    }


BATCH_ROW_FIGURES = (
    "tokens_per_s_baseline",
    "tokens_per_s_medusa",
    "speedup",
    "speedup_q25",
    "speedup_q75",
    "speedup_tokens_per_s",
    "speedup_plausible",
    "tau",
)
"""The :func:`speedup_figures` a row of the batch-size table keeps."""


BATCH_COMPILED_KEYS = (
    "static_tokens_per_s",
    "static_speedup",
    "static_identical",
    "compiled_tokens_per_s",
    "compiled_speedup",
    "compiled_identical",
    "static_speedup_vs_compiled",
)
"""What a row of the batch-size table adds with eval.compile: the :class:`StaticDecoder` with B rows and
the static-cache compiled ``generate`` with B rows, each tokens/s, speed-up over plain batched
``generate`` (median over groups) and fraction of rows identical to it, and the static decoder's
speed-up over the compiled ``generate`` (median over groups)."""
