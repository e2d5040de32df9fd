"""A site's own privacy policy (P6): a YAML file the hospital controls, not the server.

Example (``fedpose site-policy`` writes one)::

    site: hospital-a
    epsilon: 0.8          # the site's total budget over its whole ledger
    delta: 1.0e-5         # must be < 1/n for its n records
    max_rounds: 5         # rounds it takes part in at most
    min_sigma: null       # null: derived from epsilon, delta and max_rounds (see derive_min_sigma)
    data_path: data/site-0              # split directory (annotations.json, images/)
    ledger_path: ledger.sqlite          # the site's durable spend ledger
    public_path: data/public            # public set for basis_mode "site" (optional)
    accountant: rdp
    methods: [dpsgd, proj, fdp, fpdp]   # nonprivate is never accepted

Relative paths are relative to the policy file's directory.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shared.config import read_yaml
from shared.privacy.accountant import ACCOUNTANTS, StepRecord, calibrate_sigma, epsilon_spent

log = logging.getLogger(__name__)

PRIVATE_METHODS = ("dpsgd", "proj", "fdp", "fpdp")


@dataclass(frozen=True, kw_only=True)
class SitePolicy:
    site: str
    epsilon: float
    delta: float
    max_rounds: int
    data_path: str
    ledger_path: str
    min_sigma: float | None = None
    public_path: str | None = None
    accountant: str = "rdp"
    methods: tuple[str, ...] = PRIVATE_METHODS
    seed: int | None = None  # reproducible noise for tests only (P7: not for production)

    def __post_init__(self) -> None:
        if not isinstance(self.site, str) or not self.site.strip():
            raise ValueError("site policy: site must be a non-empty name")
        for name in ("epsilon", "delta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"site policy: {name}={value!r} must be a finite number")
        if not self.epsilon > 0:
            raise ValueError(f"site policy: epsilon={self.epsilon} must be > 0")
        if not 0 < self.delta < 1:
            raise ValueError(f"site policy: delta={self.delta} must be in (0, 1), e.g. 1e-5")
        if isinstance(self.max_rounds, bool) or not isinstance(self.max_rounds, int) or self.max_rounds < 1:
            raise ValueError(f"site policy: max_rounds={self.max_rounds!r} must be an int >= 1")
        if self.min_sigma is not None and (
            isinstance(self.min_sigma, bool)
            or not isinstance(self.min_sigma, (int, float))
            or not (self.min_sigma > 0 and math.isfinite(self.min_sigma))
        ):
            raise ValueError(f"site policy: min_sigma={self.min_sigma!r} must be a positive number or null")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"site policy: accountant={self.accountant!r} must be one of {ACCOUNTANTS}")
        bad = [m for m in self.methods if m not in PRIVATE_METHODS]
        if bad or not self.methods:
            raise ValueError(
                f"site policy: methods={list(self.methods)} must be a non-empty subset of {list(PRIVATE_METHODS)} "
                "(nonprivate training is never accepted)"
            )
        for name in ("data_path", "ledger_path"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"site policy: {name} must be a path")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"site policy: seed={self.seed!r} must be a non-negative int or null")


_TYPES: dict[str, tuple[type, ...]] = {
    "site": (str,),
    "epsilon": (int, float),
    "delta": (int, float),
    "max_rounds": (int,),
    "data_path": (str,),
    "ledger_path": (str,),
    "min_sigma": (int, float, type(None)),
    "public_path": (str, type(None)),
    "accountant": (str,),
    "methods": (list, tuple),
    "seed": (int, type(None)),
}


def policy_from_dict(data: dict[str, Any], *, base: Path | None = None) -> SitePolicy:
    """Validate plain data (unknown keys and wrong types rejected, naming the key); resolve paths against ``base``."""
    if not isinstance(data, dict):
        raise ValueError(f"site policy: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(SitePolicy)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"site policy: unknown key {unknown[0]!r} (known: {', '.join(sorted(names))})")
    missing = sorted(
        f.name for f in dataclasses.fields(SitePolicy)
        if f.default is dataclasses.MISSING and f.name not in data
    )
    if missing:
        raise ValueError(f"site policy: missing key {missing[0]!r}")
    values = dict(data)
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, _TYPES[key]):
            raise ValueError(f"site policy: {key}={value!r} has the wrong type (expected {_TYPES[key]})")
    if "methods" in values:
        values["methods"] = tuple(values["methods"])
    for key in ("epsilon", "delta", "min_sigma"):
        if values.get(key) is not None:
            values[key] = float(values[key])
    if base is not None:
        for key in ("data_path", "ledger_path", "public_path"):
            if values.get(key):
                path = Path(values[key]).expanduser()
                values[key] = str(path if path.is_absolute() else (base / path).resolve())
    return SitePolicy(**values)


def load_policy(path: str | Path) -> SitePolicy:
    """Read and validate a site policy YAML file (relative paths are relative to its directory)."""
    path = Path(path)
    data = read_yaml(path, what="site policy")
    try:
        return policy_from_dict(data, base=path.resolve().parent)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def policy_to_dict(policy: SitePolicy) -> dict[str, Any]:
    out = dataclasses.asdict(policy)
    out["methods"] = list(policy.methods)
    return out


def write_policy(path: str | Path, policy: SitePolicy) -> Path:
    """Write a policy YAML atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(policy_to_dict(policy), sort_keys=False))
    tmp.replace(path)
    return path


