"""Book-keeping clipping: every per-sample norm and the clipped sum from one forward and one backward.

The generic path (``persample``) gets per-sample gradients with ``vmap(grad(...))``:
exact, but it pays a per-sample weight gradient for every trainable tensor. For the
layers a pose model is made of, the per-sample gradient is a small product of two
tensors autograd computes anyway: a layer's input ``a_i`` and the gradient of the
loss at its output ``g_i``. A Linear layer's weight gradient is ``g_i^T a_i``, so

- its squared norm is ``sum_{t,s} (a_it . a_is)(g_it . g_is)`` (the "ghost norm",
  Goodfellow 2015, Li et al. 2022): T x T Gram matrices instead of a d x p
  gradient per sample, used where that is cheaper (few tokens, wide layers);
- the clipped sum ``sum_i c_i g_i^T a_i = (c * g)^T a`` is one matmul, the cost of the
  non-private weight gradient (book-keeping, Bu et al. 2023): no second backward.

One forward with hooks on the layers that own trainable tensors records ``a``; one
``autograd.grad`` of the summed loss with respect to those layers' outputs gives every
``g`` (and skips the weight gradients a non-private backward would compute). The rules
(``layer_rules.RULES``, keyed by module type):

- ``nn.Linear`` and ``nn.Conv2d`` with groups = 1 (unfolded to a Linear over positions):
  ghost norm or per-sample product, whichever is cheaper for the layer's shape;
- grouped (depthwise) ``nn.Conv2d``, ``nn.LayerNorm`` (over the last dimension, or over
  the channels of an NCHW map for a ``LayerNorm2d`` that says so with ``channels_first``):
  per-sample gradients, which are small;
- a relative-position bias table, for a module that holds ``attention_biases``,
  ``bias_index`` (N, N) and a tap module ``logits`` through which its biased
  attention logits pass: the gradient at the logits, summed per table entry;
- parameters the loss uses after the model, in ``combine`` (task-uncertainty weights): when the
  loss says ``combine_takes_rows`` (``combine`` takes them as one copy per row, (b, *shape), each
  row's total using its own), one copy per sample, whose gradients the same backward gives;
  otherwise ``vmap(grad)`` of ``combine`` alone over the per-sample task losses.

A loss supports this path when it has ``model`` (the nn.Module), ``parts(params,
batch) -> (B, T)`` (per-sample loss parts through the model), ``combine(parts,
params) -> (B,)`` and ``combine_names`` (the parameters only ``combine`` uses), and
every trainable tensor falls under a rule (``supports``; the plan of the layers that own the
trainable tensors and each one's rule is kept on the loss, ``cached_plan``); otherwise callers use the
generic path: ``per_sample_chunks`` gives the per-sample gradients from the tape where it covers the
weights and from ``vmap`` elsewhere.
The sums are equal to the generic path's to float tolerance (tests/test_bookkeeping.py).

P14 is kept row by row exactly as the generic path keeps it: a sample whose norm is
not finite in float32 is recomputed in float64 from its own ``a_i``, ``g_i``; if it is
still not finite it contributes zero (its rows of ``a`` and ``g`` are zeroed before any
product: 0 x NaN is NaN), and a huge finite one is scaled in float64.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from fedpose.shared.privacy.step.layer_rules import (Instantiated, LayerRule, LinearLike, Stacked, holder_for, rule_of,
                                                     stack_instantiated)
from fedpose.shared.privacy.step.persample import (SMALLEST_FLOAT32_FACTOR, LossFn, are_the_models_own, batch_size_of,
                                                   check_chunk_size, chunks_of, iter_per_sample_grads)


def _owner(model: nn.Module, name: str) -> tuple[str, nn.Module, str] | None:
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        return None
    return module_name, module, attr


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
        covered = all(f is not None and rule_of(f[1], f[2]) is not None for f in found)
        cache[names] = _plan(loss_fn.model, layer_names) if covered else None
    return cache[names]


def _plan(model: nn.Module, names: list[str]) -> dict[str, tuple[nn.Module, LayerRule, dict[str, str]]]:
    """module name -> (module, its rule, {attr: parameter name}) for the layers that own ``names``."""
    plan: dict[str, tuple[nn.Module, LayerRule, dict[str, str]]] = {}
    for name in names:
        owner = _owner(model, name)
        rule = None if owner is None else rule_of(owner[1], owner[2])
        if owner is None or rule is None:  # supports() checked every name first
            raise ValueError(f"{name}: no book-keeping rule covers this parameter")
        module_name, module, attr = owner
        entry = plan.setdefault(module_name, (module, rule, {}))
        entry[2][attr] = name
    return plan


class Tape:
    """The per-sample gradient holders of one chunk of samples, ready to give norms and to add their clipped sum."""

    def __init__(self, holders: list[Instantiated | LinearLike | Stacked], size: int, *, real: int | None = None
                 ) -> None:
        self.holders = holders
        self.size = size
        # rows [real:] are padding (``iter_tapes(pad=True)``): norm 0, never added, always masked out
        self.real = size if real is None else real

    def norms(self) -> Tensor:
        """(b,) float64 per-sample L2 norms over all trainable tensors; rows that overflow float32 redone in float64."""
        parts = [holder.sq_norms() for holder in self.holders]  # each in its layer's dtype
        dtype = parts[0].dtype if all(part.dtype == parts[0].dtype for part in parts) else torch.float64
        norms = torch.stack([part.to(dtype) for part in parts]).sum(0).sqrt_().to(torch.float64)
        norms[self.real:] = 0.0  # padding rows are no records: nothing of theirs is recomputed or added
        odd = ~torch.isfinite(norms)
        if bool(odd.any()):
            rows = odd.nonzero().flatten()
            exact = self._exact(rows)
            # as_tensor: sum() of tensors is typed Tensor | 0 (exact holds at least one tensor)
            total = sum(v.reshape(len(rows), -1).pow(2).sum(1) for v in exact.values())
            norms[rows] = torch.sqrt(torch.as_tensor(total))
        return norms

    def per_sample(self) -> dict[str, Tensor]:
        """Every sample's gradient, {name: (b, *shape)} in the parameters' dtype (the public basis needs them)."""
        out: dict[str, Tensor] = {}
        for holder in self.holders:
            out.update(holder.per_sample())
        return out

    def _exact(self, rows: Tensor) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for holder in self.holders:
            out.update(holder.exact(rows))
        return out

    def add_clipped(self, summed: dict[str, Tensor], factors: Tensor, finite: Tensor) -> None:
        """summed += sum_i factors_i g_i; rows not finite add nothing; tiny factors are applied in float64.

        A padded tape adds nothing of its padding rows, and masks its rows on every chunk (not only when some row
        is special), so that the chunk's temporaries do not depend on how many of its rows are real.
        """
        padding = torch.arange(self.size, device=finite.device) >= self.real
        finite = finite & ~padding
        factors = torch.where(padding, torch.zeros_like(factors), factors)
        tiny = factors < SMALLEST_FLOAT32_FACTOR
        special = tiny | ~finite
        regular = torch.where(special, torch.zeros_like(factors), factors)
        keep = None if not bool(special.any()) and self.real == self.size else ~special
        for holder in self.holders:
            holder.add_clipped(summed, regular, keep)
        rows = (tiny & finite & (factors > 0)).nonzero().flatten()
        if len(rows):
            for name, g in self._exact(rows).items():
                scaled = (factors[rows].reshape(-1, *[1] * (g.dim() - 1)) * g).sum(0)
                summed[name].add_(scaled.to(summed[name].dtype))


def iter_tapes(
    loss_fn: Any, params: Mapping[str, Tensor], batch: Mapping[str, Tensor], *, chunk_size: int, pad: bool = False
) -> Iterator[Tape]:
    """Per chunk of ``chunk_size`` samples: a forward with taps and one backward, as a ``Tape``.

    Only ``chunk_size`` samples' activations are alive at a time, whatever the batch. ``pad`` (a site's private
    step): every chunk has ``chunk_size`` rows, its padding rows after its ``Tape.real`` ones
    (``persample.chunks_of``).
    """
    check_chunk_size(chunk_size)
    size = batch_size_of(batch)
    combine_names = [n for n in params if n in loss_fn.combine_names]
    plan = cached_plan(loss_fn, tuple(params))
    if plan is None:
        raise ValueError("book-keeping clipping does not cover every trainable tensor; check supports() first")
    shapes = {name: value.shape for name, value in params.items()}
    direct = are_the_models_own(loss_fn.model, params, combine_names)
    # the loss's tensors: the model's own when direct (only combine's are passed to it), else detached leaves
    leaves = {} if direct else {name: value.detach().requires_grad_(name not in combine_names)
                                for name, value in params.items()}
    detached = {n: params[n].detach() for n in combine_names}
    by_row = bool(combine_names) and getattr(loss_fn, "combine_takes_rows", False)
    for chunk, real in chunks_of(batch, size, chunk_size, pad=pad):
        seen: dict[str, tuple[Tensor | None, Tensor]] = {}

        def hook_for(key: str):
            def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
                if key in seen:
                    raise RuntimeError(f"{key} ran twice in one forward; book-keeping needs one use per layer")
                seen[key] = (args[0] if args else None, output)
            return hook

        handles = []
        for module_name, (module, rule, _) in plan.items():
            handles.append(rule.tapped(module).register_forward_hook(hook_for(module_name)))
        try:
            with torch.enable_grad():
                # the training loop passes the model's own weights: run the model as it is (no parameter swap)
                parts = loss_fn.parts(None if direct else leaves, chunk)  # (b, T)
        finally:
            for handle in handles:
                handle.remove()
        b = parts.shape[0]
        # a combine that takes its parameters per row gets one copy per sample: the backward gives their rows
        rows = {n: v.expand(b, *v.shape).clone().requires_grad_() for n, v in detached.items()} if by_row else {}
        losses = loss_fn.combine(parts, {**leaves, **detached, **rows})
        keys = [k for k in plan if k in seen]
        outputs = [seen[k][1] for k in keys]
        wanted = outputs + list(rows.values())
        got = torch.autograd.grad(losses.sum(), wanted, allow_unused=True) if wanted else []
        grads, row_grads = got[:len(outputs)], got[len(outputs):]
        holders: list[Instantiated | LinearLike] = [holder_for(plan[key], seen[key], grad, shapes)
                                                    for key, grad in zip(keys, grads)]
        missing = [k for k in plan if k not in seen]
        if missing:  # a layer the loss never ran: its gradient is zero for every sample
            holders.append(Instantiated({name: params[name].new_zeros((b, *shapes[name]))
                                          for k in missing for name in plan[k][2].values()}))
        if rows:
            holders.append(Instantiated({n: torch.zeros_like(rows[n]) if g is None else g
                                         for n, g in zip(rows, row_grads)}))
        elif combine_names:
            parts_d = parts.detach()

            def one(extra: dict[str, Tensor], row: Tensor) -> Tensor:
                return loss_fn.combine(row.unsqueeze(0), {**leaves, **extra}).sum()

            per_sample = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(detached, parts_d)
            holders.append(Instantiated(dict(per_sample)))
        tape = Tape(stack_instantiated(holders), b, real=real)
        seen.clear()  # the chunk's activations go with the tape, not with this frame
        del outputs, grads, holders, parts, losses, got, wanted, row_grads, rows
        yield tape
        del tape  # only one chunk's activations are alive at a time


def per_sample_chunks(loss_fn: LossFn, params: Mapping[str, Tensor], batch: Mapping[str, Tensor], *,
                      chunk_size: int, randomness: str = "different", pad: bool = False
                      ) -> Iterator[dict[str, Tensor]]:
    """{name: (b, *shape)} per chunk of samples: from the book-keeping tape where it covers ``params``, else vmap
    (with ``randomness``, as ``persample.iter_per_sample_grads``). ``pad``: each chunk computed on ``chunk_size``
    rows, its real rows handed on."""
    if supports(loss_fn, params):  # one forward and one backward per chunk
        return ({name: g[:tape.real] for name, g in tape.per_sample().items()}
                for tape in iter_tapes(loss_fn, params, batch, chunk_size=chunk_size, pad=pad) if tape.real)
    return iter_per_sample_grads(loss_fn, params, batch, chunk_size=chunk_size, randomness=randomness, pad=pad)
