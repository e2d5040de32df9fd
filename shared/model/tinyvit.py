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
  so ``functional_call`` never sees it and it is never saved;
- the biased attention logits pass through a tap for book-keeping clipping, and
  a map smaller than one window takes a cheaper path.

Order follows timm: blocks (ConvNorm, patch embedding, MBConv, patch merging, MLP,
the window index tables and attention, the attention block and stage), model,
checkpoint filter, configs, factory. The channel LayerNorm the heads share is in
``fedpose.shared.model.layers``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------------------
# blocks
# ---------------------------------------------------------------------------


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


# Index tables of the square attention windows: the relative offset between each pair of a window's points
# (what the learned attention bias is indexed by), and which points of a padded window a smaller map fills.


def offset_index(window: int) -> torch.Tensor:
    """(N, N) index into the per-head bias table of relative offsets (|dy|, |dx|).

    Offsets are numbered in first-seen order over the window's row-major points (the layout timm uses). The
    first point, (0, 0), meets every offset of the square window in row-major order, so the number of
    (|dy|, |dx|) is |dy| * window + |dx|: computed at once (a loop over the N^2 pairs took 0.1 s for a
    256x192 tinyvit-5m, on every message a site handles).
    """
    ys, xs = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    return (ys[:, None] - ys[None, :]).abs() * window + (xs[:, None] - xs[None, :]).abs()


def map_positions(window: int, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major indices, in the padded window, of an (h, w) map's points and of the padding's points."""
    inside = torch.zeros(window, window, dtype=torch.bool)
    inside[:h, :w] = True
    flat = inside.flatten()
    return flat.nonzero().squeeze(1).to(device), (~flat).nonzero().squeeze(1).to(device)


class Attention(nn.Module):
    """Multi-head self-attention over one window with a learned relative bias."""

    def __init__(self, dim: int, num_heads: int, window: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.key_dim = dim // num_heads
        self.scale = self.key_dim**-0.5
        self.window = window
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attention_biases = nn.Parameter(torch.zeros(num_heads, window * window))
        # Plain attribute (not a buffer): never in state_dict / functional_call.
        self._bias_index = offset_index(window)
        # The biased logits pass through this no-op so that book-keeping clipping can tap their gradient.
        self.logits = nn.Identity()
        self._positions_of: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def bias_index(self) -> torch.Tensor:
        """(N, N) index of each pair of window points into the bias table's offsets."""
        return self._bias_index

    def _bias(self) -> torch.Tensor:
        idx = self._bias_index
        if idx.device != self.attention_biases.device:
            idx = self._bias_index = idx.to(self.attention_biases.device)
        return self.attention_biases[:, idx]  # (heads, N, N)

    def can_fold_padding(self) -> bool:
        """Whether ``forward_in_one_window`` may run: not when the bias table's gradient is being computed or its
        logits are tapped (book-keeping clipping reads the bias gradient from the full (N, N) logits of
        ``forward``). Evaluation, export and a frozen table fold."""
        trains = torch.is_grad_enabled() and self.attention_biases.requires_grad
        return not trains and not self.logits._forward_hooks

    def forward_in_one_window(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` of an (B, h, w, C) map smaller than one window, as ``TinyVitBlock`` zero-pads it to the
        window, computed without the padding's queries (their outputs are cut off) and with the padding's keys
        as one: they are all the same token, so their softmax weights add up to one key whose bias is the
        log-sum-exp of theirs. Equal to ``forward`` on the padded window (to float rounding), at (h w + 1)
        keys for h w queries instead of N keys for N queries. Returns (B, h, w, C)."""
        b, h, w, c = x.shape
        n = h * w
        tokens = torch.cat([x.reshape(b, n, c), x.new_zeros(b, 1, c)], dim=1)  # the padding's zero token last
        qkv = self.qkv(self.norm(tokens)).view(b, n + 1, self.num_heads, 3 * self.key_dim)
        q, k, v = qkv.split(self.key_dim, dim=-1)  # each (B, n+1, h, d)
        q = q[:, :n].transpose(1, 2)  # (B, h, n, d)
        k = k.transpose(1, 2)  # (B, h, n+1, d)
        v = v.transpose(1, 2)
        table = self._bias()  # (heads, N, N)
        size_device = (h, w, table.device)
        if size_device not in self._positions_of:  # once per map size and device
            self._positions_of[size_device] = map_positions(self.window, h, w, table.device)
        inside, padding = self._positions_of[size_device]
        rows = table[:, inside]  # (heads, n, N)
        pad = rows[:, :, padding]  # (heads, n, N - n)
        peak = pad.amax(dim=-1, keepdim=True)  # log-sum-exp from plain ops, which every ONNX consumer runs
        bias = torch.cat([rows[:, :, inside], peak + (pad - peak).exp().sum(dim=-1, keepdim=True).log()],
                         dim=-1)  # (heads, n, n+1)
        attn = ((q * self.scale) @ k.transpose(-2, -1) + bias).softmax(dim=-1)  # (B, h, n, n+1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, h, w, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, nW, N, C) windows kept batch-first
        b, nw, n, c = x.shape
        x = self.norm(x)
        qkv = self.qkv(x).view(b, nw, n, self.num_heads, 3 * self.key_dim)
        q, k, v = qkv.split(self.key_dim, dim=-1)  # each (B, nW, N, h, d)
        q = q.transpose(2, 3)  # (B, nW, h, N, d)
        k = k.transpose(2, 3)
        v = v.transpose(2, 3)
        attn = self.logits((q * self.scale) @ k.transpose(-2, -1) + self._bias())  # (B, nW, h, N, N)
        attn = attn.softmax(dim=-1)
        out = (attn @ v).transpose(2, 3).reshape(b, nw, n, c)
        return self.proj(out)


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
        x = self.patch_embed(x)  # (B, C0, H/4, W/4)
        return self.stages(x)  # (B, C3, ceil(H/32), ceil(W/32))


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
