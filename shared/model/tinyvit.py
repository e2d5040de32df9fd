"""TinyViT backbone written for per-sample gradients (DP-SGD).

TinyViT (Wu et al., ECCV 2022): an MBConv stage followed by three stages of
windowed self-attention blocks. This implementation keeps the state_dict key
layout of timm's ``tiny_vit_5m_224`` (``patch_embed.*``, ``stages.N.*``,
``head.norm.*``) so TinyViT checkpoints load, but is arranged so that
``torch.func.vmap(grad(...))`` works on every trainable path:

- every convolution is a ``ConvNorm`` (conv + BatchNorm, as in timm) that is
  *folded* into a single biased convolution before training (``fuse_batchnorm``).
  BatchNorm mixes samples of a batch, which breaks per-sample gradients and
  the privacy analysis; after folding no statistic couples samples;
- attention windows keep the batch dimension first: (B, windows, tokens, C);
- no in-place operations on the autograd path;
- the attention-bias index table is a plain tensor attribute, not a buffer,
  so ``functional_call`` never sees it and it is never saved.

Order follows timm: blocks (``fedpose.shared.model.tinyvit_blocks``, the attention in
``fedpose.shared.model.tinyvit_attention``), model, checkpoint filter, configs, factory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedpose.shared.model.tinyvit_blocks import ConvLayer, ConvNorm, PatchEmbed, TinyVitStage


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyVitArch:
    """Architecture hyper-parameters of one TinyViT variant."""

    embed_dims: tuple[int, int, int, int]
    depths: tuple[int, int, int, int]
    num_heads: tuple[int, int, int, int]
    window_sizes: tuple[int, int, int, int]
    mlp_ratio: float = 4.0
    mbconv_expand_ratio: float = 4.0
    local_conv_size: int = 3

    @property
    def stride(self) -> int:
        return 32  # patch embed /4, then three PatchMerging /2


class TinyVit(nn.Module):
    """TinyViT trunk: (B, 3, H, W) -> (B, C3, ceil(H/32), ceil(W/32)).

    ``head`` is attached by the pose model; the trunk itself owns
    ``patch_embed`` and ``stages`` exactly as timm names them.
    """

    def __init__(self, arch: TinyVitArch, in_chans: int = 3) -> None:
        super().__init__()
        self.arch = arch
        d = arch.embed_dims
        self.patch_embed = PatchEmbed(in_chans, d[0])
        stages: list[nn.Module] = [ConvLayer(d[0], arch.depths[0], arch.mbconv_expand_ratio)]
        for i in range(1, 4):
            stages.append(
                TinyVitStage(
                    d[i - 1],
                    d[i],
                    arch.depths[i],
                    arch.num_heads[i],
                    arch.window_sizes[i],
                    arch.mlp_ratio,
                    arch.local_conv_size,
                )
            )
        self.stages = nn.Sequential(*stages)
        self.num_features = d[3]
        self.apply(_init_weights)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.patch_embed(x))


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def fuse_batchnorm(model: nn.Module) -> nn.Module:
    """Fold every ConvNorm's BatchNorm into its conv, in place; returns ``model``.

    Done before any training: per-sample gradients (and the DP analysis) need
    a network whose output for one image does not depend on the others.
    """
    for m in model.modules():
        if isinstance(m, ConvNorm):
            m.fuse()
    return model


@torch.no_grad()
def init_fused_convs(model: nn.Module) -> nn.Module:
    """He-normal init of every folded conv, keeping zero-initialised residual outputs at zero.

    A fresh folded model has no BatchNorm to restore the activation scale
    after each conv, and PyTorch's default conv init shrinks it by ~1/sqrt(3)
    per layer: after the 30-odd convs of the trunk the features are too small
    to train (observed: a from-scratch model that cannot fit 32 images).
    Variance-preserving init fixes that; it matters only for training from
    scratch under DP, since non-private pretraining trains with BatchNorm.
    """
    for m in model.modules():
        if isinstance(m, ConvNorm) and m.fused and m.conv.weight.abs().sum() > 0:
            fan_in = m.conv.weight[0].numel()
            nn.init.normal_(m.conv.weight, 0.0, math.sqrt(2.0 / fan_in))
            nn.init.zeros_(m.conv.bias)
    return model


def is_fused(model: nn.Module) -> bool:
    convs = [m for m in model.modules() if isinstance(m, ConvNorm)]
    return bool(convs) and all(m.fused for m in convs)


# ---------------------------------------------------------------------------
# checkpoint filter
# ---------------------------------------------------------------------------


def resample_attention_biases(table: torch.Tensor, window: int) -> torch.Tensor:
    """Resize a (heads, w0*w0) relative-offset bias table to (heads, window*window).

    The table is a w0 x w0 grid over (|dy|, |dx|); it is resized bicubically,
    as one does when a checkpoint trained at one window size is used at another.
    """
    heads, n = table.shape
    w0 = math.isqrt(n)
    if w0 * w0 != n:
        raise ValueError(f"attention bias table of {n} offsets is not a square window")
    if w0 == window:
        return table
    grid = table.view(1, heads, w0, w0)
    out = F.interpolate(grid, size=(window, window), mode="bicubic", align_corners=False)
    return out.view(heads, window * window)


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Map a TinyViT checkpoint (timm or original Microsoft layout) onto ``model``'s keys.

    Accepts ``{"model": sd}`` / ``{"state_dict": sd}`` wrappers, the original
    layout (``layers.N`` -> ``stages.N``, ``norm_head`` -> ``head.norm``),
    drops the ImageNet classifier (``head.fc``/``head.weight``) and the index
    buffers, and resamples attention-bias tables to the model's window sizes.
    BatchNorm entries are kept: load them into an unfused model, then fuse.
    """
    for wrapper in ("model", "state_dict"):
        if wrapper in state_dict and isinstance(state_dict[wrapper], dict):
            state_dict = state_dict[wrapper]
    target = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.endswith("attention_bias_idxs"):
            continue
        key = key.replace("layers.", "stages.").replace("norm_head.", "head.norm.")
        if key in ("head.fc.weight", "head.fc.bias", "head.weight", "head.bias"):
            continue
        if key.endswith("attention_biases") and key in target:
            window = math.isqrt(target[key].shape[1])
            value = resample_attention_biases(value, window)
        out[key] = value
    return out


# ---------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------

ARCHS: dict[str, TinyVitArch] = {
    # timm tiny_vit_5m_224
    "tinyvit-5m": TinyVitArch(
        embed_dims=(64, 128, 160, 320),
        depths=(2, 2, 6, 2),
        num_heads=(2, 4, 5, 10),
        window_sizes=(7, 7, 14, 7),
    ),
    # CPU-sized variant for the embedded synthetic ward and tests.
    "tinyvit-small": TinyVitArch(
        embed_dims=(32, 64, 128, 160),
        depths=(1, 1, 2, 1),
        num_heads=(1, 2, 4, 5),
        window_sizes=(4, 4, 4, 4),
    ),
}


# ---------------------------------------------------------------------------
# factory
# ---------------------------------------------------------------------------


def tinyvit(variant: str) -> TinyVit:
    """Build an (unfused) TinyViT trunk by variant name."""
    try:
        arch = ARCHS[variant]
    except KeyError as err:
        raise ValueError(f"unknown TinyViT variant {variant!r}; choose one of {sorted(ARCHS)}") from err
    return TinyVit(arch)
