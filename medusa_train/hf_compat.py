"""The model-call arguments (and ``generate``'s output field) whose name depends on the installed
transformers release, and the cache layer of a layer that keeps no KV.

transformers 5.24 renamed the cache argument of every model ``forward`` from ``past_key_values`` to
``cache`` (``@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")`` on the forwards, the
decoder layers and ``prepare_inputs_for_generation``); 5.17-5.23, which our range admits (the GPU
image has 5.17), take only ``past_key_values``. Passing the old name to a new release warns on every
call and stops working at 5.40, so our decoders ask once per model class which name its ``forward``
declares and pass the cache under that name. ``generate``'s output field was renamed with it.

A decoder layer that reads an earlier layer's KV and keeps none (Gemma 3n's and Gemma 4's last
``num_kv_shared_layers``) is named by its text config's ``kv_sharing_modes`` ("reuse") and holds a
``DummyLayer`` in transformers' caches; 5.17 has neither (its caches stop before those layers, which
never touch the cache), so :func:`kv_reusing_layers` reads ``num_kv_shared_layers`` there and
:data:`NoKVLayer` is a layer of our own that keeps nothing.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

try:
    from transformers.cache_utils import DummyLayer as NoKVLayer
except ImportError:  # transformers without DummyLayer (5.17): its models never touch such a layer

    class NoKVLayer:
        """A cache layer that keeps no KV (transformers' ``DummyLayer`` where it has one)."""

        is_compileable = True
        is_croppable = True
        is_sliding = False
        supports_early_init = False

        def __init__(self, **kwargs: Any) -> None:
            self.is_initialized = True
            self.keys = None
            self.values = None

        def get_max_length(self) -> int:
            return -1

        def offload(self) -> None: ...
        def prefetch(self) -> None: ...
        def reset(self) -> None: ...
        def crop(self, tokens_to_remove: int) -> None: ...
        def reorder_cache(self, beam_idx: torch.Tensor) -> None: ...
        def batch_repeat_interleave(self, repeats: int) -> None: ...
        def batch_select_indices(self, indices: torch.Tensor) -> None: ...


NEW_NAME = "cache"
OLD_NAME = "past_key_values"


@functools.cache
def _library_name() -> str:
    """The name transformers' own generation code takes (the answer for a forward that takes ``**kwargs``)."""
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return NEW_NAME if NEW_NAME in params else OLD_NAME


@functools.cache
def _name_for_class(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    declared = [name for name in (NEW_NAME, OLD_NAME) if name in params]
    # One name declared: that one. Both (a forward written for either release, handing its cache on to
    # transformers' own forward) or neither: the installed library's.
    return declared[0] if len(declared) == 1 else _library_name()


def cache_keyword(model: torch.nn.Module) -> str:
    """``"cache"`` or ``"past_key_values"``: the name under which ``model``'s forward takes its KV cache.

    Decided from the forward's signature once per model class (a wrapper whose forward only takes
    ``**kwargs``, such as a PEFT model, or declares both names, gets the installed library's name).
    """
    return _name_for_class(type(model))


def cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` to splat into a model call: ``model(input_ids=..., **cache_kwargs(model, c))``."""
    return {cache_keyword(model): cache}


def passed_cache(model: torch.nn.Module, kwargs: dict[str, Any]) -> Any:
    """The cache a forward hook with ``with_kwargs=True`` received, whichever name it came under."""
    return kwargs.get(cache_keyword(model), kwargs.get(OLD_NAME, kwargs.get(NEW_NAME)))


@functools.cache
def output_cache_field() -> str:
    """``"cache"`` or ``"past_key_values"``: the field of ``generate``'s output
    (``GenerateDecoderOnlyOutput``) that holds its cache in the installed transformers (renamed with the
    argument in 5.24)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return NEW_NAME if NEW_NAME in GenerateDecoderOnlyOutput.__dataclass_fields__ else OLD_NAME


def kv_reusing_layers(config: Any) -> frozenset[int]:
    """The decoder layers that keep no KV of their own under a text config: those its
    ``kv_sharing_modes`` marks "reuse", or, in a release without that property (5.17), the last
    ``num_kv_shared_layers`` (what its Gemma 3n and Gemma 4 layers read then)."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is not None:
        return frozenset(i for i, mode in enumerate(modes) if mode == "reuse")
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    return frozenset(range(config.num_hidden_layers - shared, config.num_hidden_layers))
