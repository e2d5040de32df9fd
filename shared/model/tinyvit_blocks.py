"""TinyViT's building blocks (timm's order: blocks first), written for per-sample gradients: ConvNorm
(foldable conv + BatchNorm), patch embedding, MBConv, patch merging, the attention block and stage, channel
LayerNorm. The windowed attention itself is ``fedpose.shared.model.tinyvit_attention``; see
``fedpose.shared.model.tinyvit``.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from fedpose.shared.model.tinyvit_attention import Attention


class ConvNorm(nn.Module):
    """Conv2d (no bias) + BatchNorm2d, foldable into one biased Conv2d.

    Keys match timm: ``conv.weight``, ``bn.{weight,bias,running_mean,...}``.
    After ``fuse()`` the module holds ``conv.{weight,bias}`` and no BatchNorm.
    """

    def __init__(
        self,
        in_chs: int,
        out_chs: int,
        ks: int = 1,
        stride: int = 1,
        pad: int = 0,
        groups: int = 1,
        bn_weight_init: float = 1.0,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_chs, out_chs, ks, stride, pad, groups=groups, bias=False)
        self.bn: nn.Module = nn.BatchNorm2d(out_chs)
        nn.init.constant_(self.bn.weight, bn_weight_init)
        nn.init.constant_(self.bn.bias, 0.0)
        self.fused = False

    @torch.no_grad()
    def fuse(self) -> None:
        """Fold the BatchNorm's affine map and running statistics into the conv."""
        if self.fused:
            return
        bn = self.bn
        assert isinstance(bn, nn.BatchNorm2d)  # internal invariant, not input validation
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # (out,)
        conv = nn.Conv2d(
            self.conv.in_channels,
            self.conv.out_channels,
            self.conv.kernel_size,
            self.conv.stride,
            self.conv.padding,
            groups=self.conv.groups,
            bias=True,
        ).to(self.conv.weight.device, self.conv.weight.dtype)
        conv.weight.copy_(self.conv.weight * scale[:, None, None, None])
        conv.bias.copy_(bn.bias - bn.running_mean * scale)
        self.conv = conv
        self.bn = nn.Identity()
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class PatchEmbed(nn.Module):
    """Two stride-2 3x3 convs: (B, 3, H, W) -> (B, C0, H/4, W/4)."""

    def __init__(self, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.conv1 = ConvNorm(in_chans, embed_dim // 2, 3, 2, 1)
        self.act = nn.GELU()
        self.conv2 = ConvNorm(embed_dim // 2, embed_dim, 3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.act(self.conv1(x)))


class MBConv(nn.Module):
    """Inverted residual block of stage 1 (NCHW in, NCHW out)."""

    def __init__(self, dim: int, expand_ratio: float) -> None:
        super().__init__()
        hidden = int(dim * expand_ratio)
        self.conv1 = ConvNorm(dim, hidden, ks=1)
        self.act1 = nn.GELU()
        self.conv2 = ConvNorm(hidden, hidden, ks=3, stride=1, pad=1, groups=hidden)
        self.act2 = nn.GELU()
        self.conv3 = ConvNorm(hidden, dim, ks=1, bn_weight_init=0.0)
        self.act3 = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act1(self.conv1(x))
        y = self.act2(self.conv2(y))
        y = self.conv3(y)
        return self.act3(y + x)  # not in place: per-sample autograd needs x intact


class ConvLayer(nn.Module):
    """Stage 1: a sequence of MBConv blocks."""

    def __init__(self, dim: int, depth: int, expand_ratio: float) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[MBConv(dim, expand_ratio) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class PatchMerging(nn.Module):
    """Downsampling between stages: (B, C, H, W) -> (B, C', ceil(H/2), ceil(W/2))."""

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.act = nn.GELU()
        self.conv1 = ConvNorm(dim, out_dim, 1, 1, 0)
        self.conv2 = ConvNorm(out_dim, out_dim, 3, 2, 1, groups=out_dim)
        self.conv3 = ConvNorm(out_dim, out_dim, 1, 1, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv1(x))
        x = self.act(self.conv2(x))
        return self.conv3(x)


class Mlp(nn.Module):
    """Pre-norm MLP of a TinyViT block (keys ``norm``, ``fc1``, ``fc2`` as timm)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.norm(x))))


class TinyVitBlock(nn.Module):
    """Window attention + depthwise local conv + MLP on an NHWC map."""

    def __init__(
        self, dim: int, num_heads: int, window: int, mlp_ratio: float, local_conv_size: int
    ) -> None:
        super().__init__()
        self.window = window
        self.attn = Attention(dim, num_heads, window)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        pad = local_conv_size // 2
        self.local_conv = ConvNorm(dim, dim, ks=local_conv_size, stride=1, pad=pad, groups=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, H, W, C)
        b, h, w, c = x.shape
        ws = self.window
        if h <= ws and w <= ws and h * w < ws * ws and self.attn.can_fold_padding():
            return self._local_and_mlp(x + self.attn.forward_in_one_window(x))
        pad_b = (ws - h % ws) % ws
        pad_r = (ws - w % ws) % ws
        y = F.pad(x, (0, 0, 0, pad_r, 0, pad_b)) if (pad_b or pad_r) else x
        ph, pw = h + pad_b, w + pad_r
        nh, nw = ph // ws, pw // ws
        # (B, nh, ws, nw, ws, C) -> (B, nh*nw, ws*ws, C)
        y = y.view(b, nh, ws, nw, ws, c).transpose(2, 3).reshape(b, nh * nw, ws * ws, c)
        y = self.attn(y)
        y = y.view(b, nh, nw, ws, ws, c).transpose(2, 3).reshape(b, ph, pw, c)
        if pad_b or pad_r:
            y = y[:, :h, :w]
        return self._local_and_mlp(x + y)

    def _local_and_mlp(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local_conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # (B, H, W, C)
        return y + self.mlp(y)


class TinyVitStage(nn.Module):
    """PatchMerging downsample then attention blocks (NCHW in, NCHW out)."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        depth: int,
        num_heads: int,
        window: int,
        mlp_ratio: float,
        local_conv_size: int,
    ) -> None:
        super().__init__()
        self.downsample = PatchMerging(in_dim, out_dim)
        self.blocks = nn.Sequential(
            *[TinyVitBlock(out_dim, num_heads, window, mlp_ratio, local_conv_size) for _ in range(depth)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.downsample(x)  # (B, C', H/2, W/2)
        x = self.blocks(x.permute(0, 2, 3, 1))  # NHWC through the blocks
        return x.permute(0, 3, 1, 2)


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over channels of an NCHW map (timm's LayerNorm2d)."""

    channels_first = True  # read by book-keeping clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)
