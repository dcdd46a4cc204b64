"""Compile the Triton tree-attention kernels for a GPU that is not here: ``python -m
tests.helpers.triton_compile`` (with ``TRITON_INTERPRET`` unset) compiles each variant below for Hopper
(sm_90) down to a cubin, as triton does on an H100 at the first launch, and prints one line per variant.
triton's compiler and the ptxas its wheel bundles run on a CPU; the interpreter the other kernel tests
use runs the kernels' Python, not this code generation."""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from medusa_train.decoding.attention.triton_kernel import _kernels

HOPPER = GPUTarget("cuda", 90, 32)
# (dtype, head dims of the keys and the values, keys per tile, window, chunks, sinks, softcap, split): the
# code paths the constexprs choose (a tile of more than 64 keys reads its ancestor bits per score; a head
# dim under its block masks it; values narrower than the keys: DeepSeek-V3's 192 and 128).
VARIANTS = [
    ("bf16", 128, 128, 64, False, True, True, False, True),
    ("fp16", 80, 80, 128, True, False, True, True, False),
    ("fp32", 64, 64, 32, True, True, False, True, True),
    ("bf16", 192, 128, 32, False, False, False, False, True),
]
_POINTERS = {
    "PART": "*fp32", "ML": "*fp32", "PAST": "*i32", "START": "*i32", "BITS": "*i64", "DEPTH": "*i32",
    "SINKS": "*fp32",
}  # fmt: skip


def source(fn, tensors: str, constexprs: dict) -> ASTSource:
    """``fn``'s source for the compiler: tensor arguments of dtype ``tensors`` (Q, K, V, OUT), the
    others' pointers as :data:`_POINTERS`, ``qk_scale`` and ``cap`` fp32, every other argument an int32."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "OUT"):
            signature[name] = "*" + tensors
        else:
            signature[name] = _POINTERS.get(name, "fp32" if name in ("qk_scale", "cap") else "i32")
    return ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})


def main() -> int:
    fwd, combine = _kernels()
    for dtype, d, dv, block_n, window, chunk, sinks, softcap, split in VARIANTS:
        block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
        constexprs = dict(
            D=d, BLOCK_D=block_d, DV=dv, BLOCK_DV=block_dv, BLOCK_M=64, BLOCK_N=block_n,
            HAS_WINDOW=window, HAS_CHUNK=chunk, HAS_SINKS=sinks, HAS_SOFTCAP=softcap, SPLIT=split,
            DOT_PREC="ieee" if dtype == "fp32" else "tf32", UPCAST=False,
        )  # fmt: skip
        kernel = triton.compile(source(fwd, dtype, constexprs), target=HOPPER, options={"num_stages": 2})
        kinds = f"window={window} chunk={chunk} sinks={sinks} softcap={softcap} split={split}"
        print(f"tree_attn_fwd {dtype} d{d}/{dv} n{block_n} {kinds}: {len(kernel.asm['cubin'])} bytes, "
              f"{kernel.metadata.shared} B shared")  # fmt: skip
        if split:
            constexprs = dict(D=dv, BLOCK_D=block_dv, BLOCK_M=64, HAS_SINKS=sinks)
            kernel = triton.compile(source(combine, dtype, constexprs), target=HOPPER)
            print(f"tree_attn_combine {dtype} d{dv} sinks={sinks}: {len(kernel.asm['cubin'])} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
