"""Every mask our decoders hand to the model is contiguous and starts on an aligned address.

On a GPU, attention kernels read masks with vector loads: a view cropped out of a larger buffer at an
arbitrary column faulted inside cuDNN's SDPA (``misaligned address``). The CPU does not fault, so these
tests check the layout itself, on every forward of every decoder.
"""

from __future__ import annotations

import pytest
import torch

from medusa_train.decoding import MEDUSA_63, medusa_generate, medusa_generate_batch
from medusa_train.decoding.batched import _bucket
from medusa_train.decoding.generate import ALIGN_BYTES, aligned
from medusa_train.decoding.tree import chain_tree
from tests.helpers.models import random_heads, random_tree, tiny_model


def _layout_problems(mask) -> list[str]:
    masks = mask.values() if isinstance(mask, dict) else [mask]
    problems = []
    for m in masks:
        if m is None:
            continue
        if not m.is_contiguous():
            problems.append(f"non-contiguous mask {tuple(m.shape)} strides {m.stride()}")
        if m.data_ptr() % ALIGN_BYTES:
            problems.append(
                f"mask {tuple(m.shape)} at address {m.data_ptr():#x} (offset {m.storage_offset()})"
            )
    return problems


class MaskRecorder:
    """A forward pre-hook that records the layout problems of every attention mask the model receives."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self.problems: list[str] = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and (isinstance(mask, dict) or mask.ndim == 4):
            self.calls += 1
            self.problems += _layout_problems(mask)

    def __enter__(self) -> MaskRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def test_aligned_copies_exactly_the_views_that_need_it():
    slab = torch.randn(1, 1, 3, 40)
    full = slab.narrow(3, 0, 40)
    assert aligned(full) is full
    one_row = slab[:, :, :1].narrow(3, 3, 20)  # contiguous, but starts 12 bytes into the slab
    assert one_row.is_contiguous() and one_row.data_ptr() % ALIGN_BYTES
    fixed = aligned(one_row)
    assert fixed.data_ptr() % ALIGN_BYTES == 0 and torch.equal(fixed, one_row)  # a copy: the same values
    cropped = slab.narrow(3, 5, 30)  # rows strided by 40
    assert not cropped.is_contiguous() and _layout_problems(aligned(cropped)) == []


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: one mask per layer type (sliding window)
@pytest.mark.parametrize(
    "tree",
    [chain_tree(1), chain_tree(4), MEDUSA_63, random_tree(5, nodes=17)],
    ids=["1", "chain4", "63", "rand"],
)
def test_batch1_decoder_hands_over_aligned_masks(arch, tree):
    model = tiny_model(arch)
    heads = random_heads(model, seed=2)
    with MaskRecorder(model) as rec:
        for prompt_len, budget in [(3, 17), (7, 9), (11, 5)]:  # the tree is cut near each budget's end
            ids = torch.arange(1, 1 + prompt_len)[None]
            medusa_generate(model, heads, ids, max_new_tokens=budget, tree=tree)
    assert rec.calls > 3
    assert rec.problems == []


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_batched_decoder_hands_over_aligned_masks(arch):
    model = tiny_model(arch)
    heads = random_heads(model, seed=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    with MaskRecorder(model) as rec:
        medusa_generate_batch(model, heads, prompts, max_new_tokens=12, tree=MEDUSA_63)
    assert rec.calls > 3
    assert rec.problems == []


def test_width_buckets_round_up():
    assert [_bucket(w, 64) for w in (1, 64, 65, 128)] == [64, 64, 128, 128]
    assert [_bucket(w, 1) for w in (1, 7)] == [1, 7]
