"""Tree attention as a CUDA C++ kernel (``tree_attention.cu`` beside this file), compiled on first use
with ``torch.utils.cpp_extension.load_inline``.

The kernel source has no torch dependency (it is compile-checked alone with ``nvcc``); the few lines of
:data:`WRAPPER` bind it to torch tensors. Same contract, math and scratch layout as the Triton kernel
(:mod:`.triton_kernel`): one block per (row, KV head, block of packed query rows, KV split), K/V tiles
staged in shared memory, fp32 online softmax in log2 units, and a combine kernel when the past is split.
fp16/bf16 with head dims in (32, 128] on sm_80+ run on the tensor cores (``nvcuda::wmma``, 64 packed
query rows and 64-key tiles per block, probabilities rounded to the input dtype before the value
product as flash attention does); fp32 and the other head dims take an fp32 kernel on the CUDA cores
(16 packed query rows per block).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
from pathlib import Path

import torch

from .triton_kernel import kv_splits, num_sms

SOURCE = Path(__file__).with_name("tree_attention.cu")
"""The kernel source (package data)."""

WRAPPER = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

torch::Tensor medusa_tree_attention(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, torch::Tensor part,
    torch::Tensor ml, torch::Tensor past, torch::Tensor start, torch::Tensor bits, torch::Tensor depth,
    double scale, int64_t window, int64_t splits) {
  const c10::cuda::CUDAGuard device_guard(q.device());  // launch on the tensors' device, its stream
  medusa_tree::Params p;
  p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr(); p.out = out.data_ptr();
  p.part = part.data_ptr<float>(); p.ml = ml.data_ptr<float>();
  p.past = past.data_ptr<int>(); p.start = start.data_ptr<int>();
  p.bits = reinterpret_cast<const long long*>(bits.data_ptr<int64_t>()); p.depth = depth.data_ptr<int>();
  p.sqb = q.stride(0); p.sqh = q.stride(1); p.sqm = q.stride(2); p.sqd = q.stride(3);
  p.skb = k.stride(0); p.skh = k.stride(1); p.skn = k.stride(2); p.skd = k.stride(3);
  p.svb = v.stride(0); p.svh = v.stride(1); p.svn = v.stride(2); p.svd = v.stride(3);
  p.num_words = bits.size(1); p.M = q.size(2); p.HKV = k.size(1); p.G = q.size(1) / k.size(1);
  p.D = q.size(3); p.window = window; p.S = splits; p.qk_scale = scale;
  int dtype = q.scalar_type() == torch::kHalf ? 1 : q.scalar_type() == torch::kBFloat16 ? 2 : 0;
  cudaError_t err = medusa_tree::tree_attention_launch(p, q.size(0), dtype, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "tree attention kernel: ", cudaGetErrorString(err));
  return out;
}
"""


