"""DeepSpeed plumbing of stage=train: the config dict, a run's process-wide state, ZeRO-3 gathering.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(arXiv:1910.02054). The Hugging Face Trainer drives DeepSpeed (``TrainingArguments(deepspeed=...)``);
this module holds what the Trainer does not do for us:

- :func:`deepspeed_config`: the config dict (batch sizes, lr, clipping left ``"auto"``).
- :func:`deepspeed_process`: a context for one DeepSpeed run in this process. Without a launcher
  it sets up a 1-process rendezvous (DeepSpeed would otherwise look for MPI); afterwards it undoes
  what the run left behind (``ACCELERATE_USE_DEEPSPEED`` and the rank variables in the environment,
  transformers' global DeepSpeed config, the 1-process group) so later stages in the same process
  (``stage=all``) and library users get plain ``from_pretrained`` / ``Trainer`` behaviour back.
  On a CPU it also keeps DeepSpeed from compiling an op training never calls
  (:func:`skip_inference_shm_op`).
- :func:`partitioned_loading`: under ZeRO-3 a backbone that trains is built partitioned as it loads
  (``deepspeed.zero.Init``): no rank holds it whole; :func:`gathered` and :func:`whole_numel` read
  such a partition whole, :func:`cast_unpartitioned` casts what joins it as the engine would.
- :func:`register_gathered`: ZeRO-3 must gather weights a module reads directly (the fused loss
  reads each head's projection weight, Medusa-2's LM loss reads ``lm_head``'s).
- :func:`master_weights`: under bf16/fp16 the module trains in that precision and DeepSpeed's optimizer
  holds the fp32 master weights; what is published comes from those (:func:`load_masters`, or the
  ZeRO-3 gathering), in each parameter's own dtype.
- :func:`gather_zero3`: ZeRO-3 leaves the trained module partitioned; rank 0 gets it whole.
- :func:`check_checkpoint_ranks`: a DeepSpeed checkpoint resumes only on as many ranks as wrote it.
- :func:`release_engine`: destroy a finished run's engine, so nothing of it outlives the stage.

Nothing here reads the Hydra config; ranks come from :mod:`medusa_train.dist`.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

from medusa_train import dist, launch
from medusa_train.errors import UserError
from medusa_train.heads import MedusaHeads

PROCESS_ENV = ("ACCELERATE_USE_DEEPSPEED", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Environment variables a DeepSpeed run sets (restored by :func:`deepspeed_process`)."""


def deepspeed_config(
    zero_stage: int,
    *,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    dtype: torch.dtype = torch.float32,
    on_cpu: bool = True,
) -> dict:
    """The DeepSpeed config dict handed to ``TrainingArguments(deepspeed=...)``.

    Batch sizes, lr, clipping are ``"auto"`` (filled from the TrainingArguments). Mixed precision is
    bf16/fp16 per the model dtype on GPU; fp32 on CPU.

    Raises:
        UserError: deepspeed is not importable, or offload is asked for on CPU.
    """
    try:
        import deepspeed  # noqa: F401
    except Exception as err:  # ImportError, or a broken build failing at import time
        raise UserError(
            f"deepspeed={'zero' + str(zero_stage)} needs the deepspeed package ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}): pip install deepspeed, or use deepspeed=none"
        ) from None
    if on_cpu and (offload_optimizer or offload_param):
        raise UserError(
            "deepspeed.offload_optimizer/offload_param move state from GPU to CPU memory and cannot run on a "
            "CPU-only machine: set them to false"
        )
    zero: dict = {"stage": zero_stage}
    if zero_stage >= 1:
        zero.update({"overlap_comm": False, "contiguous_gradients": True})
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    config: dict = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if offload_optimizer:
        # The optimizer is the Trainer's (its parameter groups carry Medusa-2's learning rates), not
        # DeepSpeed's CPU Adam, which DeepSpeed otherwise demands with an offloaded optimizer (it
        # raises at initialisation).
        config["zero_force_ds_cpu_optimizer"] = False
    if not on_cpu and dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    elif not on_cpu and dtype == torch.float16:
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return config


def is_zero3(ds_config: dict | None) -> bool:
    """Whether ``ds_config`` (None: no DeepSpeed) partitions the parameters (ZeRO stage 3)."""
    return ds_config is not None and ds_config["zero_optimization"]["stage"] == 3


@contextlib.contextmanager
def deepspeed_process(enabled: bool) -> Iterator[None]:
    """One DeepSpeed run in this process (no-op when not ``enabled``); see the module docstring."""
    if not enabled:
        yield
        return
    saved = {key: os.environ.get(key) for key in PROCESS_ENV}
    skip_inference_shm_op()
    own_group = not launch.launched()
    if own_group:
        _single_process_rendezvous()
    try:
        yield
    finally:
        _release(saved, own_group)


