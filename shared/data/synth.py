"""Synthetic ward: procedural people in hospital-like rooms, written in the MPII json layout.

No pose dataset can be downloaded here, so the default runs on this one
(DESIGN.md section 5). What it has to provide, and how:

- Plausible articulated people: a small 3-d kinematic model (hip/knee/
  shoulder/elbow angles, torso bend, lean and twist, body yaw) posed within
  anatomical ranges for six kinds (``POSE_KINDS``), projected
  orthographically and drawn with anti-aliased OpenCV primitives in depth
  order. Joints follow ``shared.data.joints`` and MPII's annotation habits
  (thorax on the shoulder line, upper neck a tenth of the way to the crown).
- Non-IID sites: each ``SiteStyle`` fixes wall/floor palette, furniture,
  camera height (person size, vertical foreshortening), lighting, sensor
  noise, camera blur and the mix of poses (an ICU has people in bed, a
  rehab gym has people walking). ``PUBLIC_STYLE`` is a generic, more varied
  look for the public split.
- Identity cues for privacy attacks: skin tone, hair colour and style, face
  pattern (glasses, beard, mask), clothing colours/patterns, wristband and
  sock colours, build. Each person appears in ``images_per_identity`` images;
  ``identities.json`` names the person of every record.
- Fine detail that blur destroys: limbs 1-3 px wide at 128 px, 1-2 px
  bright markers at wrists, ankles, elbows and knees, thin-line clutter
  (IV poles, cables, bars) and small bright dots in a background of similar
  colours. Once blurred, limbs melt into the clutter and markers vanish, so
  training on psi(x) alone localizes worse than on raw pixels.
- Determinism: every random draw comes from an rng derived from (seed, split,
  purpose, index) by hashing, so image i of a split does not depend on any
  other image or split and the same spec gives byte-identical files.

Images are BGR uint8 (OpenCV order) throughout. Coordinates in memory are
0-based pixels; on disk they follow the MPII json convention (1-based,
scale = box / 1.25 / 200, see ``shared.data.mpii``), written by the inverse
of the reader's conversion so a round trip returns the same numbers.
"""

from __future__ import annotations

import colorsys
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from shared.data.joints import NUM_JOINTS
from shared.data.mpii import box_to_json
from shared.data.records import PIXEL_STD, PoseRecord, inside

log = logging.getLogger(__name__)

FORMAT = "fedpose-synthetic-ward"
FORMAT_VERSION = 1  # on-disk layout
RENDER_VERSION = 1  # bump whenever the same spec would produce different pixels or labels

POSE_KINDS: tuple[str, ...] = ("standing", "walking", "sitting", "lying", "bending", "arms_raised")
FURNITURE: tuple[str, ...] = (
    "window", "cabinet", "monitor", "iv_pole", "curtain", "bed", "bars", "chair", "door", "poster",
    "plant", "cart", "mat",
)
FLOOR_PATTERNS: tuple[str, ...] = ("tiles", "wood", "checker", "plain")
HAIR_STYLES: tuple[str, ...] = ("short", "long", "bald", "bun", "cap")
SHIRT_PATTERNS: tuple[str, ...] = ("solid", "hstripes", "vstripes", "dots")
FACES: tuple[str, ...] = ("plain", "glasses", "beard", "mask")

Colour = tuple[int, int, int]  # BGR, 0..255

# Joint indices (see shared.data.joints).
R_ANKLE, R_KNEE, R_HIP, L_HIP, L_KNEE, L_ANKLE, PELVIS, THORAX, NECK, HEAD_TOP = range(10)
R_WRIST, R_ELBOW, R_SHOULDER, L_SHOULDER, L_ELBOW, L_WRIST = range(10, 16)

# Body proportions in units of standing height (ankle to crown ~ 1).
_DIMS = {
    "hip_half": 0.085, "hip_drop": 0.02, "thigh": 0.245, "shin": 0.25, "spine": 0.30,
    "shoulder_half": 0.115, "shoulder_drop": 0.012, "upper_arm": 0.18, "forearm": 0.15, "head": 0.185,
}
NECK_FRACTION = 0.1  # upper neck: this fraction of the way from thorax to head top (MPII habit)
CHIN_FRACTION = 0.33  # the head ellipse spans chin .. crown along thorax -> head top


# --------------------------------------------------------------------------- styles, identities, spec


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


@dataclass(frozen=True)
class Identity:
    """Appearance of one person; everything an identity attack could latch on to. Colours BGR."""

    skin: Colour
    hair: Colour
    hair_style: str
    face: str
    accessory: Colour  # glasses frame or mask colour
    shirt: Colour
    shirt_pattern: str
    pattern: Colour
    sleeves_long: bool
    pants: Colour
    shorts: bool
    shoes: Colour
    cuff: Colour  # wristband (wrist marker)
    socks: Colour  # ankle marker
    badge: bool
    build: float  # body width factor

    def __post_init__(self) -> None:
        for name in ("skin", "hair", "accessory", "shirt", "pattern", "pants", "shoes", "cuff", "socks"):
            _check_colour(getattr(self, name), f"Identity.{name}")
        if self.hair_style not in HAIR_STYLES:
            raise ValueError(f"Identity.hair_style must be one of {HAIR_STYLES}, got {self.hair_style!r}")
        if self.face not in FACES:
            raise ValueError(f"Identity.face must be one of {FACES}, got {self.face!r}")
        if self.shirt_pattern not in SHIRT_PATTERNS:
            raise ValueError(f"Identity.shirt_pattern must be one of {SHIRT_PATTERNS}, got {self.shirt_pattern!r}")
        if not 0.7 <= self.build <= 1.4:
            raise ValueError(f"Identity.build must be in [0.7, 1.4], got {self.build}")


_SKIN = np.array(
    [(196, 214, 242), (150, 182, 228), (112, 150, 200), (80, 112, 160), (52, 76, 118), (36, 50, 80)], float
)
_HAIR = ((22, 20, 24), (30, 44, 70), (44, 74, 116), (110, 176, 214), (40, 68, 150), (160, 160, 166), (214, 214, 220))
_BRIGHT = ((255, 255, 255), (0, 230, 255), (255, 255, 0), (0, 140, 255), (255, 0, 255), (0, 255, 128), (60, 60, 255))


def _hsv(h: float, s: float, v: float) -> Colour:
    r, g, b = colorsys.hsv_to_rgb(h % 1.0, s, v)
    return (int(b * 255), int(g * 255), int(r * 255))


def make_identity(rng: np.random.Generator) -> Identity:
    """A random person's appearance."""
    t = rng.uniform(0, len(_SKIN) - 1)
    i = int(t)
    skin = _SKIN[i] + (_SKIN[min(i + 1, len(_SKIN) - 1)] - _SKIN[i]) * (t - i)

    def cloth() -> Colour:
        kind = rng.random()
        if kind < 0.2:  # scrubs / gowns
            hue = rng.choice([0.33, 0.5, 0.58, 0.62]) + rng.normal(0, 0.02)
            return _hsv(hue, rng.uniform(0.25, 0.6), rng.uniform(0.45, 0.85))
        if kind < 0.4:  # greys, black, white
            v = rng.uniform(0.1, 0.95)
            return (int(v * 255),) * 3  # type: ignore[return-value]
        return _hsv(rng.random(), rng.uniform(0.2, 0.95), rng.uniform(0.25, 0.95))

    shirt = cloth()
    return Identity(
        skin=tuple(int(c) for c in np.clip(skin + rng.normal(0, 6, 3), 0, 255)),  # type: ignore[arg-type]
        hair=_HAIR[int(rng.integers(len(_HAIR)))],
        hair_style=str(rng.choice(HAIR_STYLES, p=[0.38, 0.27, 0.1, 0.12, 0.13])),
        face=str(rng.choice(FACES, p=[0.45, 0.22, 0.15, 0.18])),
        accessory=cloth() if rng.random() < 0.5 else _BRIGHT[int(rng.integers(len(_BRIGHT)))],
        shirt=shirt,
        shirt_pattern=str(rng.choice(SHIRT_PATTERNS, p=[0.5, 0.2, 0.15, 0.15])),
        pattern=cloth(),
        sleeves_long=bool(rng.random() < 0.5),
        pants=cloth(),
        shorts=bool(rng.random() < 0.15),
        shoes=cloth(),
        cuff=_BRIGHT[int(rng.integers(len(_BRIGHT)))],
        socks=_BRIGHT[int(rng.integers(len(_BRIGHT)))],
        badge=bool(rng.random() < 0.3),
        build=float(np.round(rng.uniform(0.82, 1.25), 3)),
    )


