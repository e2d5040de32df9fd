"""The text the tool prints about what a pixelized frame guarantees and what it does not (DESIGN P9).
"""

from __future__ import annotations

from fedpose.shared.pixelization.spec import PixelizeSpec, is_integer

_MASK_SOURCES = ("none", "keypoints", "file")
_KINDS = ("video", "images", "image")


def pixelize_claim(spec: PixelizeSpec, *, mask_source: str, frames: int, kind: str = "video") -> str:
    """The honest privacy statement for DP pixelization (DESIGN P9), to print.

    Args:
        spec: the parameters used.
        mask_source: "none" (uniform grid), "keypoints" (mask from a pose
            estimate of the same frame) or "file" (a fixed mask image).
        frames: number of frames F released (video), or of images released.
        kind: "video" (frames of one scene: a person in view composes over the frames they are in, all F at
            most), "images" (a folder of stills: each image is its own release; nothing says the same person
            is in them) or "image" (one release, no composition).
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if mask_source not in _MASK_SOURCES:
        raise ValueError(f"mask_source must be one of {_MASK_SOURCES}, got {mask_source!r}")
    if not is_integer(frames) or frames < 1:
        raise ValueError(f"frames must be an integer >= 1, got {frames!r}")
    noise = (
        "two-sided geometric noise on integer cell sums (exact output support)"
        if spec.noise == "discrete"
        else "continuous Laplace noise (floating point; see Mironov 2012)"
    )
    adaptive = mask_source != "none" and spec.n > 1
    sizes = [spec.b, spec.s_b] if adaptive else [spec.b]
    scales = ", ".join(f"{spec.mean_scale(s):.4g} for {s}x{s} cells" for s in sizes)
    lines = [
        f"DP pixelization (Fan 2018; {'region-adaptive Algorithm 3' if adaptive else 'uniform grid Algorithm 2'}): "
        f"each frame is {spec.eps:g}-DP with respect to m-neighbouring images, i.e. images that differ in at most "
        f"m={spec.m} pixels (by any amount).",
        f"Noise: {noise}; Laplace scale 255*m/(s^2*eps) per released cell mean of side s: {scales} (grayscale); "
        "x3 for RGB (eps split over channels); xK on border cells holding mirror-padded copies of pixels that "
        "then count K times (K = 2 per padded axis; more only for frames smaller than b/2); means clipped to "
        "[0, 255] afterwards (post-processing).",
        f"A change of k > m pixels (e.g. a whole person) is only protected at ceil(k/m)*{spec.eps:g} "
        "(group privacy).",
    ]
    if mask_source == "keypoints":
        lines.append(
            "NOT protected: the region mask. It comes from the pose keypoints of the frame, so the cell layout "
            "(which cells are subdivided) reveals where the body is, frame by frame; the guarantee above holds "
            "for the pixel content given that layout."
        )
    elif mask_source == "file":
        lines.append("NOT protected: the region mask from the file is public; the cell layout it induces is released.")
    elif spec.n > 1:
        lines.append("No region mask: every cell has side b (n is unused).")
    if kind == "video":
        lines.append(
            f"Video: over F={frames} frames the guarantee composes to F*eps = {frames * spec.eps:g} (basic "
            "composition) for a person present in all frames."
        )
    elif kind == "images" and frames > 1:
        lines.append(
            f"Images: each of the {frames} images is {spec.eps:g}-DP on its own. A person who appears in k of the "
            f"{frames} images: k*eps (basic composition), {frames * spec.eps:g} if in all of them; a person in "
            "none of them is not in the released data at all."
        )
    return "\n".join(lines)