SHM_OP = "deepspeed_shm_comm"
"""DeepSpeed's shared-memory all-reduce for its CPU accelerator (deepspeed ``ops/op_builder/cpu/comm.py``)."""


def skip_inference_shm_op() -> None:
    """On DeepSpeed's CPU accelerator, mark :data:`SHM_OP` as not buildable here, so that starting the
    process group does not compile it.

    DeepSpeed's torch communication backend builds that C++ op (JIT, on first use per machine) when it
    starts, for ``inference_all_reduce`` alone: tensor-parallel inference. Training reduces through
    ``torch.distributed`` (gloo on a CPU) and never calls it. Building it took 28 s of a 2-core CI
    machine's first DeepSpeed run and needs a C++ compiler, which a laptop user may not have.
    ``build_shm_op`` (deepspeed ``comm/torch.py``) skips the op when its entry in
    ``deepspeed.ops.__compatible_ops__`` is false; that dict is computed once per process and kept, so
    the entry set here holds for the process. No-op on a GPU accelerator (no such op there)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__[SHM_OP] = False


def _single_process_rendezvous() -> None:
    """Environment of a 1-process group, so DeepSpeed starts without a launcher."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(port))


def _release(saved_env: dict[str, str | None], own_group: bool) -> None:
    """Undo the process-wide state a DeepSpeed run leaves (see the module docstring)."""
    unset_hf_deepspeed_config()
    for key, value in saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if own_group:
        import deepspeed.comm

        AcceleratorState._reset_state(reset_partial_state=True)
        if deepspeed.comm.is_initialized():
            # DeepSpeed's own teardown: it also forgets the groups it derived from this one, which a
            # second DeepSpeed run in this process would otherwise use ("group is not registered").
            deepspeed.comm.destroy_process_group()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@contextlib.contextmanager
def partitioned_loading(
    ds_config: dict, micro_batch_size: int, accumulation_steps: int, device: torch.device
) -> Iterator[None]:
    """ZeRO-3: ``from_pretrained`` inside builds the model under ``deepspeed.zero.Init``, each parameter
    partitioned across the ranks as it is created and filled from the checkpoint one module at a
    time, so no rank holds the whole model (loaded first and partitioned by the engine, every rank
    would hold it whole: a backbone that does not fit one device could not train).

    Inside a :func:`deepspeed_process`. transformers builds under ``zero.Init`` while a
    ``HfDeepSpeedConfig`` is alive (the Trainer's own, from ``TrainingArguments(deepspeed=...)``,
    exists only later); its parser demands the batch sizes the Trainer fills in for ``"auto"``,
    filled here the same way. The process group is started here as the Trainer would start it (its
    timeout :data:`dist.COLLECTIVE_TIMEOUT`, this rank's GPU current), not by ``zero.Init`` with
    DeepSpeed's defaults. A quantized model is loaded whole by transformers whatever this says.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    config = {key: value for key, value in ds_config.items() if value != "auto"}
    config.update(
        train_micro_batch_size_per_gpu=micro_batch_size,
        gradient_accumulation_steps=accumulation_steps,
        train_batch_size=micro_batch_size * accumulation_steps * launch.world_size(),
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(
        get_accelerator().communication_backend_name(),
        auto_mpi_discovery=False,
        timeout=dist.COLLECTIVE_TIMEOUT,
    )
    hf_config = HfDeepSpeedConfig(config)  # transformers holds a weak reference: kept alive here
    try:
        yield
    finally:
        del hf_config
        unset_hf_deepspeed_config()


def cast_unpartitioned(module: torch.nn.Module, ds_config: dict) -> None:
    """The parameters of ``module`` that are no ZeRO-3 partitions, in ``ds_config``'s bf16/fp16 (under
    fp32, and when no parameter is partitioned, nothing changes).

    DeepSpeed casts the module it is handed to that precision only when none of its parameters is
    partitioned yet; one holding a backbone loaded partitioned (:func:`partitioned_loading`, already
    in that precision) it takes as it is, so the parameters made since (the heads, LoRA adapters:
    fp32) would stay fp32 beside 16-bit ones, which ZeRO-3's optimizer refuses (an AssertionError:
    it packs them into one 16-bit buffer). Cast here as the engine casts a whole module; take
    :func:`own_dtypes` first.
    """
    precisions = {"bf16": torch.bfloat16, "fp16": torch.float16}
    dtype = next((d for key, d in precisions.items() if ds_config.get(key, {}).get("enabled")), None)
    params = list(module.parameters())
    if dtype is None or not any(is_partition(p) for p in params):
        return
    for param in params:
        if not is_partition(param) and param.is_floating_point():
            param.data = param.data.to(dtype)


def is_partition(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is a ZeRO-3 parameter (``ds_id``: DeepSpeed's mark of one)."""
    return hasattr(param, "ds_id")


