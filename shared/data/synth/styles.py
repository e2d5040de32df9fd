"""Per-site looks (``SiteStyle``): palette, furniture, camera, lighting, noise and pose mix;
the site presets and ``PUBLIC_STYLE`` for the public split."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from fedpose.shared.data.synth.body import POSE_KINDS
from fedpose.shared.data.synth.rng import _derive_rng

FURNITURE: tuple[str, ...] = (
    "window", "cabinet", "monitor", "iv_pole", "curtain", "bed", "bars", "chair", "door", "poster",
    "plant", "cart", "mat",
)
FLOOR_PATTERNS: tuple[str, ...] = ("tiles", "wood", "checker", "plain")

Colour = tuple[int, int, int]  # BGR, 0..255


def _check_colour(value: object, what: str) -> None:
    if not (isinstance(value, tuple) and len(value) == 3 and all(isinstance(c, int) and 0 <= c <= 255 for c in value)):
        raise ValueError(f"{what} must be a BGR tuple of three ints in 0..255, got {value!r}")


def _check_range(value: object, what: str, lo: float, hi: float) -> None:
    if not (isinstance(value, tuple) and len(value) == 2 and lo <= value[0] <= value[1] <= hi):
        raise ValueError(f"{what} must be a (low, high) tuple within [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class SiteStyle:
    """How one site's camera and room look. Colours are BGR.

    person_height is the standing height of a person as a fraction of the
    image side (camera distance); foreshorten < 1 squashes people vertically
    (a camera mounted high and looking down); blur is the camera's own
    Gaussian sigma in px at 128 px (scaled with the image size); noise is
    the sensor noise sigma in grey levels; pose_mix weights ``POSE_KINDS``.
    """

    name: str
    wall: Colour
    floor: Colour
    floor_pattern: str
    palette: tuple[Colour, ...]
    furniture: tuple[str, ...]
    clutter: tuple[int, int]
    horizon: tuple[float, float]
    person_height: tuple[float, float]
    foreshorten: float
    gain: float
    cast: tuple[float, float, float]
    vignette: float
    noise: float
    blur: float
    colour_jitter: float
    occluder_prob: float
    bedding: Colour
    pose_mix: tuple[tuple[str, float], ...]

    def __post_init__(self) -> None:
        _check_colour(self.wall, f"SiteStyle({self.name}).wall")
        _check_colour(self.floor, f"SiteStyle({self.name}).floor")
        _check_colour(self.bedding, f"SiteStyle({self.name}).bedding")
        if not self.palette:
            raise ValueError(f"SiteStyle({self.name}).palette must not be empty")
        for colour in self.palette:
            _check_colour(colour, f"SiteStyle({self.name}).palette entry")
        if self.floor_pattern not in FLOOR_PATTERNS:
            raise ValueError(
                f"SiteStyle({self.name}).floor_pattern must be one of {FLOOR_PATTERNS}, got {self.floor_pattern!r}"
            )
        unknown = sorted(set(self.furniture) - set(FURNITURE))
        if unknown:
            raise ValueError(f"SiteStyle({self.name}).furniture: unknown kinds {unknown}; choose from {FURNITURE}")
        if not (len(self.clutter) == 2 and 0 <= self.clutter[0] <= self.clutter[1] <= 40):
            raise ValueError(
                f"SiteStyle({self.name}).clutter must be (low, high) counts within 0..40, got {self.clutter}"
            )
        _check_range(self.horizon, f"SiteStyle({self.name}).horizon", 0.1, 0.9)
        _check_range(self.person_height, f"SiteStyle({self.name}).person_height", 0.15, 0.95)
        for name, lo, hi in (("foreshorten", 0.5, 1.0), ("gain", 0.2, 3.0), ("vignette", 0.0, 0.9),
                             ("noise", 0.0, 50.0), ("blur", 0.0, 3.0), ("colour_jitter", 0.0, 128.0),
                             ("occluder_prob", 0.0, 1.0)):
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise ValueError(f"SiteStyle({self.name}).{name} must be in [{lo}, {hi}], got {value}")
        if len(self.cast) != 3 or not all(0.3 <= c <= 2.0 for c in self.cast):
            raise ValueError(f"SiteStyle({self.name}).cast must be three channel gains in [0.3, 2], got {self.cast}")
        kinds = [k for k, _ in self.pose_mix]
        weights = [w for _, w in self.pose_mix]
        if set(kinds) - set(POSE_KINDS) or len(set(kinds)) != len(kinds):
            raise ValueError(
                f"SiteStyle({self.name}).pose_mix kinds must be distinct members of {POSE_KINDS}, got {kinds}"
            )
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"SiteStyle({self.name}).pose_mix weights must be >= 0 with a positive sum, got {weights}")


def _mix(**weights: float) -> tuple[tuple[str, float], ...]:
    return tuple((k, float(weights.get(k, 0.0))) for k in POSE_KINDS)


_SITE_PRESETS: tuple[SiteStyle, ...] = (
    SiteStyle(  # ICU: pale green walls, monitors and IV poles, people in bed, close camera
        name="icu", wall=(196, 214, 186), floor=(150, 156, 146), floor_pattern="tiles",
        palette=((228, 228, 224), (176, 136, 84), (92, 150, 96), (58, 60, 62), (200, 206, 160), (160, 186, 150),
                 (120, 150, 200)),
        furniture=("monitor", "iv_pole", "cabinet", "curtain", "window", "cart"), clutter=(5, 9),
        horizon=(0.36, 0.46), person_height=(0.56, 0.8), foreshorten=0.86, gain=1.0, cast=(1.06, 1.0, 0.94),
        vignette=0.15, noise=3.0, blur=0.3, colour_jitter=10.0, occluder_prob=0.25, bedding=(232, 222, 206),
        pose_mix=_mix(lying=0.45, sitting=0.2, standing=0.15, walking=0.05, bending=0.1, arms_raised=0.05),
    ),
    SiteStyle(  # rehab gym: warm walls, wooden floor, bars and mats, walking, bright
        name="rehab", wall=(150, 200, 236), floor=(62, 112, 164), floor_pattern="wood",
        palette=((40, 122, 222), (80, 80, 200), (140, 200, 240), (50, 90, 140), (200, 160, 120), (30, 30, 34),
                 (96, 168, 210)),
        furniture=("bars", "mat", "window", "poster", "chair", "plant"), clutter=(5, 9),
        horizon=(0.46, 0.56), person_height=(0.46, 0.7), foreshorten=0.97, gain=1.12, cast=(0.9, 1.0, 1.08),
        vignette=0.05, noise=2.0, blur=0.0, colour_jitter=10.0, occluder_prob=0.2, bedding=(120, 170, 220),
        pose_mix=_mix(walking=0.35, standing=0.2, arms_raised=0.2, bending=0.15, sitting=0.1),
    ),
    SiteStyle(  # geriatric ward: lilac walls, checker floor, chairs, dim and noisy
        name="geriatric", wall=(204, 180, 214), floor=(168, 186, 198), floor_pattern="checker",
        palette=((182, 130, 200), (122, 90, 150), (202, 220, 230), (100, 140, 110), (60, 70, 92), (150, 200, 222),
                 (214, 214, 214)),
        furniture=("bed", "chair", "window", "door", "cabinet", "plant", "poster"), clutter=(4, 8),
        horizon=(0.4, 0.5), person_height=(0.5, 0.74), foreshorten=0.92, gain=0.8, cast=(1.0, 0.97, 1.04),
        vignette=0.3, noise=5.0, blur=0.4, colour_jitter=10.0, occluder_prob=0.3, bedding=(210, 190, 230),
        pose_mix=_mix(sitting=0.4, standing=0.15, walking=0.15, lying=0.15, bending=0.1, arms_raised=0.05),
    ),
    SiteStyle(  # emergency at night: dark blue-grey, far high camera, strong noise and blur
        name="night", wall=(132, 114, 96), floor=(96, 96, 88), floor_pattern="plain",
        palette=((150, 120, 60), (60, 60, 60), (180, 180, 180), (90, 120, 150), (40, 40, 92), (200, 170, 120),
                 (130, 110, 100)),
        furniture=("monitor", "iv_pole", "bed", "curtain", "door", "cart"), clutter=(6, 10),
        horizon=(0.3, 0.4), person_height=(0.42, 0.62), foreshorten=0.8, gain=0.75, cast=(1.15, 1.0, 0.85),
        vignette=0.35, noise=8.0, blur=0.6, colour_jitter=8.0, occluder_prob=0.3, bedding=(170, 160, 150),
        pose_mix=_mix(lying=0.25, standing=0.2, walking=0.2, bending=0.15, sitting=0.1, arms_raised=0.1),
    ),
)

PUBLIC_STYLE = SiteStyle(
    name="public", wall=(170, 176, 182), floor=(120, 128, 136), floor_pattern="tiles",
    palette=((40, 120, 220), (180, 130, 90), (90, 160, 90), (60, 60, 60), (200, 200, 200), (150, 100, 160),
             (120, 170, 220), (70, 90, 120)),
    furniture=("window", "door", "poster", "plant", "chair", "cabinet", "bars", "mat"), clutter=(3, 9),
    horizon=(0.3, 0.6), person_height=(0.45, 0.82), foreshorten=0.95, gain=1.0, cast=(1.0, 1.0, 1.0),
    vignette=0.1, noise=3.0, blur=0.2, colour_jitter=70.0, occluder_prob=0.25, bedding=(200, 200, 200),
    pose_mix=_mix(standing=1, walking=1, sitting=1, lying=1, bending=1, arms_raised=1),
)

# A public set from another domain (the study's domain-shift ablation, ``data.synth.public_style: shifted``):
# a dim, noisy, low-mounted camera in a gym-like room, people large in frame, mostly upright and active.
SHIFTED_PUBLIC_STYLE = SiteStyle(
    name="public-shifted", wall=(70, 80, 60), floor=(50, 60, 90), floor_pattern="wood",
    palette=((30, 30, 140), (20, 90, 160), (120, 60, 30), (40, 40, 40), (90, 90, 90), (30, 110, 60)),
    furniture=("bars", "mat", "door", "poster"), clutter=(1, 4),
    horizon=(0.5, 0.75), person_height=(0.65, 0.95), foreshorten=1.0, gain=0.6, cast=(0.85, 1.0, 1.2),
    vignette=0.35, noise=9.0, blur=0.8, colour_jitter=40.0, occluder_prob=0.1, bedding=(150, 150, 150),
    pose_mix=_mix(standing=3, walking=3, sitting=0.5, lying=0.2, bending=2, arms_raised=3),
)
PUBLIC_STYLES = {"public": PUBLIC_STYLE, "shifted": SHIFTED_PUBLIC_STYLE}


def _jitter_colour(colour: Colour, rng: np.random.Generator, amount: float) -> Colour:
    shifted = np.asarray(colour, dtype=np.float64) + rng.normal(0.0, amount / 2.0) + rng.normal(0.0, amount / 3.0, 3)
    return tuple(int(v) for v in np.clip(shifted, 0, 255))  # type: ignore[return-value]


def site_style(index: int) -> SiteStyle:
    """Style of site ``index``: four hand-made presets, then deterministic variations of them."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"site index must be an int >= 0, got {index!r}")
    base = _SITE_PRESETS[index % len(_SITE_PRESETS)]
    if index < len(_SITE_PRESETS):
        return dataclasses.replace(base, name=f"site-{index}-{base.name}")
    rng = _derive_rng(0, "site-style", index)
    lo, hi = base.person_height
    shift = float(rng.uniform(-0.06, 0.06))
    return dataclasses.replace(
        base,
        name=f"site-{index}-{base.name}",
        wall=_jitter_colour(base.wall, rng, 60),
        floor=_jitter_colour(base.floor, rng, 60),
        palette=tuple(_jitter_colour(c, rng, 50) for c in base.palette),
        floor_pattern=str(rng.choice(FLOOR_PATTERNS)),
        person_height=(round(max(0.3, lo + shift), 3), round(min(0.9, hi + shift), 3)),
        gain=round(float(np.clip(base.gain * rng.uniform(0.8, 1.2), 0.4, 1.4)), 3),
        noise=round(float(np.clip(base.noise + rng.uniform(-2, 3), 0.5, 12)), 2),
        cast=tuple(round(float(c), 3) for c in rng.uniform(0.85, 1.15, 3)),  # type: ignore[arg-type]
    )
