"""Low-rank adapters (``train.strategy: lora``): DP fine-tuning through small added low-rank weights.

Each linear layer of the trunk (``stages.*``: attention and MLP) gets an adapter: ``y = W x + b + U (D x)``,
with D (rank x in) drawn like a fresh ``nn.Linear`` weight and U (out x rank) zero, so the adapted model starts
as the pretrained one (LoRA, Hu et al. 2021; under DP: Yu et al. 2021). D and U are ``nn.Linear`` layers without
bias, children of the layer they adapt (``<layer>.lora.down`` / ``<layer>.lora.up``), called from a forward hook
on it: the per-sample paths (book-keeping and ``vmap``) clip them as any other linear layer, and V spans their
public gradients. The run trains the adapters and the heads, then folds them into W (``merge_adapters``): what
it saves, evaluates and reports is a plain PoseNet, with the frozen weights of the start plus U D.
"""

from __future__ import annotations

import math

import torch
from torch import nn

TRUNK = "stages."


class Adapter(nn.Module):
    """The low-rank update U (D x) of one linear layer; its hook adds it to the layer's output."""

    def __init__(self, layer: nn.Linear, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        self.down = nn.Linear(layer.in_features, rank, bias=False, device=layer.weight.device)
        self.up = nn.Linear(rank, layer.out_features, bias=False, device=layer.weight.device)
        bound = 1 / math.sqrt(layer.in_features)  # nn.Linear's own initialisation, from the run's generator
        with torch.no_grad():
            self.down.weight.copy_(torch.rand(self.down.weight.shape, generator=generator) * 2 * bound - bound)
            self.up.weight.zero_()
        self.handle = layer.register_forward_hook(self._add)

    def _add(self, layer: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return output + self.up(self.down(inputs[0]))


def adapted_layers(model: nn.Module) -> list[str]:
    """Names of the trunk's linear layers an adapter goes on."""
    return [name for name, module in model.named_modules()
            if name.startswith(TRUNK) and isinstance(module, nn.Linear)]


def add_adapters(model: nn.Module, rank: int, generator: torch.Generator) -> list[str]:
    """Put a rank-``rank`` adapter on every trunk linear layer; returns the adapters' parameter names."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"train.lora_rank must be a positive int, got {rank!r}")
    if has_adapters(model):
        raise ValueError("the model already carries adapters: merge them (merge_adapters) before adding new ones")
    layers = adapted_layers(model)
    if not layers:
        raise ValueError(f"the model has no linear layer under {TRUNK!r} to put an adapter on")
    for name in layers:
        layer = model.get_submodule(name)
        if rank > min(layer.in_features, layer.out_features):
            raise ValueError(f"train.lora_rank={rank} exceeds the smaller side of {name} "
                             f"({layer.in_features} x {layer.out_features}); lower it")
        layer.add_module("lora", Adapter(layer, rank, generator))
    return [name for name, _ in model.named_parameters() if ".lora." in name]


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(module, Adapter) for module in model.modules())


@torch.no_grad()
def merge_adapters(model: nn.Module) -> int:
    """Fold every adapter into its layer (W <- W + U D) and remove it; returns how many were merged."""
    merged = 0
    for layer in list(model.modules()):
        adapter = getattr(layer, "lora", None)
        if not isinstance(adapter, Adapter):
            continue
        layer.weight.add_(adapter.up.weight @ adapter.down.weight)
        adapter.handle.remove()
        del layer.lora
        merged += 1
    return merged