def gathered(param: torch.nn.Parameter) -> contextlib.AbstractContextManager:
    """``param`` whole inside, on every rank (read-only): a ZeRO-3 partition is gathered (a
    collective), any other parameter is as it is."""
    if not is_partition(param):
        return contextlib.nullcontext()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    return GatheredParameters(param)


def whole_numel(param: torch.nn.Parameter) -> int:
    """How many elements ``param`` has whole (a ZeRO-3 partition's own ``numel()`` is 0)."""
    return getattr(param, "ds_numel", param.numel())


OPTIMIZER_STATE_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt")
"""One rank's part of ZeRO's optimizer state in a DeepSpeed checkpoint (``global_stepN/``), by its
data-parallel rank (deepspeed ``runtime/engine.py: _get_zero_ckpt_name``)."""

MODULE_STATE_SHARD = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt")
"""One rank's part of the module's parameters in a ZeRO-3 checkpoint (``global_stepN/``), by its
data-parallel rank (deepspeed ``runtime/engine.py: _get_ckpt_name``; ZeRO-1/2 write the module
whole, ``mp_rank_00_model_states.pt``, once)."""


def check_checkpoint_ranks(checkpoint: Path) -> None:
    """Refuse to resume the Trainer checkpoint ``checkpoint`` of a DeepSpeed run written by another
    number of ranks than this launch has (:func:`launch.world_size`); nothing for a checkpoint
    without DeepSpeed's files.

    ZeRO (every stage) saves its optimizer state partitioned, one file per rank (ZeRO-3 the module's
    parameters too), and DeepSpeed loads it only on as many ranks: on another count it stops deep
    in the Trainer's resume ("Automatic adjustment of ZeRO's optimizer state partitioning with a new
    world size is not currently supported"). DeepSpeed's universal checkpoints, converted offline,
    would load on any count, but the Trainer does not resume them.

    Raises:
        UserError: another number of ranks wrote it; says what resumes it.
    """
    ranks = {
        match.group(1)
        for path in checkpoint.glob("global_step*/*.pt")
        if (match := OPTIMIZER_STATE_FILE.fullmatch(path.name))
    }
    here = launch.world_size()
    if ranks and len(ranks) != here:
        raise UserError(
            f"{checkpoint} was written by {len(ranks)} DeepSpeed rank(s) and this launch has {here}: ZeRO "
            f"resumes its partitioned optimizer state only on as many; run with {len(ranks)} process(es) "
            "to resume it, or pass training.overwrite=true to start again"
        )


LINKED_PARAM_ATTRS = (
    "_hp_mapping",
    "_dp_group",
    "_index_in_param_group",
    "get_full_hp_param",
    "get_full_hp_grad",
    "set_full_hp_param",
    "set_full_hp_grad",
)
"""What ZeRO-1/2 sets on each trained parameter (deepspeed ``utils/mixed_precision_linkage.py``): its
fp32 master fragment and optimizer state, the process group, methods bound to the parameter."""


def release_engine(trainer, zero3: bool) -> None:
    """Destroy the DeepSpeed engine of ``trainer``'s finished run, and what of it the trained
    parameters and DeepSpeed's module-level objects still hold.

    Without this the engine, the optimizer state and the process group (its gloo threads) outlive
    the stage: in ``stage=all`` that memory would stay held through export and eval, and a process
    exiting under live gloo threads can abort after its work is done. Three holders (found with gc
    referrers on deepspeed 0.19.8):

    - the engine's hooks: accelerate's ``free_memory`` destroys the engine;
    - ZeRO-1/2: each trained parameter keeps :data:`LINKED_PARAM_ATTRS` (the master fragment and
      optimizer state, ``_dp_group``, methods bound to the parameter: a reference cycle a gc pass
      only breaks once the heads are dropped); removed here, the heads live on as plain parameters;
    - ZeRO-3: the stack of modules in forward (``parameter_offload.FWD_MODULE_STACK``, one entry left
      after the last forward) and a class-level ``functools.lru_cache`` on
      ``PartitionedParameterCoordinator`` keyed by the coordinator and the module
      (``__params_to_release``); both emptied, between runs, when no forward is in flight (the cache
      only memoizes: another engine still alive recomputes its entries).

    A holder missing from another DeepSpeed version is skipped, not an error."""
    module = trainer.model  # the module that trained (the engine wraps it)
    trainer.accelerator.free_memory()
    for param in module.parameters():
        for name in LINKED_PARAM_ATTRS:
            param.__dict__.pop(name, None)
    if not zero3:
        return
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack.clear()
    method = vars(PartitionedParameterCoordinator).get("_PartitionedParameterCoordinator__params_to_release")
    # the lru_cache wrapper, itself wrapped by DeepSpeed's NVTX decorator (a closure, no __wrapped__)
    for candidate in (method, *(c.cell_contents for c in getattr(method, "__closure__", None) or ())):
        if hasattr(candidate, "cache_clear"):
            candidate.cache_clear()


