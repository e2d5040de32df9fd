"""What a server reads from one Feature-DP reply (fdp / fpdp; docs/explanation/design.md P17): crafted weights.

Under fdp and fpdp every local step adds the public gradient g_pub = mean_x grad l(w, psi(x)) of a
batch drawn from the site's own records, with no clipping and no noise (FP-DP Algorithm 1, the
public branch). Under fpdp the private, noisy term is projected on V and the server may send any
orthonormal V, so on every coordinate outside span(V) one plain-SGD step releases exactly
w - lr * g_pub. Feature-DP treats psi(x) and the pose labels as public, so this is within its
definition; this module makes what that means measurable for the real model, with finite weights
that pass every check a site makes:

- the trunk passes block means of its input through (residual branches zeroed, each stride-2 conv
  either averages a 2x2 block or moves it into channels; GELU is the identity above 5.4 in float32, so
  every kept value rides on an offset of ``OFFSET``): luminance on a ``LUMA_BLOCK``-px grid and colour
  on a ``COLOUR_BLOCK``-px grid, which is what fits the 160 channels of tinyvit-small's last stage;
- the SimCC head's 1x1 conv ``head.final`` is all zero, so for one record its weight gradient is
  delta f^T and its bias gradient delta, and row o of the first over entry o of the second is f, the
  (LayerNorm-ed) trunk features at the one position whose delta the head lets through to channel o;
- the head is gated per joint: joint k's features are a binary code of k that opens hidden unit k only
  (exactly: GELU is exactly 0, with a zero derivative, below -15), the coordinate heads are zero so the
  predicted SimCC distributions are uniform, and the coordinate heads' weight gradient on unit k is
  then (uniform - target_k) scaled by known constants: the exact SimCC target of joint k.

``fedpose.shared.experiments.reconstruction_read`` reads a reply back and scores it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedpose.shared.configuration.schema import Config, replace
from fedpose.shared.model.posenet import PoseNet
from fedpose.shared.model.tinyvit import ConvNorm, PatchMerging
from fedpose.shared.configuration.methods import PROJECTED

OFFSET = 16.0  # every kept value rides on this: GELU(x) == x exactly in float32 for x >= 5.37
LUMA_BLOCK = 4  # px: the stem averages 4x4 blocks
COLOUR_BLOCK = 8  # px: the first merge averages 2x2 of those for colour, keeps all four for luminance
GATE = 15.0  # pre-activation of a joint's own hidden unit; every other unit sits at <= -GATE (GELU = 0 there)


@dataclass(frozen=True)
class Slot:
    """What one channel of a feature map holds: ``plane[i * step + dr, j * step + dc]`` at grid position (i, j).

    ``plane`` is "L" (mean of the three normalised colour channels, ``LUMA_BLOCK``-px blocks) or 0, 1, 2 (one
    normalised colour channel, ``COLOUR_BLOCK``-px blocks). Plane indices past the plane's edge were padding.
    """

    plane: str | int
    step: int
    dr: int
    dc: int


@dataclass(frozen=True)
class Crafted:
    """Weights a server could send, and what it needs to read the reply.

    ``state``: a full state_dict of the fused model. ``slots``: what each channel of the last stage holds.
    ``anchor`` holds ``OFFSET`` and ``zero`` holds 0 at every position, so the head's LayerNorm can be undone.
    ``reader[p]`` = (joint, channel of ``head.final``) whose delta is nonzero at head position p only.
    ``read``: the trainable tensors the read-out uses (V must leave them out).
    """

    state: dict[str, torch.Tensor]
    slots: tuple[Slot, ...]
    anchor: int
    zero: int
    reader: tuple[tuple[int, int], ...]
    head_grid: tuple[int, int]
    input_size: tuple[int, int]
    joints: int
    read: tuple[str, ...] = ("head.final.weight", "head.final.bias", "head.x_head.weight", "head.y_head.weight",
                             "head.vis_head.weight")


def _conv(module: nn.Module) -> nn.Conv2d:
    """The (folded) conv of a ``ConvNorm``; the crafted weights are for a fused model (BatchNorm folded)."""
    if isinstance(module, ConvNorm):
        if not module.fused:
            raise ValueError("craft weights for a fused model (build_model folds BatchNorm)")
        return module.conv
    if isinstance(module, nn.Conv2d):
        return module
    raise TypeError(f"expected a conv, got {type(module).__name__}")


def _merge(merge: PatchMerging, slots: list[Slot]) -> list[Slot]:
    """Program one stride-2 ``PatchMerging`` as space to depth: each input slot moves into four channels, one per
    position of the 2x2 block.

    conv1 copies, the depthwise conv2 picks one tap (kernel index 1 + offset: output (i, j) sees input rows and
    columns 2i - 1 .. 2i + 1; past the edge it picks the zero padding), conv3 copies. Values stay on
    ``OFFSET``, so both GELUs pass them unchanged.
    """
    c1, c2, c3 = _conv(merge.conv1), _conv(merge.conv2), _conv(merge.conv3)
    if 4 * len(slots) > c1.out_channels:
        raise ValueError(f"the crafted trunk needs {4 * len(slots)} channels in a stage of {c1.out_channels}")
    out: list[Slot] = []
    for i, slot in enumerate(slots):
        for a in (0, 1):
            for b in (0, 1):
                o = len(out)
                c1.weight[o, i, 0, 0] = 1.0
                c2.weight[o, 0, 1 + a, 1 + b] = 1.0
                c3.weight[o, o, 0, 0] = 1.0
                out.append(Slot(slot.plane, 2 * slot.step, a * slot.step + slot.dr, b * slot.step + slot.dc))
    return out


def _luma_and_colour(merge: PatchMerging) -> list[Slot]:
    """The first merge: luminance (mean of the 3 colour channels) moved into 4 channels, colour averaged 2x2."""
    c1, c2, c3 = _conv(merge.conv1), _conv(merge.conv2), _conv(merge.conv3)
    if c1.out_channels < 7:
        raise ValueError(f"the crafted trunk needs 7 channels after the first merge, the model has {c1.out_channels}")
    out: list[Slot] = []
    for a in (0, 1):
        for b in (0, 1):
            o = len(out)
            c1.weight[o, 0:3, 0, 0] = 1.0 / 3.0
            c2.weight[o, 0, 1 + a, 1 + b] = 1.0
            c3.weight[o, o, 0, 0] = 1.0
            out.append(Slot("L", 2, a, b))
    for colour in range(3):
        o = len(out)
        c1.weight[o, colour, 0, 0] = 1.0
        c2.weight[o, 0, 1:3, 1:3] = 0.25
        c3.weight[o, o, 0, 0] = 1.0
        out.append(Slot(colour, 1, 0, 0))
    return out


def _identity_blocks(model: PoseNet) -> None:
    """Every block of every stage passes its input through: residual outputs zero, local convs identity."""
    for name, module in model.named_modules():
        if name.endswith("local_conv"):
            _conv(module).weight[:, 0, 1, 1] = 1.0  # depthwise 3x3, centre tap


@torch.no_grad()
def craft_weights(model: PoseNet) -> Crafted:
    """Weights for ``model``'s architecture (its own weights are not used) that make one reply readable.

    Needs H and W multiples of ``COLOUR_BLOCK``, a head grid no larger than its joints x read channels,
    ``model.joint_channels`` >= 1 + 2 log2(joints) and ``hidden`` >= joints; raises ValueError otherwise.
    """
    h, w = model.input_size
    if h % COLOUR_BLOCK or w % COLOUR_BLOCK:
        raise ValueError(f"input {h}x{w}: the crafted trunk needs H and W multiples of {COLOUR_BLOCK}")
    if model.cfg.task_uncertainty is False and model.cfg.vis_weight <= 0:
        raise ValueError("the read-out goes through the visibility loss: it needs model.vis_weight > 0 or "
                         "task_uncertainty")
    head = model.head
    joints, groups = head.num_joints, head.joint_channels
    bits = max(1, math.ceil(math.log2(joints)))
    readers = groups - 2 * bits  # channels per joint left for reading after its gate code
    hidden = head.mlp[0].out_features
    gh, gw = math.ceil(h / 32), math.ceil(w / 32)
    if readers < 1 or hidden < joints or gh * gw > joints * readers:
        raise ValueError(f"the crafted head needs joint_channels >= {2 * bits + 1}, hidden >= {joints} and a head "
                         f"grid of at most {joints * max(readers, 0)} positions; got {groups}, {hidden}, {gh}x{gw}")
    for p in model.parameters():
        p.zero_()
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.weight.fill_(1.0)
    # stem: two stride-2 3x3 convs, each averaging the 2x2 block at taps (1..2, 1..2), offset added once
    conv1, conv2 = _conv(model.patch_embed.conv1), _conv(model.patch_embed.conv2)
    for colour in range(3):
        conv1.weight[colour, colour, 1:3, 1:3] = 0.25
        conv1.bias[colour] = OFFSET
        conv2.weight[colour, colour, 1:3, 1:3] = 0.25
    _identity_blocks(model)
    slots = _luma_and_colour(model.stages[1].downsample)
    slots = _merge(model.stages[2].downsample, slots)
    slots = _merge(model.stages[3].downsample, slots)
    last = _conv(model.stages[3].downsample.conv3)
    anchor, zero = len(slots), len(slots) + 1
    if zero >= last.out_channels:
        raise ValueError(f"the crafted trunk needs {zero + 1} channels in the last stage, the model has "
                         f"{last.out_channels}")
    last.bias[anchor] = OFFSET
    # head: final conv zero (read), gates in its bias; the MLP opens unit k for joint k only
    final, mlp = _conv(head.final), head.mlp[0]
    positions = gh * gw
    gain = 2.0 * GATE
    for k in range(joints):
        for b in range(bits):
            bit = (k >> b) & 1
            final.bias[k * groups + readers + 2 * b] = float(bit)
            final.bias[k * groups + readers + 2 * b + 1] = float(1 - bit)
            mlp.weight[k, (readers + 2 * b) * positions] = gain * bit
            mlp.weight[k, (readers + 2 * b + 1) * positions] = gain * (1 - bit)
    mlp.bias[:] = -gain * bits + GATE  # own code: gain * bits matches -> +GATE; any other: <= -GATE
    reader = []
    for p in range(positions):
        k, r = divmod(p, readers)  # joint k's read channel r lets the gradient through at position p only
        mlp.weight[k, r * positions + p] = 1.0
        reader.append((k, k * groups + r))
    head.vis_head.weight[0, :joints] = 1.0
    head.vis_head.bias[0] = -GATE  # visibility logits 0: sigmoid 1/2, so the gradient is never zero
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Crafted(state=state, slots=tuple(slots), anchor=anchor, zero=zero, reader=tuple(reader),
                   head_grid=(gh, gw), input_size=(h, w), joints=joints)


def outside_basis(model: PoseNet, trainable: list[str], crafted: Crafted, k: int) -> torch.Tensor:
    """An orthonormal V (p, k) of unit vectors on coordinates the read-out does not use (the first ones of the
    first trainable tensor it does not read): with it, fpdp's private term is exactly zero where the server reads.
    """
    named = dict(model.named_parameters())
    sizes = [named[n].numel() for n in trainable]
    start = 0
    for name, size in zip(trainable, sizes):
        if name not in crafted.read and size >= k:
            break
        start += size
    else:
        raise ValueError(f"no trainable tensor of {k} or more entries lies outside the read-out")
    basis = torch.zeros(sum(sizes), k)
    basis[torch.arange(start, start + k), torch.arange(k)] = 1.0
    return basis


def attack_config(cfg: Config, *, method: str = "fpdp", lr: float = 1.0) -> Config:
    """The protocol fields a server sets for the read-out: one plain-SGD step (no momentum, no weight decay, no
    averaging of iterates, a fresh optimizer, a constant rate), a public batch of one record. Every one of them
    is the server's to choose; what the site pins (psi, clip, q, sigma floor) is left as ``cfg`` has it."""
    return replace(cfg, **{"train.method": method, "train.optimizer": "sgd", "train.lr": lr, "train.momentum": 0.0,
                           "train.weight_decay": 0.0, "train.schedule": "constant", "train.ema": 0.0,
                           "train.public_batch_size": 1, "federation.site_optimizer": "fresh"})


def attack_content(cfg: Config, crafted: Crafted, basis: torch.Tensor | None, *, federation: str, round: int,
                   site: str, sigma: float, sample_rate: float) -> Any:
    """The train request (Flower ``RecordDict``) a server sends: the crafted weights, one local step, and for
    fpdp the broadcast V (version ``round``) that leaves the read tensors out. ``cfg`` from ``attack_config``."""
    from flwr.app import RecordDict

    from fedpose.shared.flower.messages import ARRAYS, BASIS, CONFIG, TrainRequest, basis_record, weights_record

    projected = cfg.train.method in PROJECTED
    request = TrainRequest(federation=federation, round=round, site=site, sigma=sigma, sample_rate=sample_rate,
                           steps=1, basis_version=round if projected else 0, basis_mode="broadcast", config=cfg)
    content = RecordDict({ARRAYS: weights_record(crafted.state), CONFIG: request.to_record()})
    if projected:
        if basis is None:
            raise ValueError(f"method {cfg.train.method!r} projects: give the basis V (outside_basis)")
        content[BASIS] = basis_record(basis, version=round, dtype="float32")
    return content
