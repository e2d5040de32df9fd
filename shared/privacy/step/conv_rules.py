"""The book-keeping rules of convolutions: a conv with one group as a Linear over its unfolded patches, a grouped
(depthwise) conv with its per-sample weight gradients instantiated (they are small)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedpose.shared.privacy.step.grad_holders import Instantiated, LinearLike


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
