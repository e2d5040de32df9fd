"""TinyViT's windowed multi-head self-attention, written for per-sample gradients: windows kept batch-first,
a learned relative-position bias read through a plain index table (never in the state_dict), the biased logits
passed through a tap for book-keeping clipping, and a cheaper path for a map smaller than one window.
The block around it is ``fedpose.shared.model.tinyvit_blocks.TinyVitBlock``.
"""

from __future__ import annotations

import torch
from torch import nn

from fedpose.shared.model.tinyvit_windows import map_positions, offset_index


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
