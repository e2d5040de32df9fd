"""Whether the tensors a step is given are the model's own trainable weights: then a plain forward of the model
builds the graph the step needs, with no functional swap of every tensor (``persample.mean_grad``,
``bookkeeping``)."""

from __future__ import annotations

import weakref
from collections.abc import Mapping

from torch import Tensor, nn


_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def own_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``dict(model.named_parameters())``, kept per model and checked by identity on every call: every private
    step asks it, and walking a pose model's modules costs about 1% of a small model's step. A parameter
    replaced by another object is seen and the walk done again."""
    slots = _SLOTS.get(model)
    if slots is None or any(module._parameters.get(attr) is not param for _, module, attr, param in slots):
        slots, seen = [], set()
        for prefix, module in model.named_modules():
            for attr, param in module._parameters.items():
                if param is not None and id(param) not in seen:  # shared weights: the first name, as torch does
                    seen.add(id(param))
                    slots.append((f"{prefix}.{attr}" if prefix else attr, module, attr, param))
        _SLOTS[model] = slots
    return {name: param for name, _, _, param in slots}


def are_the_models_own(model: nn.Module, params: Mapping[str, Tensor], combine_names: list[str]) -> bool:
    """True when ``params`` hold the model's trainable weights themselves and nothing else in it trains.

    Then a plain forward builds the same graph as one through ``params`` (only the gradients at the
    layers' outputs are asked for, never the weights'), without swapping every tensor of the model.
    ``combine_names``: parameters the loss uses after the model, which may be given as copies.
    """
    own = own_parameters(model)
    for name, param in own.items():
        value = params.get(name)
        if value is None:
            if param.requires_grad:
                return False
        elif name not in combine_names and (
            not param.requires_grad or value.data_ptr() != param.data_ptr() or value.shape != param.shape
            or value.stride() != param.stride() or value.dtype != param.dtype
        ):
            return False
    return all(name in own for name in params)
