"""The per-layer rules of book-keeping clipping (``fedpose.shared.privacy.step.bookkeeping``): one table, ``RULES``,
from a layer's module type to the rule its per-sample gradients follow, so that a new layer type is one rule here.

A rule holds one layer's per-sample gradients from the layer's input ``a`` and the gradient of the summed loss at
its output ``g``: a linear layer, and a conv with one group as a Linear over its unfolded patches, implicitly as
``a`` and ``g``; a grouped (depthwise) conv, a layer norm and a relative-position bias table with their per-sample
gradients instantiated (they are small).

Each holder gives the per-sample squared norms, adds the clipped sum into the running sums, gives exact float64
per-sample gradients of chosen rows (for the rows that overflow float32 or need a tiny clip factor) and every
sample's gradient (for the public basis): ``Instantiated`` keeps them as such (small tensors), ``Stacked`` keeps
several of those side by side in one matrix, ``LinearLike`` keeps them implicitly as ``a`` and ``g``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedpose.shared.privacy.step.persample import zero_rows


class Instantiated:
    """Per-sample gradients held as such, {name: (b, *shape)}: small tensors (norms, biases, tables)."""

    def __init__(self, grads: dict[str, Tensor]) -> None:
        self.grads = grads

    def sq_norms(self) -> Tensor:
        return sum(torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).square_() for g in self.grads.values())

    def add_clipped(self, summed: dict[str, Tensor], factors: Tensor, keep: Tensor | None) -> None:
        for name, g in self.grads.items():
            flat = g.reshape(g.shape[0], -1)
            if keep is not None:
                flat = zero_rows(flat, keep)
            summed[name].add_((factors.to(flat.dtype) @ flat).view_as(summed[name]))

    def exact(self, rows: Tensor) -> dict[str, Tensor]:
        return {name: g[rows].to(torch.float64) for name, g in self.grads.items()}

    def per_sample(self) -> dict[str, Tensor]:
        return self.grads


class Stacked:
    """Several ``Instantiated`` rules side by side in one (b, P) matrix: one norm and one product for all of their
    tensors (layer norms, depthwise convs, bias tables, biases) instead of a few small operations per tensor,
    which is what a small model's private step spent most of its book-keeping time on."""

    def __init__(self, parts: list[Instantiated]) -> None:
        grads = {name: g for part in parts for name, g in part.grads.items()}
        self.shapes = {name: g.shape[1:] for name, g in grads.items()}
        b = next(iter(grads.values())).shape[0]
        self.matrix = torch.cat([g.reshape(b, -1) for g in grads.values()], dim=1)  # (b, P)
        self.sizes = [math.prod(shape) for shape in self.shapes.values()]

    def _split(self, rows: Tensor) -> dict[str, Tensor]:
        return {name: part.reshape(rows.shape[0], *shape)
                for (name, shape), part in zip(self.shapes.items(), rows.split(self.sizes, dim=1))}

    def sq_norms(self) -> Tensor:
        return torch.linalg.vector_norm(self.matrix, dim=1).square_()

    def add_clipped(self, summed: dict[str, Tensor], factors: Tensor, keep: Tensor | None) -> None:
        matrix = self.matrix
        if keep is not None:
            matrix = zero_rows(matrix, keep)
        total = factors.to(matrix.dtype) @ matrix  # (P,)
        parts = total.split(self.sizes)
        torch._foreach_add_([summed[name] for name in self.shapes],
                            [part.view(summed[name].shape) for name, part in zip(self.shapes, parts)])

    def exact(self, rows: Tensor) -> dict[str, Tensor]:
        return self._split(self.matrix[rows].to(torch.float64))

    def per_sample(self) -> dict[str, Tensor]:
        return self._split(self.matrix)