def nvcc_path() -> str | None:
    """The nvcc that ``load_inline`` uses (``$CUDA_HOME/bin/nvcc``, else the one on PATH), or None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )


def cuda_available() -> str | None:
    """Why the CUDA kernel cannot be built here (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if nvcc_path() is None:
        return "nvcc is not installed (the kernel is compiled on first use)"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed (pip install ninja): torch compiles extensions with it"
    return None


@functools.cache
def _extension(capability: tuple[int, int]):
    """Compile (or load from torch's extension cache) the kernel for devices of compute ``capability``,
    once per process (a machine mixing GPU generations gets one build per generation)."""
    from torch.utils.cpp_extension import load_inline

    major, minor = capability
    arch = f"{major}{minor}" + ("a" if major >= 9 else "")
    return load_inline(
        name=f"medusa_tree_attention_sm{arch}",
        cpp_sources="torch::Tensor medusa_tree_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, "
        "torch::Tensor out, torch::Tensor part, torch::Tensor ml, torch::Tensor past, torch::Tensor start, "
        "torch::Tensor bits, torch::Tensor depth, double scale, int64_t window, int64_t splits);",
        cuda_sources=SOURCE.read_text() + WRAPPER,
        functions=["medusa_tree_attention"],
        extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
        verbose=False,
    )


def padded_head_dim(d: int) -> int:
    """The kernel's padded head dim (the row stride of its split scratch); mirrors the .cu source."""
    return 32 if d <= 32 else 64 if d <= 64 else 128 if d <= 128 else 256


def tensor_cores(dtype: torch.dtype, d: int, device: torch.device) -> bool:
    """Whether the tensor-core kernel serves this call (mirrors ``launch_d16`` in the .cu source)."""
    return (
        dtype in (torch.float16, torch.bfloat16)
        and 32 < d <= 128
        and torch.cuda.get_device_capability(device)[0] >= 8
    )


def _num_splits(programs: int, past_width: int, device: torch.device) -> int:
    """KV splits of the fp32 kernel so that about two waves of blocks fill the GPU; 1 where there is
    little past. The tensor-core kernel splits as the Triton kernel does (same rows per block)."""
    if past_width < 512:
        return 1
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= 2 * sms:
        return 1
    return max(1, min(math.ceil(2 * sms / programs), past_width // 256, 64))


def cuda_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_lens: torch.Tensor,
    starts: torch.Tensor,
    bits: torch.Tensor,
    depth: torch.Tensor,
    scale: float,
    window: int | None = None,
    num_splits: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Tree attention with the CUDA kernel; arguments and result as
    :func:`~medusa_train.decoding.attention.triton_kernel.triton_tree_attention`, without chunks,
    sinks, softcapping or values of another width than the queries (the decoders refuse this kernel
    for chunked layers a call's positions pass, :func:`~medusa_train.decoding.attention.chunk_refusal`,
    and for models with the others, :func:`~medusa_train.decoding.attention.kernel_refusal`).

    Raises:
        ValueError: a chunk, sinks or a softcap, values of another width, a head dim above 256,
            query, key and value not all fp16, bf16 or fp32 alike (the kernel reads them as the
            query's dtype, anything else as fp32), or tensors not on a CUDA device.
    """
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"the CUDA tree kernel reads values as wide as the queries ({query.shape[-1]}), got "
            f"{value.shape[-1]}: use the Triton kernel or SDPA"
        )
    if chunk is not None or sinks is not None or softcap is not None:
        raise ValueError(
            "the CUDA tree kernel applies no chunk, attention sinks or softcapping: use the Triton kernel "
            "or SDPA"
        )
    bsz, hq, m, d = query.shape
    dtypes = {query.dtype, key.dtype, value.dtype}
    if len(dtypes) > 1 or query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"the CUDA tree kernel takes fp16, bf16 or fp32 query, key and value of one dtype, got "
            f"{query.dtype}, {key.dtype} and {value.dtype}"
        )
    if d > 256 or query.device.type != "cuda":
        raise ValueError(
            f"the CUDA tree kernel takes CUDA tensors with head dim <= 256, got {d} on {query.device}"
        )
    hkv = key.shape[1]
    g = hq // hkv
    ext = _extension(torch.cuda.get_device_capability(query.device))
    out = torch.empty(bsz, m, hq, d, dtype=query.dtype, device=query.device)  # (B, M, Hq, D)
    fast = tensor_cores(query.dtype, d, query.device)
    choose = kv_splits if fast else _num_splits
    blocks = math.ceil(g * m / (64 if fast else 16)) * bsz * hkv  # rows per block: MMA_ROWS or ROWS
    splits = num_splits or choose(blocks, key.shape[2] - m, query.device)
    rows = bsz * hkv * splits * g * m if splits > 1 else 1
    part = torch.empty(rows, padded_head_dim(d), dtype=torch.float32, device=query.device)
    ml = torch.empty(rows, 2, dtype=torch.float32, device=query.device)
    ext.medusa_tree_attention(
        query, key, value, out, part, ml, past_lens, starts, bits, depth,
        scale * math.log2(math.e), window or 0, splits,
    )  # fmt: skip
    return out.transpose(1, 2)  # (B, Hq, M, D)
