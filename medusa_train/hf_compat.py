"""The model-call arguments (and ``generate``'s output field) whose name depends on the installed
transformers release.

transformers 5.24 renamed the cache argument of every model ``forward`` from ``past_key_values`` to
``cache`` (``@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")`` on the forwards, the
decoder layers and ``prepare_inputs_for_generation``); 5.17-5.23, which our range admits (the GPU
image has 5.17), take only ``past_key_values``. Passing the old name to a new release warns on every
call and stops working at 5.40, so our decoders ask once per model class which name its ``forward``
declares and pass the cache under that name. ``generate``'s output field was renamed with it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

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
    if NEW_NAME in params:
        return NEW_NAME
    if OLD_NAME in params:
        return OLD_NAME
    return _library_name()


def cache_keyword(model: torch.nn.Module) -> str:
    """``"cache"`` or ``"past_key_values"``: the name under which ``model``'s forward takes its KV cache.

    Decided from the forward's signature once per model class (a wrapper whose forward only takes
    ``**kwargs``, such as a PEFT model, gets the installed library's name).
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