def stack_instantiated(rules: list) -> list:
    """``rules`` with every ``Instantiated`` of one dtype merged into one ``Stacked`` (the others as they are)."""
    singles = [rule for rule in rules if isinstance(rule, Instantiated) and rule.grads]
    dtypes = {g.dtype for rule in singles for g in rule.grads.values()}
    if len(singles) < 2 or len(dtypes) != 1:
        return rules
    return [rule for rule in rules if not (isinstance(rule, Instantiated) and rule.grads)] + [Stacked(singles)]


class LinearLike:
    """A (b, T, d) and g (b, T, p): weight gradient g_i^T a_i (p, d), bias gradient sum_t g_it (p,)."""

    def __init__(self, a: Tensor, g: Tensor, names: dict[str, str], shapes: dict[str, torch.Size]) -> None:
        self.a, self.g, self.names, self.shapes = a, g, names, shapes
        b, t, d = a.shape
        p = g.shape[2]
        # ghost: two T x T Gram matrices per sample, b T^2 (d + p); instantiated: b T d p
        self.ghost = "weight" in names and t * (d + p) < d * p
        self.weight = None if self.ghost or "weight" not in names else torch.bmm(g.transpose(1, 2), a)  # (b, p, d)
        # the bias's per-sample gradients only when they are needed as such (the ghost norm and sum fold it in)
        self.bias = g.sum(1) if "bias" in names and not self.ghost else None  # (b, p)

    def sq_norms(self) -> Tensor:
        """(b,) squared norms in the layer's dtype (the tape adds them up and redoes rows that overflow)."""
        if self.ghost:
            # ||g_i^T [a_i 1]||^2 = sum_ts (a_it . a_is + 1)(g_it . g_is): the bias is a weight on a constant 1
            gram_a = torch.bmm(self.a, self.a.transpose(1, 2))
            if "bias" in self.names:
                gram_a.add_(1.0)
            gram_g = torch.bmm(self.g, self.g.transpose(1, 2))
            return gram_a.mul_(gram_g).sum((1, 2))
        total = None
        for part in (self.weight, self.bias):
            if part is not None:
                sq = torch.linalg.vector_norm(part.reshape(part.shape[0], -1), dim=1).square_()
                total = sq if total is None else total.add_(sq)
        if total is None:
            raise RuntimeError(f"no weight or bias to take the norm of in {sorted(self.names)}")
        return total

    def add_clipped(self, summed: dict[str, Tensor], factors: Tensor, keep: Tensor | None) -> None:
        a, g, weight, bias = self.a, self.g, self.weight, self.bias
        if keep is not None:  # rows left out: zero them first, 0 x NaN is NaN
            a, g = zero_rows(a, keep), zero_rows(g, keep)
            weight = None if weight is None else zero_rows(weight, keep)
            bias = None if bias is None else zero_rows(bias, keep)
        f = factors.to(a.dtype)
        if self.ghost:
            # sum_i f_i g_i^T a_i as one (p, b T) x (b T, d) product, the factors on the side that is cheaper to
            # scale: the scaled copy is contiguous, so a permuted side (a conv's patches) is copied only once
            p, d = g.shape[2], a.shape[2]
            cost_g = g.numel() + (0 if a.is_contiguous() else a.numel())
            cost_a = a.numel() + (0 if g.is_contiguous() else g.numel())
            col = f[:, None, None]
            left, right = ((g * col).reshape(-1, p), a.reshape(-1, d)) if cost_g <= cost_a else \
                (g.reshape(-1, p), (a * col).reshape(-1, d))
            name = self.names["weight"]
            summed[name].add_((left.t() @ right).reshape(self.shapes[name]))
            if "bias" in self.names:
                name = self.names["bias"]
                total = left.sum(0) if cost_g <= cost_a else f @ g.sum(1)
                summed[name].add_(total.reshape(self.shapes[name]))
            return
        if weight is not None:
            name = self.names["weight"]
            summed[name].add_((f @ weight.reshape(weight.shape[0], -1)).reshape(self.shapes[name]))
        if bias is not None:
            name = self.names["bias"]
            summed[name].add_((f @ bias).reshape(self.shapes[name]))

    def exact(self, rows: Tensor) -> dict[str, Tensor]:
        a, g = self.a[rows].to(torch.float64), self.g[rows].to(torch.float64)
        out = {}
        if "weight" in self.names:
            name = self.names["weight"]
            out[name] = torch.bmm(g.transpose(1, 2), a).reshape(len(rows), *self.shapes[name])
        if "bias" in self.names:
            out[self.names["bias"]] = g.sum(1)
        return out

    def per_sample(self) -> dict[str, Tensor]:
        b = self.a.shape[0]
        out = {}
        if "weight" in self.names:
            name = self.names["weight"]
            weight = self.weight if self.weight is not None else torch.bmm(self.g.transpose(1, 2), self.a)
            out[name] = weight.reshape(b, *self.shapes[name])
        if "bias" in self.names:
            out[self.names["bias"]] = self.bias if self.bias is not None else self.g.sum(1)
        return out


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
    if not isinstance(index, Tensor):  # _holds_bias_table checked it; this narrows nn.Module's attribute type
        raise TypeError(f"bias_index of {type(module).__name__} is not a tensor")
    table.index_add_(2, index.reshape(-1).to(g.device), per_pair)
    return Instantiated({name: table})


