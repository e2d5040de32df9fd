"""TinyViT's building blocks (timm's order: blocks first), written for per-sample gradients: ConvNorm
(foldable conv + BatchNorm), patch embedding, MBConv, patch merging, windowed attention with a
batch-first layout, the attention block and stage, channel LayerNorm. See ``fedpose.shared.model.tinyvit``.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn


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


def _offset_index(window: int) -> torch.Tensor:
    """(N, N) index into the per-head bias table of relative offsets (|dy|, |dx|).

    Offsets are numbered in first-seen order over the window's row-major points (the layout timm uses). The
    first point, (0, 0), meets every offset of the square window in row-major order, so the number of
    (|dy|, |dx|) is |dy| * window + |dx|: computed at once (a loop over the N^2 pairs took 0.1 s for a
    256x192 tinyvit-5m, on every message a site handles).
    """
    ys, xs = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    return (ys[:, None] - ys[None, :]).abs() * window + (xs[:, None] - xs[None, :]).abs()


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
        self._bias_index = _offset_index(window)
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

    def _positions(self, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Row-major indices, in the padded window, of an (h, w) map's points and of the padding's points."""
        key = (h, w, device)
        if key not in self._positions_of:
            inside = torch.zeros(self.window, self.window, dtype=torch.bool)
            inside[:h, :w] = True
            flat = inside.flatten()
            self._positions_of[key] = (flat.nonzero().squeeze(1).to(device), (~flat).nonzero().squeeze(1).to(device))
        return self._positions_of[key]

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
        inside, padding = self._positions(h, w, table.device)
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


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over channels of an NCHW map (timm's LayerNorm2d)."""

    channels_first = True  # read by book-keeping clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)
