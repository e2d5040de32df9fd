"""Per-site noise plan, calibrated once up front (DESIGN.md section 2, step 1).

For each site the server knows (from the site's answer to its query) n, the
site's own budget and max rounds, and the minimum sigma the site accepts for
the proposed batch size and local steps. The plan is

    q      = B / n                              (Poisson rate, P4)
    steps  = rounds x local_steps
    sigma  = max(calibrate_sigma(eps, delta, q, steps), site minimum)

with eps = min(server target, site budget) and delta = min(server delta,
site delta), rounds = min(configured rounds, rounds the site still allows).
The same sigma is used every round, so after the planned rounds the
composition (P5) is exactly the calibrated one (<= eps) and the next round
would exceed the budget: the site is then not sampled again.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass

from shared.config import Config, ConfigError
from shared.federation_messages import SiteInfo
from shared.privacy.accountant import StepRecord, calibrate_sigma, check_delta, epsilon_spent

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SitePlan:
    site: str
    n: int
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


def plan_site(info: SiteInfo, cfg: Config) -> SitePlan | None:
    """The plan for one site, or None when it cannot take part (no rounds left, method not allowed)."""
    method = cfg.train.method
    if method == "nonprivate":
        raise ConfigError("train.method: a federation trains privately; choose dpsgd, proj, fdp or fpdp")
    if method not in info.methods:
        log.warning("site %s does not allow method %s (allows %s): left out", info.site, method, list(info.methods))
        return None
    rounds = min(cfg.federation.rounds, info.max_rounds - info.rounds_done)
    if rounds < 1:
        log.warning("site %s has no rounds left (%d of %d done): left out", info.site, info.rounds_done,
                    info.max_rounds)
        return None
    epsilon = min(cfg.privacy.epsilon, info.epsilon)
    delta = min(cfg.privacy.delta, info.delta)
    check_delta(delta, info.n)
    q = min(1.0, cfg.train.batch_size / info.n)
    steps = cfg.federation.local_steps
    calibrated = _calibrated(epsilon, delta, q, rounds * steps, cfg.privacy.accountant)
    sigma = max(calibrated, info.min_sigma)
    if sigma > calibrated:
        log.info("site %s asks for sigma >= %.4f (> calibrated %.4f): using its minimum", info.site, sigma, calibrated)
    plan = SitePlan(
        site=info.site, n=info.n, epsilon=epsilon, delta=delta, sample_rate=q, steps_per_round=steps,
        rounds=rounds, sigma=sigma, accountant=cfg.privacy.accountant, site_min_sigma=info.min_sigma,
    )
    log.info("plan %s: n=%d q=%.4f sigma=%.4f over %d rounds x %d steps for eps=%.4g delta=%.3g",
             plan.site, plan.n, q, sigma, rounds, steps, epsilon, delta)
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