def _padding(module: nn.Conv2d) -> tuple[int, ...]:
    """The conv's padding in pixels (a padding given by name, 'same' or 'valid', is not unfolded here)."""
    if isinstance(module.padding, str):
        raise ValueError(f"conv padding {module.padding!r}: book-keeping needs the padding in pixels")
    return module.padding


def _unfold(module: nn.Conv2d, x: Tensor) -> Tensor:
    """(b, C_in, H, W) -> (b, C_in kh kw, T) patches in the weight's (c, i, j) order."""
    if module.kernel_size == (1, 1) and module.stride == (1, 1) and module.padding == (0, 0):
        return x.reshape(x.shape[0], x.shape[1], -1)
    return F.unfold(x, module.kernel_size, dilation=module.dilation, padding=_padding(module), stride=module.stride)


def conv_rule(module: nn.Conv2d, x: Tensor, g: Tensor, names, shapes) -> LinearLike:
    b, cout = g.shape[:2]
    return LinearLike(_unfold(module, x).transpose(1, 2), g.reshape(b, cout, -1).transpose(1, 2), names, shapes)


def depthwise_weight(module: nn.Conv2d, x: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradient (b, C, kh, kw) of a depthwise conv, as one grouped convolution over the b C
    channels: sample i's gradient for channel c correlates its padded input with the output gradient ``g``
    used as a kernel, dilated by the conv's stride and strided by its dilation. No unfolded copy of the input
    (kh kw times its size) and no tap-by-tap loop: 3-4x faster than either on a pose model's maps."""
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = module.kernel_size, module.stride, module.dilation, _padding(module)
    b, c, h, w = g.shape
    xp = F.pad(x, (pw, pw, ph, ph)).reshape(1, b * c, x.shape[2] + 2 * ph, x.shape[3] + 2 * pw)
    out = F.conv2d(xp, g.reshape(b * c, 1, h, w), stride=(dh, dw), dilation=(sh, sw), groups=b * c)
    return out[0, :, :kh, :kw].reshape(b, c, kh, kw)


def grouped_conv_rule(module: nn.Conv2d, x: Tensor, g: Tensor, names, shapes) -> Instantiated:
    b, cout = g.shape[:2]
    groups = module.groups
    grads = {}
    if "weight" in names and groups == module.in_channels == cout and isinstance(module.padding, tuple):
        grads[names["weight"]] = depthwise_weight(module, x, g).reshape(b, *shapes[names["weight"]])
    elif "weight" in names:
        cols = _unfold(module, x)  # (b, C_in kh kw, T)
        cols = cols.reshape(b, groups, cols.shape[1] // groups, cols.shape[2])  # (b, G, d, T)
        out = g.reshape(b, groups, cout // groups, -1)  # (b, G, p, T)
        grads[names["weight"]] = torch.einsum("bgpt,bgdt->bgpd", out, cols).reshape(b, *shapes[names["weight"]])
    if "bias" in names:
        grads[names["bias"]] = g.reshape(b, cout, -1).sum(2)
    return Instantiated(grads)


@dataclass(frozen=True)
class LayerRule:
    """How the per-sample gradients of one kind of layer are held.

    ``covers(module, attr)``: whether the rule takes the module's parameter ``attr``. ``hold(module, x, g, names,
    shapes)``: the holder from the layer's input ``x`` (not passed when ``takes_input`` is False) and the gradient
    ``g`` of the summed loss at the output of ``tap(module)`` (the layer itself unless ``tap`` says otherwise).
    """

    name: str
    covers: Callable[[Any, str], bool]
    hold: Callable[..., Instantiated | LinearLike]
    takes_input: bool = True
    tap: Callable[[nn.Module], nn.Module] | None = None

    def tapped(self, module: nn.Module) -> nn.Module:
        """The module whose forward the book-keeping hook records for this layer."""
        return module if self.tap is None else self.tap(module)


_WEIGHTS = ("weight", "bias")


def _holds_bias_table(module: nn.Module, attr: str) -> bool:
    """A relative-position bias table: ``attention_biases`` read through ``bias_index`` (N, N), the biased
    attention logits passing through the tap module ``logits``."""
    return attr == "attention_biases" and isinstance(getattr(module, "logits", None), nn.Module) \
        and isinstance(getattr(module, "bias_index", None), Tensor)


def _logits(module: nn.Module) -> nn.Module:
    return cast(nn.Module, module.logits)  # _holds_bias_table checked it is a module


# Module type -> its rules, tried in this order (a subclass takes its base's rules; nn.Module: any module).
RULES: dict[type[nn.Module], tuple[LayerRule, ...]] = {
    nn.Linear: (LayerRule("linear", lambda m, attr: attr in _WEIGHTS, _linear),),
    nn.Conv2d: (
        LayerRule("conv", lambda m, attr: attr in _WEIGHTS and m.padding_mode == "zeros" and m.groups == 1,
                  conv_rule),
        LayerRule("grouped_conv", lambda m, attr: attr in _WEIGHTS and m.padding_mode == "zeros" and m.groups != 1,
                  grouped_conv_rule),
    ),
    nn.LayerNorm: (LayerRule("layer_norm", lambda m, attr: attr in _WEIGHTS and len(m.normalized_shape) == 1,
                             _layer_norm),),
    nn.Module: (LayerRule("bias_table", _holds_bias_table, bias_table, takes_input=False, tap=_logits),),
}


def rule_of(module: nn.Module, attr: str) -> LayerRule | None:
    """The rule that covers the parameter ``attr`` of ``module``; None: book-keeping does not cover it."""
    for kind, rules in RULES.items():
        if isinstance(module, kind):
            for rule in rules:
                if rule.covers(module, attr):
                    return rule
    return None


def holder_for(entry: tuple[nn.Module, LayerRule, dict[str, str]], seen: tuple[Tensor | None, Tensor],
               grad: Tensor | None, shapes: dict[str, torch.Size]) -> Instantiated | LinearLike:
    """The per-sample gradients of one layer from its input, its output and the loss's gradient there."""
    module, rule, names = entry
    x, out = seen
    grad = torch.zeros_like(out) if grad is None else grad.detach()
    if not rule.takes_input:
        return rule.hold(module, grad, dict(names), shapes)
    if x is None:  # a layer called with keyword arguments only: its input was not seen
        raise RuntimeError(f"a {rule.name} layer ran without a positional input; book-keeping needs it")
    return rule.hold(module, x.detach(), grad, dict(names), shapes)
