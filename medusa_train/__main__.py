"""Command line: ``python -m medusa_train stage=<stage> [group=option ...] [key=value ...]``.

Run as:
    python -m medusa_train stage=all                                   # the embedded demo, CPU
    python -m medusa_train stage=train model=hf model.name_or_path=...  # a real model
    deepspeed --num_gpus 8 --module medusa_train stage=train deepspeed=zero2 ...   # the launcher's flag is --module
    torchrun --nproc_per_node 8 -m medusa_train stage=distill ...

This module only parses and dispatches; each stage lives in ``medusa_train/stages/<stage>.py``.

``--help`` and ``--cfg`` answer without importing torch or transformers (seconds to import): the
report, which pulls them in, and :mod:`medusa_train.dist` (torch.distributed) are imported in
:func:`run_stage` and :func:`_dispatch`, where every rank leaves its process group and
``stage=all`` prints its summary, and in :func:`entry`, where a launched rank exits
-- the one place the project imports its own modules inside a function
(``tests/unit/test_architecture.py`` allows it here and nowhere else).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from medusa_train.backbone_source import check_assistant_source, check_backbone_source
from medusa_train.card_inputs import stored_topk
from medusa_train.config import Config, compose_config
from medusa_train.data.sources import eval_prompts, source_files
from medusa_train.errors import UserError, environment_fault
from medusa_train.heads_layout import check_heads_option
from medusa_train.launch import is_main, launch_problem, launched
from medusa_train.stages import STAGE_ORDER, check_settings, get_stage
from medusa_train.workdir import EVAL, MANIFEST, PRETRAIN_REPORT, REPORT_MD, Workdir, check_workdir, require

HELP = """usage: python -m medusa_train stage=<pretrain|distill|train|export|eval|all> [group=option] [key=value]

groups (conf/):  model=tiny|hf  data=embedded|sharegpt|alpaca|mtbench|jsonl|text|hub
                 training=medusa1|medusa2  deepspeed=none|zero2|zero3
                 tree=calibrated|medusa63|chain|custom  tracking=offline|online|disabled  debug=fast
keys:            workdir=runs/default  seed=0  and every field documented in medusa_train/config.py,
                 e.g. training.lr=1e-3 distill.max_new_tokens=256 eval.num_prompts=24
--cfg            print the composed config and exit
"""

_LOCAL_RANK = re.compile(r"^--local[_-]rank(=(\d+))?$")


def strip_launcher_args(argv: list[str]) -> list[str]:
    """Remove ``--local_rank=N`` (deepspeed/torch.distributed.launch) and export it as LOCAL_RANK."""
    out: list[str] = []
    skip_next = False
    for i, arg in enumerate(argv):
        if skip_next:
            skip_next = False
            continue
        match = _LOCAL_RANK.match(arg)
        if match:
            if match.group(2) is not None:
                os.environ.setdefault("LOCAL_RANK", match.group(2))
            elif i + 1 < len(argv) and argv[i + 1].isdigit():
                os.environ.setdefault("LOCAL_RANK", argv[i + 1])
                skip_next = True
            continue
        out.append(arg)
    return out


NOT_APPLICABLE = {
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward",
    "DeepSpeed": "Setting accelerator to CPU",
}
"""Third-party log lines that transformers' own imports trigger whatever is asked (it imports peft,
which imports bitsandbytes, and deepspeed when installed): logger name -> message prefix. They are
dropped when they do not apply to the run (:func:`quiet_third_party`)."""


class _DropPrefix(logging.Filter):
    """Drops a logger's records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_third_party(quantization: str, deepspeed: bool) -> None:
    """Drop the :data:`NOT_APPLICABLE` lines that do not concern this run: bitsandbytes' CPU 4-bit
    kernel notice unless ``model.quantization=4bit``, DeepSpeed's accelerator notice unless DeepSpeed
    is used. Installed on the named loggers before they exist (the libraries add handlers, not filters)."""
    wanted = {"bitsandbytes.backends.cpu.ops": quantization == "4bit", "DeepSpeed": deepspeed}
    for name, prefix in NOT_APPLICABLE.items():
        logger = logging.getLogger(name)
        if not wanted[name] and not any(isinstance(f, _DropPrefix) for f in logger.filters):
            logger.addFilter(_DropPrefix(prefix))


def run_stage(cfg: Config) -> dict:
    """Run ``cfg.stage``; then, in a launched run, this rank leaves its process group (see dist.leave),
    after the stage succeeded or failed, but not on Ctrl-C: a collective may still be in flight then,
    and leaving would wait for it while the user waits for the process to stop."""
    from medusa_train import dist  # torch: not needed by --help/--cfg (module docstring)

    try:
        result = _dispatch(cfg)
    except KeyboardInterrupt:
        raise
    except BaseException:
        dist.leave()
        raise
    dist.leave()
    return result


def _dispatch(cfg: Config) -> dict:
    """Dispatch on ``cfg.stage``; ``all`` chains every stage (each skips work already done), after the
    settings the later stages would refuse (:func:`~medusa_train.stages.check_settings`)."""
    from medusa_train.report import summary_table  # torch, like dist above

    if cfg.stage != "all":
        return get_stage(cfg.stage)(cfg)
    check_settings(cfg)
    results: dict = {}
    for name in STAGE_ORDER:
        if name == "pretrain" and not cfg.model.embedded:
            continue
        start = time.time()
        results[name] = get_stage(name)(cfg)
        results[name]["stage_seconds"] = round(time.time() - start, 1)
    if results.get("eval", {}).get("tau") is not None:
        report = f"{cfg.workdir}/{EVAL}/{REPORT_MD}"
        print(f"\n{summary_table(results['eval'])}\n\nfull report: {report}")
    return results


