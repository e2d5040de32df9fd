"""Per-person identity cues (skin, hair, face, clothing, build) that privacy attacks can find."""

from __future__ import annotations

import colorsys
from dataclasses import dataclass

import numpy as np

from fedpose.shared.data.synth.styles import Colour, _check_colour

HAIR_STYLES: tuple[str, ...] = ("short", "long", "bald", "bun", "cap")
SHIRT_PATTERNS: tuple[str, ...] = ("solid", "hstripes", "vstripes", "dots")
FACES: tuple[str, ...] = ("plain", "glasses", "beard", "mask")


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
