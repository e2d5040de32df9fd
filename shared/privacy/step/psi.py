"""Feature maps psi for Feature-DP: the part of an image treated as public.

Feature-DP (FP-DP Algorithm 1, public branch "g_pub = mean grad l(w, psi(x))")
splits each private image x into a public feature psi(x) and the rest. The
public gradient is computed on psi(x) without clipping or noise, so the model
may learn, and reveal, anything that psi(x) and the pose labels contain. The
guarantee is about the remainder of x only; it is NOT record-level DP
(invariant P8). Neither map below is a privacy mechanism by itself.

The maps themselves, and what each reveals, are in ``psi_maps``.

Invariant P3: the public gradient depends on x only through psi(x) and the
labels. ``apply_psi`` is the only intended way to build the ``PsiBatch`` that
``fpdp.public_gradient`` accepts, so raw images cannot be passed by accident.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

from fedpose.shared.privacy.step.psi_maps import FeatureMap

IMAGE_KEY = "image"


@dataclass(frozen=True)
class PsiBatch:
    """A batch whose images have been mapped by psi: the only input of the public gradient.

    Build it with ``apply_psi``; its "image" entry is psi(x), the other
    entries (pose labels, visibility, ...) are the batch's labels, which
    Feature-DP also treats as public.
    """

    tensors: Mapping[str, Tensor]
    psi_name: str

    @property
    def batch_size(self) -> int:
        return int(self.tensors[IMAGE_KEY].shape[0])


def apply_psi(psi: FeatureMap, batch: Mapping[str, Tensor]) -> PsiBatch:
    """Map batch["image"] through psi and wrap the result for ``public_gradient``.

    The raw images are not kept. Every other entry is passed through as a
    label: do not put raw-image derivatives (crops, masks computed from
    pixels) in the batch dict, they would become public too.
    """
    if not isinstance(batch, Mapping) or IMAGE_KEY not in batch:
        raise ValueError(f"apply_psi needs a batch dict with an {IMAGE_KEY!r} entry")
    with torch.no_grad():
        if getattr(psi, "per_record", False):  # dp-pixelize: each record's one release
            if "index" not in batch:
                raise ValueError(f"psi {psi.name} needs the records' indices (batch['index'])")
            mapped = psi(batch[IMAGE_KEY], batch["index"])
        else:
            mapped = psi(batch[IMAGE_KEY])
    tensors = {name: value for name, value in batch.items() if name != IMAGE_KEY}
    tensors[IMAGE_KEY] = mapped
    return PsiBatch(tensors=MappingProxyType(tensors), psi_name=psi.name)


PSI_KINDS = ("blur", "pixelate")


def psi_strength(kind: str, param: float, input_size: tuple[int, int]) -> float:
    """psi's strength as a fraction of min(H, W) of the model input (larger is stronger).

    A site pins a minimum in its policy (``psi_min``, P11). ``kind`` and
    ``param`` as in the config: blur's ``param`` already is the blur sigma as
    that fraction; pixelate's is the block side in input pixels (whole pixels
    count, as ``make_psi`` uses them).
    """
    if kind == "blur":
        return float(param)
    if kind == "pixelate":
        return float(int(param)) / float(min(input_size))
    raise ValueError(f"psi={kind!r} is not one of {PSI_KINDS}")


def psi_label_of(privacy: object) -> str:
    """``psi_label`` of a privacy config section (``psi``, ``psi_param``, ``psi_eps``, ``psi_m``)."""
    return psi_label(privacy.psi, privacy.psi_param, eps=privacy.psi_eps, m=privacy.psi_m)  # type: ignore[attr-defined]


def psi_label(kind: str, param: float, *, eps: float | None = None, m: int | None = None) -> str:
    """How claims and ledger rows name a feature map, e.g. ``blur(0.03)``: one spelling everywhere.

    dp-pixelize also names its eps_pix and m: ``dp-pixelize(8, eps=1, m=1)``.
    """
    if kind == "dp-pixelize":
        if eps is None or m is None:
            raise ValueError("psi_label: dp-pixelize needs its eps and m")
        return f"{kind}({param:g}, eps={eps:g}, m={m})"
    return f"{kind}({param:g})"