@dataclass(frozen=True)
class WardSpec:
    """What to generate (also the ``data.synth`` section of the config).

    sites: number of private sites (splits site-0 .. site-{sites-1});
    per_site / public / val: images per split (val is spread evenly over the
    site styles, with people that appear nowhere else); images_per_identity:
    consecutive images of a split showing the same person.
    """

    sites: int = 3
    per_site: int = 400
    public: int = 600
    val: int = 240
    seed: int = 0
    image_size: int = 128
    images_per_identity: int = 8

    def __post_init__(self) -> None:
        for name in ("sites", "per_site", "public", "val", "seed", "image_size", "images_per_identity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"WardSpec.{name} must be an int, got {value!r}")
        for name in ("sites", "per_site", "public", "val", "images_per_identity"):
            if getattr(self, name) < 1:
                raise ValueError(f"WardSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise ValueError(f"WardSpec.seed must be >= 0, got {self.seed}")
        if not 32 <= self.image_size <= 1024:
            raise ValueError(f"WardSpec.image_size must be in [32, 1024] px, got {self.image_size}")

    def splits(self) -> dict[str, int]:
        """Split name -> image count."""
        return {"public": self.public, "val": self.val, **{f"site-{i}": self.per_site for i in range(self.sites)}}


def _derive_rng(seed: int, *key: object) -> np.random.Generator:
    """Generator determined by (seed, key...) only: stable across processes and Python versions."""
    text = "/".join(str(k) for k in (seed, *key))
    digest = hashlib.sha256(text.encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


# --------------------------------------------------------------------------- poses


def _rx(deg: float) -> np.ndarray:
    """Rotation about the body's left axis; positive tips 'up' (0, -1, 0) forward (+z)."""
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return np.array([[1, 0, 0], [0, c, s], [0, -s, c]])


def _ry(deg: float) -> np.ndarray:
    """Yaw about the vertical; positive turns the person's front (+z) towards image right (+x)."""
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])


def _rz(deg: float) -> np.ndarray:
    """Roll in the image plane; positive tips 'up' (0, -1) towards +x."""
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


def _limb_dir(abduction: float, flexion: float, side: int) -> np.ndarray:
    """Unit vector of a limb hanging down (0, 1, 0), abducted sideways then flexed forward."""
    a, f = math.radians(abduction), math.radians(flexion)
    return np.array([side * math.sin(a), math.cos(a) * math.cos(f), math.cos(a) * math.sin(f)])


def _bent(upper: np.ndarray, angle: float, prefer: np.ndarray) -> np.ndarray:
    """Distal segment direction: ``upper`` turned by ``angle`` degrees towards ``prefer``."""
    w = prefer - (prefer @ upper) * upper
    norm = np.linalg.norm(w)
    if norm < 1e-6:
        w = np.array([0.0, 0.0, 1.0]) - upper[2] * upper
        norm = np.linalg.norm(w)
    w /= norm
    a = math.radians(angle)
    return math.cos(a) * upper + math.sin(a) * w


def _u(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(rng.uniform(lo, hi))


def _sample_angles(kind: str, rng: np.random.Generator) -> dict[str, float]:
    """Joint angles in degrees within plausible ranges for the pose kind."""
    a: dict[str, float] = {
        "bend": _u(rng, -4, 8), "lean": _u(rng, -5, 5), "twist": _u(rng, -10, 10),
        "head_pitch": _u(rng, -12, 18), "head_roll": _u(rng, -10, 10), "roll": _u(rng, -5, 5),
    }
    for side in ("r", "l"):
        a.update({
            f"{side}_hip_flex": _u(rng, -5, 10), f"{side}_hip_abd": _u(rng, 0, 9), f"{side}_knee": _u(rng, 0, 10),
            f"{side}_sh_flex": _u(rng, -15, 25), f"{side}_sh_abd": _u(rng, 4, 22), f"{side}_elbow": _u(rng, 0, 40),
            f"{side}_elbow_up": _u(rng, 0.0, 1.0),
        })
    r = rng.random()
    if r < 0.65:  # facing the camera, more or less
        a["yaw"] = _u(rng, -60, 60)
    elif r < 0.9:  # profile
        a["yaw"] = _u(rng, 60, 100) * rng.choice([-1, 1])
    else:  # back to the camera
        a["yaw"] = _u(rng, 150, 210)
    if kind == "standing":
        pass
    elif kind == "walking":
        front, back = ("r", "l") if rng.random() < 0.5 else ("l", "r")
        stride = _u(rng, 14, 30)
        a.update({f"{front}_hip_flex": stride, f"{front}_knee": _u(rng, 0, 15),
                  f"{back}_hip_flex": -_u(rng, 8, 22), f"{back}_knee": _u(rng, 15, 50),
                  f"{front}_sh_flex": -_u(rng, 8, 25), f"{back}_sh_flex": _u(rng, 10, 32),
                  f"{front}_elbow": _u(rng, 5, 30), f"{back}_elbow": _u(rng, 15, 55), "bend": _u(rng, 0, 8)})
        a["yaw"] = _u(rng, 40, 100) * rng.choice([-1, 1]) if rng.random() < 0.75 else _u(rng, -40, 40)
    elif kind == "sitting":
        for side in ("r", "l"):
            flex = _u(rng, 75, 100)
            a.update({f"{side}_hip_flex": flex, f"{side}_hip_abd": _u(rng, 0, 14),
                      f"{side}_knee": flex + _u(rng, -20, 25), f"{side}_sh_flex": _u(rng, 10, 55),
                      f"{side}_elbow": _u(rng, 30, 100)})
        a["bend"] = _u(rng, -14, 10)
        a["yaw"] = _u(rng, -80, 80)
    elif kind == "lying":
        knees_up = rng.random() < 0.3
        for side in ("r", "l"):
            flex = _u(rng, 20, 50) if knees_up else _u(rng, -4, 10)
            a.update({f"{side}_hip_flex": flex, f"{side}_hip_abd": _u(rng, 0, 14),
                      f"{side}_knee": 2 * flex if knees_up else _u(rng, 0, 12),
                      f"{side}_sh_abd": _u(rng, 5, 45), f"{side}_sh_flex": _u(rng, -10, 40),
                      f"{side}_elbow": _u(rng, 0, 100)})
        a.update({"bend": 0.0, "lean": _u(rng, -4, 4), "head_pitch": _u(rng, -15, 10)})
        a["yaw"] = _u(rng, 70, 95) * rng.choice([-1, 1]) if rng.random() < 0.25 else _u(rng, -20, 20)
        # Head to the left or right of the image, bed roughly level.
        a["roll"] = rng.choice([-90.0, 90.0]) + _u(rng, -12, 12)
    elif kind == "bending":
        bend = _u(rng, 40, 95)
        knee = _u(rng, 0, 30)
        for side in ("r", "l"):
            a.update({f"{side}_hip_flex": knee * 0.5 + _u(rng, -3, 3), f"{side}_knee": knee,
                      f"{side}_sh_flex": bend + _u(rng, -20, 25), f"{side}_sh_abd": _u(rng, 0, 15),
                      f"{side}_elbow": _u(rng, 0, 35)})
        a.update({"bend": bend, "head_pitch": _u(rng, -30, 0)})
        a["yaw"] = _u(rng, 45, 100) * rng.choice([-1, 1]) if rng.random() < 0.75 else _u(rng, -30, 30)
    elif kind == "arms_raised":
        sides = ("r", "l") if rng.random() < 0.7 else (("r",) if rng.random() < 0.5 else ("l",))
        for side in sides:
            if rng.random() < 0.5:
                a.update({f"{side}_sh_abd": _u(rng, 100, 175), f"{side}_sh_flex": _u(rng, -10, 20)})
            else:
                a.update({f"{side}_sh_abd": _u(rng, 5, 30), f"{side}_sh_flex": _u(rng, 110, 175)})
            a[f"{side}_elbow"] = _u(rng, 0, 70)
    else:
        raise ValueError(f"unknown pose kind {kind!r}; choose from {POSE_KINDS}")
    return a


def _assemble(a: dict[str, float], dims: dict[str, float]) -> np.ndarray:
    """Angles -> (16, 3) joints in the body frame (x = person's left, y down, z forward), pelvis at 0."""
    p = np.zeros((NUM_JOINTS, 3))
    for side, s, hip_i, knee_i, ankle_i in (("r", -1, R_HIP, R_KNEE, R_ANKLE), ("l", 1, L_HIP, L_KNEE, L_ANKLE)):
        flex, abd, knee = a[f"{side}_hip_flex"], a[f"{side}_hip_abd"], a[f"{side}_knee"]
        p[hip_i] = (s * dims["hip_half"], dims["hip_drop"], 0.0)
        p[knee_i] = p[hip_i] + dims["thigh"] * _limb_dir(abd, flex, s)
        p[ankle_i] = p[knee_i] + dims["shin"] * _limb_dir(abd, flex - knee, s)
    torso = _rx(a["bend"]) @ _rz(a["lean"]) @ _ry(a["twist"])
    p[THORAX] = torso @ (0.0, -dims["spine"], 0.0)
    for side, s, sh_i, el_i, wr_i in (("r", -1, R_SHOULDER, R_ELBOW, R_WRIST), ("l", 1, L_SHOULDER, L_ELBOW, L_WRIST)):
        upper = _limb_dir(a[f"{side}_sh_abd"], a[f"{side}_sh_flex"], s)
        fore = _bent(upper, a[f"{side}_elbow"], np.array([0.0, -a[f"{side}_elbow_up"], 1.0]))
        p[sh_i] = torso @ (s * dims["shoulder_half"], -dims["spine"] + dims["shoulder_drop"], 0.0)
        p[el_i] = p[sh_i] + dims["upper_arm"] * (torso @ upper)
        p[wr_i] = p[el_i] + dims["forearm"] * (torso @ fore)
    head_dir = torso @ _rx(a["head_pitch"]) @ _rz(a["head_roll"]) @ np.array([0.0, -1.0, 0.0])
    p[HEAD_TOP] = p[THORAX] + dims["head"] * head_dir
    p[NECK] = p[THORAX] + NECK_FRACTION * dims["head"] * head_dir
    return p


def sample_pose_3d(kind: str, rng: np.random.Generator) -> np.ndarray:
    """(16, 3) joints of a random pose: x right, y down (image plane), z towards the camera.

    Canonical frame: pelvis at the origin, units of standing height. The x, y
    part is what the camera sees (orthographic); z orders the drawing.
    """
    if kind not in POSE_KINDS:
        raise ValueError(f"unknown pose kind {kind!r}; choose from {POSE_KINDS}")
    angles = _sample_angles(kind, rng)
    dims = {k: v * float(rng.uniform(0.96, 1.04)) for k, v in _DIMS.items()}
    body = _assemble(angles, dims)
    return body @ (_rz(angles["roll"]) @ _ry(angles["yaw"])).T


def sample_pose(kind: str, rng: np.random.Generator) -> np.ndarray:
    """(16, 2) float32 joints of a random pose in the canonical frame (see ``sample_pose_3d``)."""
    return sample_pose_3d(kind, rng)[:, :2].astype(np.float32)


def place_pose(
    pose: np.ndarray, *, kind: str, style: SiteStyle, size: int, rng: np.random.Generator
) -> np.ndarray:
    """Canonical (16, 2+) pose -> (16, 2) float32 pixel joints inside a size x size frame.

    The person's standing height is ``style.person_height`` of the frame,
    squashed vertically by ``style.foreshorten``; upright people stand with
    their feet below the floor line.
    """
    pts = np.asarray(pose, dtype=np.float64)[:, :2].copy()
    height = size * _u(rng, *style.person_height)
    pts *= height
    pts[:, 1] *= style.foreshorten
    margin = max(3.0, 0.06 * height)
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    extent = hi - lo
    room = size - 2 * margin
    if extent.max() > room:
        shrink = room / extent.max()
        pts *= shrink
        lo, hi, extent = lo * shrink, hi * shrink, extent * shrink
    x0 = _u(rng, margin, size - margin - extent[0])
    y_min, y_max = margin, size - margin - extent[1]
    if kind != "lying":
        floor = style.horizon[1] * size + 0.04 * size  # feet on the floor, below the wall
        y_min = min(max(y_min, floor - extent[1]), y_max)
    else:
        y_min = min(max(y_min, 0.3 * size), y_max)
    y0 = _u(rng, y_min, y_max)
    return (pts - lo + (x0, y0)).astype(np.float32)


# --------------------------------------------------------------------------- drawing helpers

_SHIFT = 4
_ONE = 1 << _SHIFT


def _pt(p: Sequence[float]) -> tuple[int, int]:
    return (int(round(float(p[0]) * _ONE)), int(round(float(p[1]) * _ONE)))


def _poly(points: np.ndarray) -> np.ndarray:
    return np.round(np.asarray(points, dtype=np.float64) * _ONE).astype(np.int32).reshape(-1, 1, 2)


def _line(img: np.ndarray, a: Sequence[float], b: Sequence[float], colour: Colour, thickness: int) -> None:
    cv2.line(img, _pt(a), _pt(b), colour, max(1, int(thickness)), cv2.LINE_AA, _SHIFT)


def _disc(img: np.ndarray, c: Sequence[float], radius: float, colour: Colour) -> None:
    cv2.circle(img, _pt(c), max(1, int(round(radius * _ONE))), colour, -1, cv2.LINE_AA, _SHIFT)


def _fill(img: np.ndarray, points: np.ndarray, colour: Colour) -> None:
    cv2.fillPoly(img, [_poly(points)], colour, cv2.LINE_AA, _SHIFT)


def _ellipse(img: np.ndarray, c: Sequence[float], axes: Sequence[float], angle: float, colour: Colour,
             thickness: int = -1, start: float = 0.0, end: float = 360.0) -> None:
    ax = (max(1, int(round(axes[0] * _ONE))), max(1, int(round(axes[1] * _ONE))))
    cv2.ellipse(img, _pt(c), ax, float(angle), float(start), float(end), colour, thickness, cv2.LINE_AA, _SHIFT)


def _rect(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, colour: Colour, thickness: int = -1) -> None:
    cv2.rectangle(img, _pt((x0, y0)), _pt((x1, y1)), colour, thickness, cv2.LINE_AA, _SHIFT)


def _shade(colour: Colour, factor: float, add: float = 0.0) -> Colour:
    return tuple(int(min(255, max(0, c * factor + add))) for c in colour)  # type: ignore[return-value]


def _pick(rng: np.random.Generator, palette: Sequence[Colour]) -> Colour:
    return palette[int(rng.integers(len(palette)))]


# --------------------------------------------------------------------------- background


def render_background(style: SiteStyle, size: int, rng: np.random.Generator) -> np.ndarray:
    """(size, size, 3) uint8 BGR room: wall, floor pattern, furniture and fine clutter."""
    jit = style.colour_jitter
    wall = _jitter_colour(style.wall, rng, jit)
    floor = _jitter_colour(style.floor, rng, jit)
    palette = [_jitter_colour(c, rng, jit * 0.5) for c in style.palette]
    img = np.empty((size, size, 3), np.uint8)
    horizon = _u(rng, *style.horizon) * size
    hy = int(horizon)
    # Wall with a soft vertical gradient, floor below the horizon.
    ramp = np.linspace(1.08, 0.92, max(hy, 1))[:, None, None]
    img[:hy] = np.clip(np.asarray(wall, np.float32) * ramp, 0, 255).astype(np.uint8)
    img[hy:] = floor
    _draw_floor(img, style.floor_pattern, floor, horizon, size, rng)
    # Skirting board / handrail: long thin horizontal lines.
    _line(img, (0, horizon), (size, horizon), _shade(wall, 0.6), max(1, size // 96))
    if rng.random() < 0.6:
        y = horizon - _u(rng, 0.12, 0.25) * size
        _line(img, (0, y), (size, y), _pick(rng, palette), 1)
    n_items = int(rng.integers(style.clutter[0], style.clutter[1] + 1))
    for _ in range(n_items):
        kind = style.furniture[int(rng.integers(len(style.furniture)))]
        _draw_furniture(img, kind, horizon, size, palette, style.bedding, rng)
    # Fine clutter: short thin strokes and bright specks in the room's colours.
    for _ in range(int(rng.integers(3, 9))):
        x, y = rng.uniform(0, size, 2)
        length, angle = _u(rng, 0.03, 0.12) * size, _u(rng, 0, math.pi)
        _line(img, (x, y), (x + length * math.cos(angle), y + length * math.sin(angle)), _pick(rng, palette), 1)
    for _ in range(int(rng.integers(2, 6))):
        _disc(img, rng.uniform(0, size, 2), _u(rng, 0.5, 1.2) * size / 128, _BRIGHT[int(rng.integers(len(_BRIGHT)))])
    return img


def _draw_floor(img: np.ndarray, pattern: str, floor: Colour, horizon: float, size: int,
                rng: np.random.Generator) -> None:
    dark = _shade(floor, 0.8)
    if pattern == "tiles":
        vx = _u(rng, 0.2, 0.8) * size
        y, step = horizon, 0.03 * size
        while y < size:
            _line(img, (0, y), (size, y), dark, 1)
            y += step
            step *= 1.35
        for k in range(-8, 9):
            _line(img, (vx + k * 0.02 * size, horizon), (vx + k * 0.25 * size, size), dark, 1)
    elif pattern == "wood":
        y = horizon
        while y < size:
            h = _u(rng, 0.025, 0.05) * size
            _rect(img, 0, y, size, y + h, _shade(floor, _u(rng, 0.85, 1.15)))
            _line(img, (0, y), (size, y), _shade(floor, 0.6), 1)
            y += h
    elif pattern == "checker":
        alt = _shade(floor, 0.7)
        cell = _u(rng, 0.06, 0.1) * size
        ys = np.arange(horizon, size, cell * 0.6)
        for r, y in enumerate(ys):
            for c, x in enumerate(np.arange(-cell * ((r % 2) * 0.5), size, cell)):
                if (r + c) % 2 == 0:
                    _rect(img, x, y, x + cell, y + cell * 0.6, alt)
    else:  # plain with scuffs
        for _ in range(int(rng.integers(4, 10))):
            x, y = _u(rng, 0, size), _u(rng, horizon, size)
            _ellipse(img, (x, y), (_u(rng, 2, 10) * size / 128, _u(rng, 1, 3) * size / 128), _u(rng, -20, 20), dark)


def _draw_furniture(img: np.ndarray, kind: str, horizon: float, size: int, palette: Sequence[Colour],
                    bedding: Colour, rng: np.random.Generator) -> None:
    s = size / 128.0
    colour = _pick(rng, palette)
    edge = _shade(colour, 0.55)
    x = _u(rng, -0.1, 1.0) * size
    if kind == "window":
        w, h = _u(rng, 14, 34) * s, _u(rng, 12, 26) * s
        y = horizon - h - _u(rng, 4, 20) * s
        sky = _jitter_colour((235, 215, 180), rng, 30)
        _rect(img, x, y, x + w, y + h, sky)
        _rect(img, x, y, x + w, y + h, colour, max(1, int(s)))
        _line(img, (x + w / 2, y), (x + w / 2, y + h), colour, 1)
        _line(img, (x, y + h / 2), (x + w, y + h / 2), colour, 1)
    elif kind == "cabinet":
        w, h = _u(rng, 10, 24) * s, _u(rng, 14, 40) * s
        y1 = horizon + _u(rng, 0, 10) * s
        _rect(img, x, y1 - h, x + w, y1, colour)
        _rect(img, x, y1 - h, x + w, y1, edge, 1)
        for k in range(1, int(rng.integers(2, 4))):
            yy = y1 - h * k / 3
            _line(img, (x, yy), (x + w, yy), edge, 1)
            _disc(img, (x + w / 2, yy + 2 * s), 0.8 * s, _shade(colour, 1.5, 40))
    elif kind == "monitor":
        w, h = _u(rng, 10, 18) * s, _u(rng, 7, 12) * s
        y = horizon - _u(rng, 18, 40) * s
        _rect(img, x, y, x + w, y + h, (30, 30, 30))
        for k in range(int(rng.integers(1, 4))):
            yy = y + h * (k + 1) / 4
            trace = [(x + 1 + i * (w - 2) / 8, yy + rng.uniform(-1.5, 1.5) * s) for i in range(9)]
            cv2.polylines(img, [_poly(np.array(trace))], False, _BRIGHT[int(rng.integers(len(_BRIGHT)))], 1,
                          cv2.LINE_AA, _SHIFT)
        _line(img, (x + w / 2, y + h), (x + w / 2, y + h + _u(rng, 5, 25) * s), (90, 90, 90), 1)
    elif kind == "iv_pole":
        y1 = horizon + _u(rng, 2, 30) * s
        top = y1 - _u(rng, 50, 80) * s
        _line(img, (x, top), (x, y1), (170, 170, 175), 1)
        _line(img, (x - 4 * s, y1), (x + 4 * s, y1), (120, 120, 125), 1)
        _rect(img, x + 1 * s, top + 2 * s, x + 5 * s, top + 10 * s, _jitter_colour((220, 225, 215), rng, 20))
        _line(img, (x + 3 * s, top + 10 * s), (x + _u(rng, -10, 15) * s, y1 - _u(rng, 10, 30) * s), (200, 200, 200), 1)
    elif kind == "curtain":
        w = _u(rng, 12, 30) * s
        y1 = horizon + _u(rng, 10, 40) * s
        _rect(img, x, 0, x + w, y1, colour)
        for k in range(int(w / (3 * s)) + 1):
            xx = x + k * 3 * s
            _line(img, (xx, 0), (xx + rng.uniform(-1, 1) * s, y1), _shade(colour, 0.8), 1)
    elif kind == "bed":
        w, h = _u(rng, 30, 50) * s, _u(rng, 8, 14) * s
        y1 = horizon + _u(rng, 4, 25) * s
        _rect(img, x, y1 - h, x + w, y1 - h * 0.4, bedding)
        _rect(img, x, y1 - h, x + w, y1 - h * 0.4, _shade(bedding, 0.6), 1)
        _line(img, (x, y1 - h * 1.8), (x, y1), (110, 110, 115), max(1, int(s)))
        _line(img, (x + w, y1 - h * 1.2), (x + w, y1), (110, 110, 115), max(1, int(s)))
    elif kind == "bars":
        y = horizon + _u(rng, 0, 20) * s
        h, w = _u(rng, 18, 28) * s, _u(rng, 30, 70) * s
        for dy in (0, _u(rng, 4, 10) * s):
            _line(img, (x, y - h + dy), (x + w, y - h + dy), (170, 170, 170), 1)
            for xx in (x, x + w):
                _line(img, (xx, y - h + dy), (xx, y + dy), (140, 140, 140), 1)
    elif kind == "chair":
        w = _u(rng, 8, 14) * s
        y = horizon + _u(rng, 2, 25) * s
        _line(img, (x, y - w), (x + w, y - w), colour, max(1, int(2 * s)))
        _line(img, (x, y - w), (x, y - 2.2 * w), colour, max(1, int(2 * s)))
        _line(img, (x, y - w), (x, y), edge, 1)
        _line(img, (x + w, y - w), (x + w, y), edge, 1)
    elif kind == "door":
        w, h = _u(rng, 14, 22) * s, _u(rng, 40, 60) * s
        y1 = horizon + 2 * s
        _rect(img, x, y1 - h, x + w, y1, colour)
        _rect(img, x, y1 - h, x + w, y1, edge, 1)
        _disc(img, (x + w * 0.85, y1 - h * 0.45), 1.0 * s, _shade(colour, 1.6, 50))
    elif kind == "poster":
        w, h = _u(rng, 8, 16) * s, _u(rng, 10, 20) * s
        y = horizon - h - _u(rng, 6, 30) * s
        _rect(img, x, y, x + w, y + h, _jitter_colour((225, 230, 230), rng, 25))
        for _ in range(int(rng.integers(2, 5))):
            px, py = x + _u(rng, 1, w - 1), y + _u(rng, 1, h - 1)
            _line(img, (px, py), (px + _u(rng, -4, 4) * s, py + _u(rng, -4, 4) * s), _pick(rng, palette), 1)
    elif kind == "plant":
        y = horizon + _u(rng, 2, 20) * s
        _rect(img, x - 3 * s, y - 5 * s, x + 3 * s, y, _shade(colour, 0.8))
        for _ in range(int(rng.integers(4, 9))):
            _line(img, (x, y - 5 * s), (x + _u(rng, -8, 8) * s, y - _u(rng, 8, 18) * s),
                  _jitter_colour((60, 140, 60), rng, 30), 1)
    elif kind == "cart":
        w, h = _u(rng, 10, 18) * s, _u(rng, 12, 20) * s
        y1 = horizon + _u(rng, 5, 35) * s
        for k in range(3):
            yy = y1 - h + k * h / 2.2
            _line(img, (x, yy), (x + w, yy), colour, max(1, int(1.5 * s)))
        _line(img, (x, y1 - h), (x, y1), edge, 1)
        _line(img, (x + w, y1 - h), (x + w, y1), edge, 1)
        _disc(img, (x, y1 + s), 1.2 * s, (30, 30, 30))
        _disc(img, (x + w, y1 + s), 1.2 * s, (30, 30, 30))
    elif kind == "mat":
        w, h = _u(rng, 30, 60) * s, _u(rng, 4, 9) * s
        y = horizon + _u(rng, 8, 50) * s
        _fill(img, np.array([(x, y), (x + w, y), (x + w + 4 * s, y + h), (x - 4 * s, y + h)]), colour)


# --------------------------------------------------------------------------- person


def _body_unit(joints: np.ndarray) -> float:
    """Standing height in px implied by the joints (robust to foreshortened bones)."""
    pairs = ((R_HIP, R_KNEE, "thigh"), (L_HIP, L_KNEE, "thigh"), (R_KNEE, R_ANKLE, "shin"),
             (L_KNEE, L_ANKLE, "shin"), (PELVIS, THORAX, "spine"), (THORAX, HEAD_TOP, "head"),
             (R_SHOULDER, R_ELBOW, "upper_arm"), (L_SHOULDER, L_ELBOW, "upper_arm"))
    ratios = sorted(float(np.linalg.norm(joints[a] - joints[b])) / _DIMS[d] for a, b, d in pairs)
    return max(ratios[-3], 4.0)


def head_geometry(joints: np.ndarray) -> tuple[np.ndarray, tuple[float, float], float]:
    """Head ellipse (centre (2,), (half length along neck axis, half width), angle in degrees).

    The ellipse runs from the chin (a third of the way from thorax to head
    top) to the head top; its width is 0.8 of its length.
    """
    thorax, top = joints[THORAX].astype(np.float64), joints[HEAD_TOP].astype(np.float64)
    axis = top - thorax
    length = max(float(np.linalg.norm(axis)), 1e-3)
    centre = thorax + (CHIN_FRACTION + 1.0) / 2.0 * axis
    half_len = (1.0 - CHIN_FRACTION) / 2.0 * length
    angle = math.degrees(math.atan2(axis[1], axis[0]))
    return centre, (half_len, 0.8 * half_len), angle


def head_box(joints: np.ndarray) -> np.ndarray:
    """(2, 2) [[x1, y1], [x2, y2]] PCKh head box: square of side |head_top - upper_neck| around the head.

    MPII's head rectangles span roughly upper neck to crown, and PCKh's head
    size 0.6 x diagonal then equals about 0.85 of that segment. A square keeps
    the threshold independent of how the head is rotated (people in bed).
    """
    neck, top = joints[NECK].astype(np.float64), joints[HEAD_TOP].astype(np.float64)
    half = max(float(np.linalg.norm(top - neck)), 1e-3) / 2.0
    centre = (neck + top) / 2.0
    return np.stack([centre - half, centre + half]).astype(np.float32)


def _facing(joints: np.ndarray, depth: np.ndarray | None, rng: np.random.Generator) -> np.ndarray:
    """Unit 3-d vector the person faces (x right, y down, z to camera)."""
    if depth is not None:
        p = np.column_stack([joints, depth]).astype(np.float64)
        across = p[L_SHOULDER] - p[R_SHOULDER] + p[L_HIP] - p[R_HIP]
        down = p[PELVIS] - p[THORAX]
        f = np.cross(across, down)
        norm = np.linalg.norm(f)
        if norm > 1e-9:
            return f / norm
    # 2-d only: the shoulder order tells front from back; the profile side is a guess.
    across = joints[L_SHOULDER] - joints[R_SHOULDER]
    spine = joints[THORAX] - joints[PELVIS]
    width = float(np.linalg.norm(across)) / max(_body_unit(joints) * 2 * _DIMS["shoulder_half"], 1e-6)
    front = float(np.sign(across[0] * -spine[1] - across[1] * -spine[0]) or 1.0)
    z = front * min(width, 1.0)
    side = math.sqrt(max(0.0, 1 - z * z)) * (1 if rng.random() < 0.5 else -1)
    return np.array([side, 0.0, z])


def _torso_polygon(j: np.ndarray, unit: float, build: float) -> np.ndarray:
    spine = j[THORAX] - j[PELVIS]
    length = max(float(np.linalg.norm(spine)), 1e-6)
    perp = np.array([-spine[1], spine[0]]) / length
    min_top, min_bot = 0.075 * unit * build, 0.065 * unit * build
    top_mid = (j[R_SHOULDER] + j[L_SHOULDER]) / 2
    bot_mid = (j[R_HIP] + j[L_HIP]) / 2
    top_half = max(abs(float(perp @ (j[L_SHOULDER] - j[R_SHOULDER]))) / 2 + 0.01 * unit, min_top)
    bot_half = max(abs(float(perp @ (j[L_HIP] - j[R_HIP]))) / 2 + 0.02 * unit, min_bot)
    waist_mid = top_mid + 0.65 * (bot_mid - top_mid)
    waist_half = 0.88 * min(top_half, bot_half * 1.1)
    return np.array([
        top_mid + perp * top_half, waist_mid + perp * waist_half, bot_mid + perp * bot_half,
        bot_mid - perp * bot_half, waist_mid - perp * waist_half, top_mid - perp * top_half,
    ])


def _patterned_fill(img: np.ndarray, polygon: np.ndarray, base: Colour, pattern: str, colour: Colour,
                    axis: np.ndarray, unit: float) -> None:
    _fill(img, polygon, base)
    if pattern == "solid":
        return
    h, w = img.shape[:2]
    x0, y0 = np.floor(polygon.min(axis=0)).astype(int) - 1
    x1, y1 = np.ceil(polygon.max(axis=0)).astype(int) + 2
    x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, w), min(y1, h)
    if x1 - x0 < 2 or y1 - y0 < 2:
        return
    roi = img[y0:y1, x0:x1]
    mask = np.zeros(roi.shape[:2], np.uint8)
    cv2.fillPoly(mask, [_poly(polygon - (x0, y0))], 255, cv2.LINE_8, _SHIFT)
    layer = roi.copy()
    step = max(2.0, 0.035 * unit)
    along = axis / max(float(np.linalg.norm(axis)), 1e-6)
    across = np.array([-along[1], along[0]])
    centre = (polygon.mean(axis=0) - (x0, y0))
    reach = float(max(x1 - x0, y1 - y0))
    if pattern in ("hstripes", "vstripes"):
        direction, offset_dir = (across, along) if pattern == "hstripes" else (along, across)
        for k in np.arange(-reach, reach, step):
            c = centre + offset_dir * k
            _line(layer, c - direction * reach, c + direction * reach, colour, 1)
    else:  # dots
        for u in np.arange(-reach, reach, step * 1.3):
            for v in np.arange(-reach, reach, step * 1.3):
                _disc(layer, centre + along * u + across * v, 0.5, colour)
    roi[mask > 0] = layer[mask > 0]


def _segment_parts(j: np.ndarray, ident: Identity, unit: float) -> dict[str, list[tuple]]:
    """Drawable parts: name -> list of (kind, args) primitives, limbs thin on purpose."""
    b = ident.build
    t_thigh = max(1, round(0.03 * unit * b))
    t_shin = max(1, round(0.022 * unit * b))
    t_upper = max(1, round(0.021 * unit * b))
    t_fore = max(1, round(0.015 * unit * b))
    shin_colour = ident.skin if ident.shorts else ident.pants
    fore_colour = ident.shirt if ident.sleeves_long else ident.skin
    marker = max(0.6, 0.011 * unit)
    parts: dict[str, list[tuple]] = {}
    for name, hip, knee, ankle in (("leg_r", R_HIP, R_KNEE, R_ANKLE), ("leg_l", L_HIP, L_KNEE, L_ANKLE)):
        parts[name] = [
            ("line", j[hip], j[knee], ident.pants, t_thigh),
            ("line", j[knee], j[ankle], shin_colour, t_shin),
            ("disc", j[knee], marker, _shade(ident.pants, 1.3, 45)),  # knee patch
            ("foot", ankle, knee),
            ("disc", j[ankle], marker * 1.1, ident.socks),  # sock band
        ]
    for name, sh, el, wr in (("arm_r", R_SHOULDER, R_ELBOW, R_WRIST), ("arm_l", L_SHOULDER, L_ELBOW, L_WRIST)):
        parts[name] = [
            ("line", j[sh], j[el], ident.shirt, t_upper),
            ("line", j[el], j[wr], fore_colour, t_fore),
            ("disc", j[el], marker, _shade(ident.shirt, 1.25, 50)),  # elbow patch
            ("hand", wr, el),
            ("disc", j[wr], marker, ident.cuff),  # wristband
        ]
    return parts


def _draw_primitives(img: np.ndarray, prims: list[tuple], j: np.ndarray, ident: Identity, unit: float,
                     facing: np.ndarray) -> None:
    for prim in prims:
        kind = prim[0]
        if kind == "line":
            _line(img, prim[1], prim[2], prim[3], prim[4])
        elif kind == "disc":
            _disc(img, prim[1], prim[2], prim[3])
        elif kind == "hand":
            wr, el = j[prim[1]], j[prim[2]]
            d = wr - el
            d = d / max(float(np.linalg.norm(d)), 1e-6)
            _disc(img, wr + d * 0.03 * unit, max(0.8, 0.018 * unit), ident.skin)
        elif kind == "foot":
            ankle, knee = j[prim[1]], j[prim[2]]
            shin = ankle - knee
            shin = shin / max(float(np.linalg.norm(shin)), 1e-6)
            forward = facing[:2]
            reach = float(np.linalg.norm(forward))
            toe = ankle + shin * 0.025 * unit
            if reach > 0.2:  # profile-ish: the foot points where the person faces
                toe = toe + forward / reach * min(reach, 1.0) * 0.05 * unit
            _line(img, ankle + shin * 0.01 * unit, toe, ident.shoes, max(1, round(0.025 * unit)))


def _draw_head(img: np.ndarray, j: np.ndarray, ident: Identity, unit: float, facing: np.ndarray) -> None:
    centre, (a, b), angle = head_geometry(j)
    axis = np.array([math.cos(math.radians(angle)), math.sin(math.radians(angle))])  # towards the crown
    across = np.array([-axis[1], axis[0]])
    side = float(facing[:2] @ across)  # > 0: face turned towards +across
    front = float(facing[2])
    hair = (210, 170, 120) if ident.hair_style == "cap" else ident.hair
    neck_top = j[THORAX] + (CHIN_FRACTION + 0.1) * (j[HEAD_TOP] - j[THORAX])
    _line(img, j[THORAX], neck_top, _shade(ident.skin, 0.92), max(1, round(0.035 * unit * ident.build)))
    if ident.hair_style == "long":
        _ellipse(img, centre - axis * 0.35 * a - across * side * 0.2 * b, (a * 1.25, b * 1.1), angle, hair)
    if ident.hair_style == "bald":
        _ellipse(img, centre, (a, b), angle, ident.skin)
    else:
        _ellipse(img, centre, (a, b), angle, hair)
        if front > -0.35:  # face visible: skin ellipse shifted to the chin and the facing side
            face_c = centre - axis * 0.2 * a + across * side * 0.22 * b
            _ellipse(img, face_c, (a * 0.78, b * (0.86 - 0.2 * abs(side))), angle, ident.skin)
    if ident.hair_style == "bun":
        _disc(img, centre + axis * 0.95 * a - across * side * 0.5 * b, 0.35 * b, hair)
    if front <= -0.35:
        return
    eye_up = centre + axis * 0.05 * a + across * side * 0.35 * b
    spread = 0.38 * b * max(front, 0.15)
    eyes = [eye_up + across * spread, eye_up - across * spread] if front > 0.35 else [eye_up + across * side * 0.3 * b]
    dot = max(0.45, 0.08 * b)
    for eye in eyes:
        _disc(img, eye, dot, (25, 25, 25))
    mouth = centre - axis * 0.5 * a + across * side * 0.4 * b
    if ident.face == "mask":
        _ellipse(img, centre - axis * 0.45 * a + across * side * 0.25 * b, (0.45 * a, 0.75 * b), angle, ident.accessory)
    else:
        if ident.face == "beard":
            _ellipse(img, centre - axis * 0.55 * a + across * side * 0.2 * b, (0.4 * a, 0.7 * b), angle,
                     _shade(ident.hair, 0.9))
        _line(img, mouth - across * 0.2 * b, mouth + across * 0.2 * b, (60, 60, 150), 1)
    if ident.face == "glasses" and len(eyes) == 2:
        _line(img, eyes[0], eyes[1], ident.accessory, 1)
        for eye in eyes:
            _disc(img, eye, dot * 1.2, ident.accessory)


def render_person(canvas: np.ndarray, joints: np.ndarray, identity: Identity, rng: np.random.Generator,
                  *, depth: np.ndarray | None = None) -> None:
    """Draw one person on ``canvas`` (H, W, 3 uint8 BGR, modified in place).

    joints: (16, 2) pixel coordinates. depth: optional (16,) z towards the
    camera from ``sample_pose_3d``; it orders limbs far to near and tells
    which way the face points. Without it limbs go legs, torso, arms, head
    and the face direction is guessed from the shoulder order. rng adds the
    per-frame shading of clothes (lighting on the person).
    """
    j = np.asarray(joints, dtype=np.float64)
    if j.shape != (NUM_JOINTS, 2) or not np.all(np.isfinite(j)):
        raise ValueError(f"render_person needs finite joints of shape ({NUM_JOINTS}, 2), got {j.shape}")
    if depth is not None and np.asarray(depth).shape != (NUM_JOINTS,):
        raise ValueError(f"depth must have shape ({NUM_JOINTS},), got {np.asarray(depth).shape}")
    ident = _lit(identity, rng)
    facing = _facing(j, depth, rng)
    _draw_body(canvas, j, ident, _body_unit(j), facing, depth, parts=None)


def _lit(identity: Identity, rng: np.random.Generator) -> Identity:
    """The identity under this frame's light on the clothes."""
    shade = float(rng.uniform(0.9, 1.1))
    return dataclasses.replace(identity, shirt=_shade(identity.shirt, shade), pants=_shade(identity.pants, shade))


_PART_JOINTS = {
    "leg_r": (R_HIP, R_KNEE, R_ANKLE), "leg_l": (L_HIP, L_KNEE, L_ANKLE),
    "arm_r": (R_SHOULDER, R_ELBOW, R_WRIST), "arm_l": (L_SHOULDER, L_ELBOW, L_WRIST),
    "torso": (R_SHOULDER, L_SHOULDER, R_HIP, L_HIP, PELVIS, THORAX),
}
_DEFAULT_ORDER = {"leg_r": 0.0, "leg_l": 0.0, "torso": 1.0, "arm_r": 2.0, "arm_l": 2.0}


def _draw_body(canvas: np.ndarray, j: np.ndarray, ident: Identity, unit: float, facing: np.ndarray,
               depth: np.ndarray | None, parts: Sequence[str] | None) -> None:
    prims = _segment_parts(j, ident, unit)
    names = list(_PART_JOINTS) if parts is None else list(parts)
    if depth is None:
        order = sorted(names, key=lambda n: _DEFAULT_ORDER[n])
    else:
        z = np.asarray(depth, dtype=np.float64) * unit
        # Legs start inside the torso outline: bias them back so hips do not cover the trunk.
        bias = {"leg_r": -0.04 * unit, "leg_l": -0.04 * unit, "torso": 0.0, "arm_r": 0.0, "arm_l": 0.0}
        order = sorted(names, key=lambda n: float(z[list(_PART_JOINTS[n])].mean()) + bias[n])
    for name in order:
        if name == "torso":
            polygon = _torso_polygon(j, unit, ident.build)
            _patterned_fill(canvas, polygon, ident.shirt, ident.shirt_pattern, ident.pattern,
                            j[THORAX] - j[PELVIS], unit)
            _line(canvas, j[R_HIP], j[L_HIP], ident.pants, max(1, round(0.05 * unit * ident.build)))
            if ident.badge and facing[2] > 0.3:
                chest = j[THORAX] + 0.3 * (j[PELVIS] - j[THORAX]) + 0.35 * (j[L_SHOULDER] - j[R_SHOULDER])
                _disc(canvas, chest, max(0.6, 0.012 * unit), (250, 250, 250))
        else:
            _draw_primitives(canvas, prims[name], j, ident, unit, facing)
    if parts is None:
        _draw_head(canvas, j, ident, unit, facing)


# --------------------------------------------------------------------------- scene


def _draw_bed(img: np.ndarray, j: np.ndarray, unit: float, bedding: Colour, rng: np.random.Generator) -> None:
    feet = (j[R_ANKLE] + j[L_ANKLE]) / 2
    axis = j[HEAD_TOP] - feet
    length = float(np.linalg.norm(axis))
    if length < 1e-6:
        return
    along = axis / length
    across = np.array([-along[1], along[0]])
    centre = (j[HEAD_TOP] + feet) / 2 + across * _u(rng, -0.03, 0.03) * unit
    half_l, half_w = length / 2 + 0.12 * unit, 0.16 * unit
    signs = ((1, 1), (1, -1), (-1, -1), (-1, 1))
    corners = np.array([centre + along * half_l * sl + across * half_w * sw for sl, sw in signs])
    frame = _jitter_colour((120, 124, 130), rng, 30)
    # Legs of the bed down to the floor, then frame, mattress and pillow.
    for corner in corners:
        _line(img, corner, corner + (0, 0.12 * unit), frame, max(1, round(0.015 * unit)))
    _fill(img, corners, _shade(bedding, 0.85))
    inner = centre + (corners - centre) * np.array([[0.96], [0.96], [0.96], [0.96]])
    _fill(img, inner, bedding)
    cv2.polylines(img, [_poly(corners)], True, frame, max(1, round(0.012 * unit)), cv2.LINE_AA, _SHIFT)
    head_end = centre + along * (half_l - 0.08 * unit)
    _ellipse(img, head_end, (0.06 * unit, 0.11 * unit), math.degrees(math.atan2(along[1], along[0])),
             _shade(bedding, 1.05, 15))


def _draw_blanket(img: np.ndarray, j: np.ndarray, unit: float, colour: Colour, rng: np.random.Generator,
                  chest: bool) -> None:
    pts = [j[i] for i in (R_ANKLE, L_ANKLE, R_KNEE, L_KNEE, R_HIP, L_HIP, PELVIS)]
    if chest:
        pts += [j[PELVIS] + 0.75 * (j[i] - j[PELVIS]) for i in (R_SHOULDER, L_SHOULDER)]
    margin = 0.06 * unit
    ring = np.array([(math.cos(t), math.sin(t)) for t in np.linspace(0, 2 * math.pi, 8, endpoint=False)]) * margin
    cloud = np.concatenate([p + ring for p in pts]).astype(np.float32)
    hull = cv2.convexHull(cloud).reshape(-1, 2)
    _fill(img, hull, colour)
    axis = j[THORAX] - j[PELVIS]
    along = axis / max(float(np.linalg.norm(axis)), 1e-6)
    pattern = _shade(colour, 0.8)
    lo, hi = hull.min(axis=0), hull.max(axis=0)
    for _ in range(int(rng.integers(2, 6))):  # folds
        p = rng.uniform(lo, hi)
        _line(img, p, p + along * _u(rng, -0.1, 0.1) * unit + np.array([-along[1], along[0]]) * 0.08 * unit, pattern, 1)


def _draw_chair(img: np.ndarray, j: np.ndarray, unit: float, colour: Colour) -> None:
    hips = (j[R_HIP] + j[L_HIP]) / 2
    knees = (j[R_KNEE] + j[L_KNEE]) / 2
    seat_y = float(max(j[R_HIP][1], j[L_HIP][1])) + 0.03 * unit
    xs = [j[i][0] for i in (R_HIP, L_HIP, R_KNEE, L_KNEE)]
    x0, x1 = min(xs) - 0.04 * unit, max(xs) + 0.04 * unit
    floor_y = float(max(j[R_ANKLE][1], j[L_ANKLE][1])) + 0.02 * unit
    t = max(1, round(0.025 * unit))
    edge = _shade(colour, 0.6)
    direction = knees[0] - hips[0]
    if abs(direction) > 0.08 * unit:  # seen from the side: back rest behind the hips
        back_x = hips[0] - math.copysign(0.06 * unit, direction)
        _line(img, (back_x, seat_y), (back_x, j[THORAX][1] + 0.05 * unit), colour, t + 1)
    else:  # seen from the front: back rest as a panel behind the torso
        half = 0.16 * unit
        top = j[THORAX][1] - 0.02 * unit
        _rect(img, hips[0] - half, top, hips[0] + half, seat_y, colour)
        _rect(img, hips[0] - half, top, hips[0] + half, seat_y, edge, 1)
    _line(img, (x0, seat_y), (x1, seat_y), colour, t)
    for x in (x0 + 0.01 * unit, x1 - 0.01 * unit):
        _line(img, (x, seat_y), (x, floor_y), edge, max(1, t - 1))


def _draw_occluder(img: np.ndarray, j: np.ndarray, unit: float, palette: Sequence[Colour],
                   rng: np.random.Generator) -> None:
    """A box (table, cart, screen) in front of the person covering a few joints."""
    size = img.shape[0]
    floor_standing = rng.random() < 0.5  # furniture on the floor reaches the bottom of the frame
    for _ in range(6):
        anchor = j[int(rng.integers(NUM_JOINTS))]
        w, h = _u(rng, 0.15, 0.4) * unit, _u(rng, 0.15, 0.4) * unit
        x0 = anchor[0] - _u(rng, 0.1, 0.9) * w
        y0 = anchor[1] - _u(rng, 0.1, 0.9) * h
        if floor_standing:
            h = max(h, size - y0)
        covered = ((j[:, 0] >= x0) & (j[:, 0] <= x0 + w) & (j[:, 1] >= y0) & (j[:, 1] <= y0 + h)).sum()
        if covered <= 4:
            break
    else:
        return  # every try would hide most of the person
    colour = _pick(rng, palette)
    _rect(img, x0, y0, x0 + w, y0 + h, colour)
    _rect(img, x0, y0, x0 + w, y0 + h, _shade(colour, 0.6), 1)
    if rng.random() < 0.6:
        _line(img, (x0, y0 + h * 0.3), (x0 + w, y0 + h * 0.3), _shade(colour, 0.75), 1)


@functools.lru_cache(maxsize=8)
def _vignette_map(size: int) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    c = (size - 1) / 2.0
    return (((xx - c) ** 2 + (yy - c) ** 2) / (2 * c * c))[..., None]  # (size, size, 1) in [0, 1]


def _camera(img: np.ndarray, style: SiteStyle, rng: np.random.Generator) -> np.ndarray:
    size = img.shape[0]
    out = img.astype(np.float32)
    if style.blur > 0:
        out = cv2.GaussianBlur(out, (0, 0), style.blur * size / 128.0)
    gain = style.gain * _u(rng, 0.92, 1.08)
    out *= (np.asarray(style.cast, np.float32) * gain)
    if style.vignette > 0:
        out *= 1.0 - style.vignette * _vignette_map(size)
    if style.noise > 0:
        out += rng.standard_normal(out.shape, dtype=np.float32) * np.float32(style.noise)
    return np.clip(out + 0.5, 0, 255).astype(np.uint8)


def render_frame(
    joints: np.ndarray,
    *,
    style: SiteStyle,
    identity: Identity,
    size: int,
    rng: np.random.Generator,
    kind: str | None = None,
    depth: np.ndarray | None = None,
) -> np.ndarray:
    """One (size, size, 3) uint8 BGR frame of a person at pixel ``joints`` (16, 2).

    kind adds the furniture the pose needs ("lying": bed and maybe a
    blanket, "sitting": chair); depth as in ``render_person``. Occluded joints
    keep their annotation (MPII semantics), only pixels change.
    """
    if kind is not None and kind not in POSE_KINDS:
        raise ValueError(f"unknown pose kind {kind!r}; choose from {POSE_KINDS}")
    j = np.asarray(joints, dtype=np.float64)
    if j.shape != (NUM_JOINTS, 2) or not np.all(np.isfinite(j)):
        raise ValueError(f"render_frame needs finite joints of shape ({NUM_JOINTS}, 2), got {j.shape}")
    img = render_background(style, size, rng)
    unit = _body_unit(j)
    palette = style.palette
    if kind == "lying":
        _draw_bed(img, j, unit, _jitter_colour(style.bedding, rng, 12), rng)
    elif kind == "sitting":
        _draw_chair(img, j, unit, _pick(rng, palette))
    ident = _lit(identity, rng)
    facing = _facing(j, depth, rng)
    _draw_body(img, j, ident, unit, facing, depth, parts=None)  # as render_person
    if kind == "lying" and rng.random() < 0.6:
        chest = rng.random() < 0.4
        _draw_blanket(img, j, unit, _jitter_colour(style.bedding, rng, 25), rng, chest)
        if chest:  # arms rest on top of the blanket
            _draw_body(img, j, ident, unit, facing, depth, parts=("arm_r", "arm_l"))
    if rng.random() < style.occluder_prob:
        _draw_occluder(img, j, unit, palette, rng)
    return _camera(img, style, rng)


def person_box(joints: np.ndarray) -> tuple[np.ndarray, float]:
    """(center (2,), scale) of the square box around joints and head, side 1.25 x extent / 200."""
    pts = np.concatenate([np.asarray(joints, dtype=np.float64), head_box(joints).astype(np.float64)])
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    return (lo + hi) / 2.0, float((hi - lo).max()) * 1.25 / PIXEL_STD


# --------------------------------------------------------------------------- writing a ward


def _style_for(spec: WardSpec, split: str, index: int) -> tuple[SiteStyle, str]:
    """Style and identity key of image ``index`` of ``split``."""
    person = index // spec.images_per_identity
    if split == "public":
        return PUBLIC_STYLE, f"public/{person:05d}"
    if split == "val":
        site = index % spec.sites
        return site_style(site), f"val/s{site}/{(index // spec.sites) // spec.images_per_identity:05d}"
    if split.startswith("site-"):
        return site_style(int(split[5:])), f"{split}/{person:05d}"
    raise ValueError(f"unknown split {split!r}; expected public, val or site-<i>")


def identity_of(spec: WardSpec, identity_id: str) -> Identity:
    """Appearance of a person named in ``identities.json`` (for attribute-inference attacks)."""
    return make_identity(_derive_rng(spec.seed, "identity", identity_id))


def render_sample(spec: WardSpec, split: str, index: int) -> tuple[np.ndarray, PoseRecord, str, str]:
    """Image ``index`` of ``split``: (BGR image, record with a placeholder path, identity id, pose kind).

    Depends only on (spec.seed, spec.image_size, spec.images_per_identity,
    spec.sites for val, split, index), never on other images.
    """
    style, identity_id = _style_for(spec, split, index)
    identity = identity_of(spec, identity_id)
    rng = _derive_rng(spec.seed, split, index)
    kinds = [k for k, _ in style.pose_mix]
    weights = np.array([w for _, w in style.pose_mix])
    kind = str(kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))])
    pose = sample_pose_3d(kind, rng)
    size = spec.image_size
    joints = place_pose(pose, kind=kind, style=style, size=size, rng=rng)
    image = render_frame(joints, style=style, identity=identity, size=size, rng=rng, kind=kind, depth=pose[:, 2])
    visible = inside(joints, (size, size))
    center, scale = person_box(joints)
    record = PoseRecord(Path("/") / split / f"{index:06d}.png", center, scale,
                        np.where(visible[:, None], joints, 0.0), visible, head_box(joints))
    return image, record, identity_id, kind