@functools.lru_cache(maxsize=64)
def _derived_min_sigma(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    return calibrate_sigma(
        target_epsilon=epsilon, delta=delta, sample_rate=sample_rate, steps=steps, accountant=accountant
    )


def min_sigma_for(policy: SitePolicy, *, sample_rate: float, steps_per_round: int) -> float:
    """The smallest noise multiplier this site accepts for rounds of ``steps_per_round`` steps at rate q.

    Explicit ``min_sigma`` wins. Otherwise it is derived by the site itself
    (P6): the sigma at which ``max_rounds`` such rounds spend exactly its
    epsilon at its delta with its accountant. A server asking for less
    noise would spend the budget in fewer rounds than the site agreed to.
    """
    if policy.min_sigma is not None:
        return float(policy.min_sigma)
    if isinstance(steps_per_round, bool) or not isinstance(steps_per_round, int) or steps_per_round < 1:
        raise ValueError(f"steps_per_round={steps_per_round!r} must be an int >= 1")
    return _derived_min_sigma(
        float(policy.epsilon), float(policy.delta), float(sample_rate),
        policy.max_rounds * steps_per_round, policy.accountant,
    )


def sigma_shortfall(policy: SitePolicy, *, sigma: float, sample_rate: float, steps_per_round: int) -> str | None:
    """Why ``sigma`` is weaker than this site's minimum, or None when it is acceptable (P6).

    Same rule as ``min_sigma_for`` without calibrating: with no explicit
    ``min_sigma``, sigma is acceptable iff ``max_rounds`` rounds at it stay
    within the site's epsilon (epsilon decreases with sigma, so this is
    exactly "sigma >= derived minimum", at the cost of one accountant call).
    """
    if policy.min_sigma is not None:
        if sigma < policy.min_sigma:
            return f"sigma={sigma:.6g} < this site's min_sigma={policy.min_sigma:.6g}"
        return None
    if not (sigma > 0 and math.isfinite(sigma)):
        return f"sigma={sigma!r} adds no usable noise"
    planned = StepRecord(sigma=float(sigma), sample_rate=float(sample_rate), steps=policy.max_rounds * steps_per_round)
    eps = epsilon_spent([planned], delta=policy.delta, accountant=policy.accountant)
    if eps > policy.epsilon:
        return (f"sigma={sigma:.6g} is below this site's minimum: {policy.max_rounds} rounds x {steps_per_round} steps "
                f"at q={sample_rate:.4g} would cost eps={eps:.4g} > {policy.epsilon:g} (delta={policy.delta:g})")
    return None