def _outputs(cfg: Config) -> tuple[Path, ...]:
    """The folders the run's stages write (checked with the workdir before any work). Not eval's
    rewrite of the export's model card: a card it cannot write is a warning, not a failure. Nor a
    folder holding its stage's finished output (the embedded model's ``train_report.json``, the
    distilled data's ``manifest.json``) without that stage's ``overwrite``: a run with its settings
    reuses it without a write (a team's read-only data), and one that must write there after all
    (other settings: refused first) fails at that write in one line."""
    wd = Workdir(Path(cfg.workdir))
    embedded = Path(cfg.model.name_or_path)
    finished = {
        embedded: cfg.model.embedded
        and not cfg.pretrain.overwrite
        and (embedded / PRETRAIN_REPORT).is_file(),
        wd.distill: not cfg.distill.overwrite and (wd.distill / MANIFEST).is_file(),
    }
    writes = {
        "pretrain": (embedded,) if cfg.model.embedded else (),
        "distill": (wd.distill,),
        "train": (wd.train, wd.heads),
        "export": (wd.export,),
        "eval": (wd.eval,),
    }
    return tuple(
        folder
        for stage in (STAGE_ORDER if cfg.stage == "all" else (cfg.stage,))
        for folder in writes[stage]
        if not finished.get(folder)
    )


def check_inputs(cfg: Config) -> None:
    """Refuse at once a run whose stages lack an input: the output of an earlier stage in the same
    workdir (a wrong ``workdir=``, a stage not run yet), the files of ``data.path``, a backbone
    directory that is not there, eval's prompts (``eval.path``: a file with usable prompts) or draft
    model's directory (``eval.assistant_model``), or a heads folder an option names that is missing or
    damaged (``training.init_heads``, ``export.heads_dir``, ``eval.heads_dir``, ``eval.compare``).
    Importing a stage takes seconds (torch, transformers, peft, datasets) and each stage checks these
    anyway, with the same messages (a stage can be called as a library): here the checks that need none
    of those come before that import. Where two inputs are wrong, the first one named may not be the one
    the stage would name first (its other checks need torch). ``stage=all`` makes each later stage's
    workdir input as it goes; ``model=tiny``'s backbone (``stage=pretrain``'s) is left to the stages
    (distill reads its data source first), and so is ``data=text``'s corpus for pretrain (its own rule:
    one file). Export and eval run on rank 0 only, as the stages do (the other ranks of a launch return
    at once)."""
    wd = Workdir(Path(cfg.workdir))
    first_rank = is_main()
    if cfg.stage == "train":
        require(wd.distill, "distilled data", "distill")
    if cfg.stage in ("export", "eval") and first_rank and not getattr(cfg, cfg.stage).heads_dir:
        require(wd.heads, "trained heads", "train")
    if cfg.stage in ("distill", "all") and cfg.data.format not in ("embedded", "hub"):
        source_files(cfg.data.format, cfg.data.path)  # distill's rule
    if cfg.stage in ("distill", "train", "all") and not cfg.model.embedded:
        check_backbone_source(cfg.model.name_or_path)
    if cfg.stage in ("train", "all") and cfg.training.init_heads:
        check_heads_option("training.init_heads", cfg.training.init_heads)
    if cfg.stage in ("export", "all") and first_rank and cfg.export.heads_dir:
        check_heads_option("export.heads_dir", cfg.export.heads_dir)
    if cfg.stage in ("eval", "all") and first_rank:  # in the order of eval's step 1
        if cfg.eval.heads_dir:
            stored_topk(check_heads_option("eval.heads_dir", cfg.eval.heads_dir))
        if cfg.eval.prompts != "embedded":  # stage=all: found after training otherwise
            eval_prompts(cfg.eval.prompts, cfg.eval.path, cfg.eval.prompt_key, cfg.eval.num_prompts)
        for entry in cfg.eval.compare:
            stored_topk(check_heads_option("eval.compare", entry))
        if cfg.eval.assistant_model:
            check_assistant_source(cfg.eval.assistant_model)


def main(argv: list[str] | None = None) -> int:
    argv = strip_launcher_args(list(sys.argv[1:] if argv is None else argv))
    if any(a in ("-h", "--help", "help") for a in argv):
        print(HELP)
        return 0
    print_cfg = "--cfg" in argv
    argv = [a for a in argv if a != "--cfg"]
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    cfg = None
    try:
        cfg = compose_config(argv)
        if print_cfg:
            print(json.dumps(asdict(cfg), indent=2, default=str))
            return 0
        problem = launch_problem()  # what the launcher set (check_inputs reads RANK)
        if problem is not None:
            raise UserError(problem)
        check_workdir(cfg.workdir, _outputs(cfg))  # a file there, no write access: refused before any work
        check_inputs(cfg)
        quiet_third_party(cfg.model.quantization, cfg.deepspeed.enabled)
        run_stage(cfg)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a full or read-only disk, no permission: one line too; anything else is a bug
        message = environment_fault(err, cfg.workdir if cfg is not None else ".")
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    return 0


def entry() -> None:
    """The process's entry point (``python -m medusa_train``, the ``medusa-train`` script): exit with
    :func:`main`'s code. A rank started by a launcher (torchrun, deepspeed) exits through
    ``dist.end_process`` instead of the interpreter's finalization, which can abort it after its
    stage succeeded; a bug's traceback is printed first and its exit code stays 1."""
    if not launched():
        sys.exit(main())
    from medusa_train import dist

    try:
        code = main()
    except SystemExit as stop:  # sys.exit() inside a library: its code, as the interpreter would
        code = stop.code if isinstance(stop.code, int) else (stop.code is not None)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:  # before main() could answer it
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    dist.end_process(int(code))


if __name__ == "__main__":
    entry()