def manifest_for(spec: WardSpec) -> dict:
    """What ``manifest.json`` of a ward generated from ``spec`` contains."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "render_version": RENDER_VERSION,
        "spec": dataclasses.asdict(spec),
        "splits": spec.splits(),
        "layout": "<split>/annotations.json (MPII json, 1-based), headboxes.json, identities.json, "
                  "meta.json, images/*.png",
    }


def _write_split(split_dir: Path, spec: WardSpec, split: str, count: int, bar) -> None:
    images = split_dir / "images"
    images.mkdir(parents=True)
    annotations, headboxes, identities, meta = [], [], [], []
    for index in range(count):
        image, record, identity_id, kind = render_sample(spec, split, index)
        name = f"{split}_{index:06d}.png"
        if not cv2.imwrite(str(images / name), image):
            raise OSError(f"cannot write image file {images / name}")
        center, scale = box_to_json(record.center, record.scale)
        joints = np.where(record.visible[:, None], record.joints + 1.0, -1.0)
        annotations.append({
            "image": name,
            "center": [round(c, 4) for c in center],
            "scale": round(scale, 6),
            "joints": [[round(float(x), 4), round(float(y), 4)] for x, y in joints],
            "joints_vis": [int(v) for v in record.visible],
        })
        headboxes.append([[round(float(v) + 1.0, 4) for v in corner] for corner in record.headbox])
        identities.append(identity_id)
        meta.append({"identity": identity_id, "kind": kind, "style": _style_for(spec, split, index)[0].name})
        bar.update(1)
    for file_name, payload in (("annotations.json", annotations), ("headboxes.json", headboxes),
                               ("identities.json", identities), ("meta.json", meta)):
        (split_dir / file_name).write_text(json.dumps(payload))


def generate_ward(out_dir: str | Path, spec: WardSpec, *, progress: bool = True) -> Path:
    """Write every split of ``spec`` under ``out_dir`` and return its path.

    Files appear atomically: everything is written to a temporary sibling
    directory that is renamed into place at the end, so an interrupted run
    leaves no half-written ward behind. Refuses to touch an existing
    non-empty directory (use ``ensure_ward`` to reuse one).
    """
    from tqdm import tqdm

    if not isinstance(spec, WardSpec):
        raise ValueError(f"spec must be a WardSpec, got {type(spec).__name__}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty; use ensure_ward() or pick another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    splits = spec.splits()
    start = time.perf_counter()
    try:
        with tqdm(total=sum(splits.values()), desc=f"synthetic ward -> {out}", unit="img",
                  disable=not progress) as bar:
            for split, count in splits.items():
                _write_split(tmp / split, spec, split, count, bar)
        (tmp / "manifest.json").write_text(json.dumps(manifest_for(spec), indent=2))
        try:
            if out.exists():
                out.rmdir()  # empty (checked above); rename() needs it gone on some systems
            tmp.rename(out)
        except OSError:
            if _read_manifest(out) == manifest_for(spec):  # a concurrent process won the race
                log.info("%s was generated concurrently with the same spec; using it", out)
                shutil.rmtree(tmp)
                return out
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    elapsed = time.perf_counter() - start
    total = sum(splits.values())
    log.info("generated %d synthetic images in %.1f s (%.0f images/min) at %s",
             total, elapsed, 60.0 * total / max(elapsed, 1e-9), out)
    return out


def _read_manifest(out: Path) -> dict | None:
    path = out / "manifest.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot parse {path}: {err}; delete {out} to regenerate it") from err


def ensure_ward(out_dir: str | Path, spec: WardSpec, *, progress: bool = True) -> Path:
    """Return ``out_dir`` holding the ward of ``spec``, generating it only if it is absent.

    An existing directory generated from a different spec (or by an older
    generator) is never overwritten: that raises ValueError naming the
    differences, so results are not silently mixed.
    """
    out = Path(out_dir)
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return generate_ward(out, spec, progress=progress)
    found = _read_manifest(out)
    if found is None:
        raise ValueError(f"{out} exists but has no manifest.json, so it is not a synthetic ward; "
                         "point data.root elsewhere or delete it")
    wanted = manifest_for(spec)
    if found != wanted:
        keys = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
        details = [f"{k}: on disk {found.get(k)!r}, requested {wanted.get(k)!r}" for k in keys]
        raise ValueError(f"{out} holds a different synthetic ward ({'; '.join(details)}); "
                         "delete it or choose another directory")
    log.info("reusing synthetic ward at %s", out)
    return out


def load_identities(root: str | Path, split: str) -> list[str]:
    """Identity id of every record of a split (aligned with annotations.json)."""
    path = Path(root) / split / "identities.json"
    try:
        ids = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise FileNotFoundError(f"identity sidecar not found: {path}") from err
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot parse identity sidecar {path}: {err}") from err
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ValueError(f"{path}: expected a json list of identity strings")
    return ids
