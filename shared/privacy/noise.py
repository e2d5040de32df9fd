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
the generator. A large draw on a CPU takes its later half from a second
Mersenne Twister seeded with 62 bits drawn from the first: nothing about the
noise is more predictable than the first generator's state already makes it.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

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
    device and moved to each parameter's device. On a CPU with two threads or
    more, a draw of at least ``PARALLEL_ABOVE`` coordinates takes its later
    half from a second generator seeded by the first, in a worker thread.
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
    names = sorted(params)
    for name in names:
        if not params[name].is_floating_point():
            raise ValueError(f"params[{name!r}] has dtype {params[name].dtype}; noise needs floating point")
    sizes = [params[name].numel() for name in names]
    total = sum(sizes)
    if generator.device.type != "cpu" or total < PARALLEL_ABOVE or torch.get_num_threads() < 2:
        return _draw(params, names, value, generator)
    # Two cores: the later half of the tensors from a second generator seeded by the first, drawn in a worker
    # thread while this one draws the first half. A function of the generator's state alone, as one draw is.
    child = torch.Generator(device=generator.device)
    child.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    split = next(i for i in range(len(names)) if 2 * sum(sizes[:i + 1]) >= total) + 1
    later = _worker().submit(_draw, params, names[split:], value, child)
    noise = _draw(params, names[:split], value, generator)
    noise.update(later.result())
    return noise


# Coordinates below which one draw in the calling thread costs less than handing half of it to another.
PARALLEL_ABOVE = 1 << 18

_pool: tuple[int, ThreadPoolExecutor] | None = None


def _worker() -> ThreadPoolExecutor:
    """One worker thread for this process (a forked process starts its own: threads do not survive a fork)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-noise"))
    return _pool[1]


def _draw(params: Mapping[str, Tensor], names: list[str], std: float, generator: torch.Generator) -> dict[str, Tensor]:
    """The tensors ``names`` in this order, as consecutive pieces of one draw when they share a dtype (one call:
    a worker thread then needs the interpreter once, not once per tensor)."""
    dtypes = {params[name].dtype for name in names}
    if len(dtypes) != 1:
        return {name: _draw(params, [name], std, generator)[name] for name in names}
    flat = torch.randn(sum(params[name].numel() for name in names), generator=generator, device=generator.device,
                       dtype=dtypes.pop()).mul_(std)
    pieces = flat.split([params[name].numel() for name in names])
    return {name: piece.view(params[name].shape).to(params[name].device) for name, piece in zip(names, pieces)}
