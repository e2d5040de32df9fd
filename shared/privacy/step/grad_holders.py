"""How a layer's per-sample gradients are held by the book-keeping rules (``layer_rules``, ``conv_rules``).

Each holder gives the per-sample squared norms, adds the clipped sum into the running sums, gives exact float64
per-sample gradients of chosen rows (for the rows that overflow float32 or need a tiny clip factor) and every
sample's gradient (for the public basis): ``Instantiated`` keeps them as such (small tensors), ``Stacked`` keeps
several of those side by side in one matrix, ``LinearLike`` keeps them implicitly as a layer's input ``a`` and
the gradient of the summed loss at its output ``g``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

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
