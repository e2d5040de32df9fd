"""Random draws: every generator is derived from (seed, key...) by hashing, so image i of a split
depends on no other image or split."""

from __future__ import annotations

import hashlib

import numpy as np


def _derive_rng(seed: int, *key: object) -> np.random.Generator:
    """Generator determined by (seed, key...) only: stable across processes and Python versions."""
    text = "/".join(str(k) for k in (seed, *key))
    digest = hashlib.sha256(text.encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))



def _u(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(rng.uniform(lo, hi))
