"""The per-layer rules of book-keeping clipping (``fedpose.shared.privacy.step.bookkeeping``) for linear layers,
layer norms and relative-position bias tables, and the rule of each layer kind (convolutions: ``conv_rules``).

A rule holds one layer's per-sample gradients (``grad_holders``) from the layer's input ``a`` and the gradient of
the summed loss at its output ``g``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedpose.shared.privacy.step.conv_rules import conv_rule, grouped_conv_rule
from fedpose.shared.privacy.step.grad_holders import Instantiated, LinearLike


def _linear(module: nn.Linear, x: Tensor, g: Tensor, names, shapes) -> LinearLike:
    b = x.shape[0]
    return LinearLike(x.reshape(b, -1, x.shape[-1]), g.reshape(b, -1, g.shape[-1]), names, shapes)


def _layer_norm(module: nn.LayerNorm, x: Tensor, g: Tensor, names, shapes) -> Instantiated:
    if getattr(module, "channels_first", False):  # LayerNorm2d: normalises the channels of NCHW
        x, g = x.movedim(1, -1), g.movedim(1, -1)
    positions = tuple(range(1, x.dim() - 1))  # summed over in place of a reshape, which copies a permuted map
    grads = {}
    if "weight" in names:  # a unit weight and zero bias: the same values, twice as fast as none on CPU
        ones, zeros = _unit_affine(module.normalized_shape, x)
        normed = F.layer_norm(x, module.normalized_shape, ones, zeros, module.eps)
        grads[names["weight"]] = normed.mul_(g).sum(positions) if positions else normed.mul_(g)
    if "bias" in names:
        grads[names["bias"]] = g.sum(positions) if positions else g  # sum(()) would sum every dimension
    return Instantiated(grads)


_UNIT_AFFINES: dict[tuple, tuple[Tensor, Tensor]] = {}


def _unit_affine(shape: tuple[int, ...], like: Tensor) -> tuple[Tensor, Tensor]:
    """Ones and zeros of a layer norm's shape, made once per shape, dtype and device (never written to)."""
    key = (tuple(shape), like.dtype, like.device)
    if key not in _UNIT_AFFINES:
        _UNIT_AFFINES[key] = (like.new_ones(shape), like.new_zeros(shape))
    return _UNIT_AFFINES[key]


def bias_table(module: nn.Module, g: Tensor, names, shapes) -> Instantiated:
    # g: (b, ..., heads, N, N) at the biased logits; the table (heads, offsets) is read through bias_index
    b = g.shape[0]
    heads, n = g.shape[-3], g.shape[-1]
    per_pair = g.reshape(b, -1, heads, n * n).sum(1)  # (b, heads, N*N)
    name = names["attention_biases"]
    table = per_pair.new_zeros((b, *shapes[name]))
    index = module.bias_index
    if not isinstance(index, Tensor):  # the plan's _rule_kind checked it; this narrows nn.Module's attribute type
        raise TypeError(f"bias_index of {type(module).__name__} is not a tensor")
    table.index_add_(2, index.reshape(-1).to(g.device), per_pair)
    return Instantiated({name: table})


RULES: dict[str, Callable[..., Instantiated | LinearLike]] = {
    "linear": _linear, "conv": conv_rule, "grouped_conv": grouped_conv_rule, "layer_norm": _layer_norm}


def rule_for(entry: tuple[nn.Module, str, dict[str, str]], seen: tuple[Tensor | None, Tensor], grad: Tensor | None,
             shapes: dict[str, torch.Size]) -> Instantiated | LinearLike:
    """The rule of one layer from its input, its output and the loss's gradient there."""
    module, kind, names = entry
    x, out = seen
    grad = torch.zeros_like(out) if grad is None else grad.detach()
    if kind == "bias_table":
        return bias_table(module, grad, dict(names), shapes)
    if x is None:  # a layer called with keyword arguments only: its input was not seen
        raise RuntimeError(f"a {kind} layer ran without a positional input; book-keeping needs it")
    return RULES[kind](module, x.detach(), grad, dict(names), shapes)
