"""Random generators and Gaussian noise for the DP step (invariant P7).

The Gaussian mechanism is only private if the adversary cannot predict the
noise. A fixed seed makes the noise reproducible and therefore removable by
anyone who knows the seed, so by default the generator is seeded from OS
entropy (``secrets``), and a seeded run logs a WARNING that it is not for
production. The seed of an unseeded run is never logged or returned.

Limits, stated honestly: torch's CPU generator is a Mersenne Twister, not a
cryptographically secure PRNG, and floating-point Gaussian sampling has the
known least-significant-bit weakness (Mironov, CCS 2012). Opacus' "secure
mode" addresses both with a CSPRNG; this project does not. Entropy seeding
prevents the trivial attack (a public seed), not a state-recovery attack on
the generator.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def make_generator(
    seed: int | None, device: torch.device | str = "cpu"
) -> tuple[torch.Generator, bool]:
    """A torch.Generator for DP noise and Poisson sampling; returns (gen, seeded).

    ``seed=None`` (production) seeds from 63 bits of OS entropy. An explicit
    seed is for tests and reproducible experiments only: it is logged as a
    WARNING (P7) and ``seeded=True`` must be carried into the privacy claim.
    """
    generator = torch.Generator(device=torch.device(device))
    if seed is None:
        generator.manual_seed(secrets.randbits(63))
        return generator, False
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(
            f"seed={seed!r} must be a non-negative int, or None to seed from OS entropy "
            "(required for a real privacy guarantee)"
        )
    generator.manual_seed(seed)
    log.warning(
        "DP noise generator seeded with a fixed seed (%d): the noise is reproducible, "
        "so this run is NOT for production and its privacy claim does not hold against "
        "anyone who knows the seed",
        seed,
    )
    return generator, True


def round_secret() -> int:
    """63 bits of OS entropy for one round's generator: kept by a site in its own ledger until the round's
    reply is stored (so an interrupted round replays with the same noise), then erased. Never logged."""
    return secrets.randbits(63)


def generator_from_secret(secret: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of a round whose seed is a secret from ``round_secret`` (production: not 'seeded', P7).

    Unlike ``make_generator(seed)``, nothing is logged and the run is not marked seeded: the value came
    from OS entropy and never leaves the site.
    """
    if isinstance(secret, bool) or not isinstance(secret, int) or not 0 <= secret < 2**63:
        raise ValueError("a round secret is a 63-bit non-negative int (round_secret)")
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(secret)
    return generator


def gaussian_noise_like(
    params: Mapping[str, Tensor], *, std: float, generator: torch.Generator
) -> dict[str, Tensor]:
    """Independent N(0, std^2) noise with the shapes, dtypes and devices of ``params``.

    Draws in sorted-name order so that the same generator state gives the
    same noise whatever the dict's insertion order (the flattening order of
    ``subspace.flatten`` is the same). Noise is drawn on the generator's
    device and moved to each parameter's device.
    """
    try:
        value = float(std)
    except (TypeError, ValueError) as err:
        raise ValueError(f"std={std!r} must be a non-negative number") from err
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"std={std!r} must be a non-negative finite number (sigma * C)")
    if not isinstance(generator, torch.Generator):
        raise ValueError(
            "generator must be a torch.Generator (see make_generator), got "
            f"{type(generator).__name__}"
        )
    noise: dict[str, Tensor] = {}
    for name in sorted(params):
        like = params[name]
        if not like.is_floating_point():
            raise ValueError(f"params[{name!r}] has dtype {like.dtype}; noise needs floating point")
        draw = torch.randn(
            like.shape, generator=generator, device=generator.device, dtype=like.dtype
        )
        noise[name] = draw.mul_(value).to(like.device)
    return noise
