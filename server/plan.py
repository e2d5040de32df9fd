"""Per-site noise plan, calibrated once up front (docs/explanation/design.md: one federated round, step 1).

For each site the server knows only what the site's policy declares (its
answer to the query): its budget and rounds, its own sample rate q and
steps per round, clip, psi and minimum sigma; never n (P10). The plan is

    q      = the site's declared sample rate      (Poisson rate, P4)
    steps  = rounds x local_steps
    sigma  = max(calibrate_sigma(eps, delta, q, steps), site minimum)

with eps = min(server target, site budget) and delta = min(server delta,
site delta), rounds = min(configured rounds, the site's rounds per
federation, the rounds its lifetime still allows). A site whose policy the
federation's config does not satisfy (method, local steps, clip, psi,
augmentation, privacy unit) is left out with the reason logged: it would refuse anyway.
The same sigma is used every round, so after the planned rounds the
composition (P5) is exactly the calibrated one (<= eps) and the next round
would exceed the budget: the site is then not sampled again.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass

from fedpose.shared.configuration.schema import Config
from fedpose.shared.errors import ConfigError
from fedpose.shared.flower.messages import SiteInfo
from fedpose.shared.privacy.accounting.accountant import StepRecord, calibrate_sigma, epsilon_spent
from fedpose.shared.privacy.step.psi import psi_strength
from fedpose.shared.configuration.methods import WITH_PUBLIC

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SitePlan:
    site: str
    epsilon: float  # budget the server holds the site to
    delta: float
    sample_rate: float
    steps_per_round: int
    rounds: int
    sigma: float
    accountant: str
    site_min_sigma: float

    def step_record(self) -> StepRecord:
        """One planned round, as the accountant sees it."""
        return StepRecord(sigma=self.sigma, sample_rate=self.sample_rate, steps=self.steps_per_round)

    def to_dict(self) -> dict:
        return asdict(self)


def incompatibility(info: SiteInfo, cfg: Config) -> str | None:
    """Why this site's policy would refuse the federation's requests, or None."""
    method = cfg.train.method
    if method not in info.methods:
        return f"does not allow method {method} (allows {list(info.methods)})"
    if cfg.federation.local_steps > info.steps_per_round:
        return f"takes at most {info.steps_per_round} local steps per round (federation.local_steps = " \
               f"{cfg.federation.local_steps})"
    if cfg.privacy.clip_norm != info.clip_norm:
        return f"clips at {info.clip_norm:g} (privacy.clip_norm = {cfg.privacy.clip_norm:g})"
    if cfg.data.augment != info.augment:
        return f"pins augment={info.augment} (data.augment = {cfg.data.augment})"
    if cfg.privacy.unit != info.unit:
        return f"trains at the {info.unit} unit (privacy.unit = {cfg.privacy.unit})"
    if method in WITH_PUBLIC:
        strength = psi_strength(cfg.privacy.psi, cfg.privacy.psi_param, cfg.data.input_size)
        if cfg.privacy.psi != info.psi or strength < info.psi_min:
            return f"needs psi {info.psi} of strength >= {info.psi_min:g} (config: {cfg.privacy.psi} of " \
                   f"strength {strength:.4g})"
    return None


def left_out(info: SiteInfo, cfg: Config) -> str | None:
    """Why this site cannot take part in the federation of ``cfg`` (its policy would refuse, or it has no rounds
    left), or None."""
    problem = incompatibility(info, cfg)
    if problem is not None:
        return problem
    if min(cfg.federation.rounds, info.rounds_per_federation, info.lifetime_rounds - info.rounds_done) < 1:
        return f"has no rounds left ({info.rounds_done} of its {info.lifetime_rounds} lifetime rounds done)"
    return None


def plan_site(info: SiteInfo, cfg: Config) -> SitePlan | None:
    """The plan for one site, or None when it cannot take part (no rounds left, method not allowed)."""
    method = cfg.train.method
    if method == "nonprivate":
        raise ConfigError("train.method: a federation trains privately; choose dpsgd, proj, fdp or fpdp")
    problem = left_out(info, cfg)
    if problem is not None:
        log.warning("site %s %s: left out", info.site, problem)
        return None
    rounds = min(cfg.federation.rounds, info.rounds_per_federation, info.lifetime_rounds - info.rounds_done)
    epsilon = min(cfg.privacy.epsilon, info.epsilon)
    delta = min(cfg.privacy.delta, info.delta)
    q = info.sample_rate
    steps = cfg.federation.local_steps
    calibrated = _calibrated(epsilon, delta, q, rounds * steps, cfg.privacy.accountant)
    sigma = max(calibrated, info.min_sigma)
    if sigma > calibrated:
        log.info("site %s asks for sigma >= %.4f (> calibrated %.4f): using its minimum", info.site, sigma, calibrated)
    plan = SitePlan(
        site=info.site, epsilon=epsilon, delta=delta, sample_rate=q, steps_per_round=steps,
        rounds=rounds, sigma=sigma, accountant=cfg.privacy.accountant, site_min_sigma=info.min_sigma,
    )
    log.info("plan %s: q=%.4f sigma=%.4f over %d rounds x %d steps for eps=%.4g delta=%.3g",
             plan.site, q, sigma, rounds, steps, epsilon, delta)
    return plan


@functools.lru_cache(maxsize=64)
def _calibrated(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """calibrate_sigma, once per distinct plan (identical sites share it)."""
    return calibrate_sigma(target_epsilon=epsilon, delta=delta, sample_rate=sample_rate, steps=steps,
                           accountant=accountant)


def can_afford(plan: SitePlan, history: list[StepRecord], *, site_epsilon: float = 0.0) -> bool:
    """Would one more planned round keep the site within its plan and budget?

    ``history``: the site's rounds recorded by this federation's ledger.
    The server's recomputation decides; the largest epsilon the site itself
    reported is a floor (a mismatch counts the larger value).
    """
    if len(history) >= plan.rounds or site_epsilon >= plan.epsilon:
        return False
    eps_next = epsilon_spent([*history, plan.step_record()], delta=plan.delta, accountant=plan.accountant)
    return eps_next <= plan.epsilon
