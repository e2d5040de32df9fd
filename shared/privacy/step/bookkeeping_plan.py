"""Which losses and parameters book-keeping clipping (``bookkeeping``) covers, and its plan: the layers that own
the trainable tensors and the rule (``layer_rules``) each layer's per-sample gradients follow."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn


def _owner(model: nn.Module, name: str) -> tuple[str, nn.Module, str] | None:
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        return None
    return module_name, module, attr


def _rule_kind(module: nn.Module, attr: str) -> str | None:
    if isinstance(module, nn.Linear) and attr in ("weight", "bias"):
        return "linear"
    if isinstance(module, nn.Conv2d) and attr in ("weight", "bias") and module.padding_mode == "zeros":
        return "conv" if module.groups == 1 else "grouped_conv"
    if isinstance(module, nn.LayerNorm) and attr in ("weight", "bias") and len(module.normalized_shape) == 1:
        return "layer_norm"
    if attr == "attention_biases" and isinstance(getattr(module, "logits", None), nn.Module) \
            and isinstance(getattr(module, "bias_index", None), Tensor):
        return "bias_table"
    return None


def supports(loss_fn: Any, params: Mapping[str, Tensor]) -> bool:
    """True when ``loss_fn`` exposes its model and every tensor of ``params`` falls under a rule."""
    model = getattr(loss_fn, "model", None)
    if not isinstance(model, nn.Module) or not all(hasattr(loss_fn, a) for a in ("parts", "combine", "combine_names")):
        return False
    return cached_plan(loss_fn, tuple(params)) is not None


def cached_plan(loss_fn: Any, names: tuple[str, ...]) -> dict | None:
    """The plan for these names (None: some tensor falls under no rule), kept on the loss: it runs every step."""
    cache = loss_fn.__dict__.setdefault("_bookkeeping_plans", {})
    if names not in cache:
        layer_names = [n for n in names if n not in loss_fn.combine_names]
        found = [_owner(loss_fn.model, n) for n in layer_names]
        covered = all(f is not None and _rule_kind(f[1], f[2]) is not None for f in found)
        cache[names] = _plan(loss_fn.model, layer_names) if covered else None
    return cache[names]


def _plan(model: nn.Module, names: list[str]) -> dict[str, tuple[nn.Module, str, dict[str, str]]]:
    """module name -> (module, rule kind, {attr: parameter name}) for the layers that own ``names``."""
    plan: dict[str, tuple[nn.Module, str, dict[str, str]]] = {}
    for name in names:
        owner = _owner(model, name)
        kind = None if owner is None else _rule_kind(owner[1], owner[2])
        if owner is None or kind is None:  # supports() checked every name first
            raise ValueError(f"{name}: no book-keeping rule covers this parameter")
        module_name, module, attr = owner
        entry = plan.setdefault(module_name, (module, kind, {}))
        entry[2][attr] = name
    return plan
