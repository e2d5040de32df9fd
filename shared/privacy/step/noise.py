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


def _unit_draws(
    params: Mapping[str, Tensor], *, std: float, generator: torch.Generator
) -> tuple[float, dict[str, Tensor]]:
    """(std as a float, {name: N(0, 1) draw shaped, typed and placed like ``params[name]``}), drawn in sorted-name
    order after checking ``std`` and ``generator``: the one order both ways of adding noise draw in."""
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
    draws: dict[str, Tensor] = {}
    for name in sorted(params):
        like = params[name]
        if not like.is_floating_point():
            raise ValueError(f"params[{name!r}] has dtype {like.dtype}; noise needs floating point")
        draw = torch.randn(like.shape, generator=generator, device=generator.device, dtype=like.dtype)
        draws[name] = draw.to(like.device)
    return value, draws


def gaussian_noise_like(
    params: Mapping[str, Tensor], *, std: float, generator: torch.Generator
) -> dict[str, Tensor]:
    """Independent N(0, std^2) noise with the shapes, dtypes and devices of ``params``.

    Draws in sorted-name order so that the same generator state gives the
    same noise whatever the dict's insertion order (the flattening order of
    ``subspace.flat_vector`` is the same). Noise is drawn on the generator's
    device and moved to each parameter's device.
    """
    value, draws = _unit_draws(params, std=std, generator=generator)
    return {name: draw.mul_(value) for name, draw in draws.items()}


def add_noise_and_scale_(summed: Mapping[str, Tensor], *, std: float, scale: float,
                         generator: torch.Generator) -> None:
    """summed[name] = (summed[name] + N(0, std^2)) * scale in place, for every name. The noise is std times the
    very draws ``gaussian_noise_like`` scales for this generator state, added and scaled by two operations over
    all tensors instead of three per tensor (the private step's last work before its release)."""
    value, draws = _unit_draws(summed, std=std, generator=generator)
    targets = [summed[name] for name in draws]
    torch._foreach_add_(targets, list(draws.values()), alpha=value)
    torch._foreach_mul_(targets, float(scale))
