"""Our model calls pass the KV cache under the name the installed transformers declares, and none of them
makes transformers warn (a deprecation warning today is a broken decoder at the release that removes it)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import transformers as tf

from medusa_train.decoding import (
    StaticDecoder,
    measure_forward_latency,
    medusa_generate,
    medusa_generate_batch,
    verify_forward,
)
from medusa_train.decoding.tree import TreeBuffers
from medusa_train.engines.base import GenRequest
from medusa_train.engines.inprocess import ContinuousBatcher
from medusa_train.hf_compat import NEW_NAME, OLD_NAME, cache_keyword
from tests.helpers.models import ARCHS, random_heads, random_tree, tiny_model


def _transformers_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """Future/Deprecation warnings raised from transformers' code (ours would be just as bad, but the
    rename's warnings come from transformers' decorators)."""
    return [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, (FutureWarning, DeprecationWarning))
        and (
            "transformers" in w.filename
            or "medusa_train" in w.filename
            or "past_key_values" in str(w.message)
        )
    ]


def test_the_keyword_is_the_one_the_forward_declares():
    model = tiny_model("llama")
    params = inspect.signature(type(model).forward).parameters
    expected = NEW_NAME if NEW_NAME in params else OLD_NAME
    assert expected in params
    assert cache_keyword(model) == expected


def test_a_forward_declaring_both_names_gets_the_installed_library_s():
    """A forward written for either release (taking both names and handing its cache on to transformers'
    forward) gets the name transformers' own forwards take: the other one would reach a forward that
    drops it into ``**kwargs`` and runs without a cache."""

    class Both(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, cache=None):
            raise NotImplementedError

    library = inspect.signature(tf.LlamaForCausalLM.forward).parameters
    assert cache_keyword(Both()) == (NEW_NAME if NEW_NAME in library else OLD_NAME)


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_calls_emit_no_deprecation_warning(arch):
    model = tiny_model(arch)
    heads = random_heads(model, seed=1)
    tree = random_tree(3, nodes=12, max_depth=4)
    prompts = [[1, 5, 9, 13], [2, 7, 11]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        medusa_generate(model, heads, torch.tensor([prompts[0]]), max_new_tokens=8, tree=tree)
        medusa_generate(
            model, heads, torch.tensor([prompts[0]]), max_new_tokens=8, tree=tree, acceptance="typical",
            temperature=0.7,
        )  # fmt: skip
        medusa_generate_batch(model, heads, prompts, max_new_tokens=8, tree=tree)
        StaticDecoder(model, heads, tree, 32, batch_size=2).generate_batch(
            [torch.tensor(p) for p in prompts], max_new_tokens=8
        )
        cache = tf.DynamicCache()
        with torch.inference_mode():
            model(input_ids=torch.tensor([prompts[0]]), use_cache=True, **{cache_keyword(model): cache})
            buffers = TreeBuffers.from_choices(tree)
            verify_forward(model, cache, torch.arange(buffers.num_nodes), buffers, len(prompts[0]))
        measure_forward_latency(model, [1, 4], context_len=8, warmup=0, repeats=1)
    assert _transformers_warnings(caught) == []


def test_distill_engine_emits_no_deprecation_warning():
    model = tiny_model("llama", layers=1, vocab=64)
    replies = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batcher = ContinuousBatcher(model, batch_size=4, pad_id=0, eos_ids=[], max_new_tokens=5)
        batcher.run(
            [GenRequest(i, [5 + i, 9, 11][: 1 + i % 3]) for i in range(6)],
            lambda r, new: replies.__setitem__(r.key, new),
        )
    assert len(replies) == 6
    assert _transformers_warnings(caught) == []