def register_gathered(module: torch.nn.Module, weights: Iterable[torch.nn.Parameter]) -> None:
    """ZeRO-3: gather ``weights`` whenever ``module`` runs (it reads them without calling their owner)."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    for weight in weights:
        register_external_parameter(module, weight)


def own_dtypes(module: torch.nn.Module) -> dict[str, torch.dtype]:
    """``{name: dtype}`` of the trainable parameters of ``module``, taken before DeepSpeed casts them
    (:func:`master_weights`)."""
    return {name: param.dtype for name, param in module.named_parameters() if param.requires_grad}


def master_weights(
    module: torch.nn.Module, dtypes: dict[str, torch.dtype], keep: bool
) -> dict[str, torch.Tensor]:
    """DeepSpeed's fp32 master copy of each parameter of ``module`` that its engine casts below its own
    dtype, in that dtype, by name.

    Under bf16/fp16 the engine casts the whole module to that precision (the heads and LoRA adapters,
    fp32 without DeepSpeed, too) and keeps the fp32 master weights in its optimizer: the module's
    parameters, and ZeRO-3's consolidated 16-bit state, are the masters rounded (bf16 keeps 8
    mantissa bits), the last updates' small steps lost. Parameters whose own dtype is the training
    dtype (Medusa-2's fully tuned backbone in ``model.dtype``) are those roundings without DeepSpeed
    too, and are left out; under fp32 nothing is cast and the result is empty.

    A collective (ZeRO-1/2 all-reduce each master, ZeRO-3 all-gathers its partitions): every rank
    calls it, while the engine lives (before :func:`release_engine`). Only where ``keep`` are the
    tensors kept (on the parameter's device); elsewhere one parameter at a time is held whole.

    Args:
        dtypes: :func:`own_dtypes` of ``module`` before training.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}
    for name, param in module.named_parameters():
        if name not in dtypes or param.dtype == dtypes[name]:
            continue
        full = safe_get_full_fp32_param(param)  # (shape of param) fp32, whole on every rank
        assert full is not None, f"DeepSpeed holds no master weights for the trained parameter {name}"
        if keep:
            masters[name] = full.to(dtypes[name])
    return masters


def load_masters(module: torch.nn.Module, masters: dict[str, torch.Tensor]) -> None:
    """ZeRO-1/2 (whole parameters): put :func:`master_weights` into ``module`` in place of the rounded
    parameters, in their own dtype again (called once the engine is released)."""
    params = dict(module.named_parameters())
    for name, tensor in masters.items():
        params[name].grad = None
        params[name].data = tensor


def gather_zero3(
    trainer, heads: MedusaHeads, with_backbone: bool, masters: dict[str, torch.Tensor]
) -> tuple[MedusaHeads, dict | None]:
    """ZeRO-3 leaves the training module partitioned across ranks: rebuild whole heads from the
    consolidated state and (``with_backbone``) return the backbone's part of it (its own parameter
    names). ``masters`` (:func:`master_weights`, by the training module's parameter names) replace
    their 16-bit roundings in that state. Every rank must call this (a collective); the results are
    rank 0's, the other ranks get ``(heads, None)`` back."""
    # whole tensors on rank 0 only (16-bit under bf16/fp16)
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if not trainer.is_world_process_zero():
        return heads, None
    whole = MedusaHeads(
        heads.hidden_size,
        heads.vocab_size,
        heads.num_heads,
        heads.num_layers,
        heads.base_model_name_or_path,
        head_projection=heads.head_projection,
        token_map=heads.token_map,
    )
    prefix = "module." if any(k.startswith("module.heads.") for k in state) else ""
    state.update({f"{prefix}{name}": tensor for name, tensor in masters.items()})
    whole.heads.load_state_dict(
        {
            k.removeprefix(f"{prefix}heads.heads."): v.float()
            for k, v in state.items()
            if k.startswith(f"{prefix}heads.heads.")
        }
    )
    if heads.head_projection == "shared":
        whole.bind_lm_head(heads.head_weight(0))  # the backbone's lm_head, bound as before
    backbone_state = None
    if with_backbone:
        start = f"{prefix}backbone."
        backbone_state = {k.removeprefix(start): v for k, v in state.items() if k.startswith(start)}
    return whole.to(trainer.args.device), backbone_state
