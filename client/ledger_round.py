"""One charge as the site ledger sees it inside its transaction (``OpenRound``), and what a round ran besides
(sigma, q, steps) (``Mechanism``).

``SiteLedger.round`` opens the transaction and hands the charge an ``OpenRound``: the rows so far, to check the
budget against, and ``record``, which writes the round's one row (P12): federation and round (a repeated
(federation, round) is refused, never trained twice), method, psi and its strength, clip, augmentation, the
privacy unit, sigma, q, steps and the cumulative epsilon after it.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

from fedpose.client.ledger_schema import spend_history
from fedpose.shared.privacy.accounting.accountant import StepRecord
from fedpose.shared.privacy.accounting.ledger import check_entry, cumulative_epsilon, utc_now


@dataclass(frozen=True, kw_only=True)
class Mechanism:
    """What one round ran, besides (sigma, q, steps): stored on its row (P12)."""

    method: str
    psi: str | None  # e.g. "blur(0.03)"; None for dpsgd/proj
    clip_norm: float
    augment: bool
    unit: str = "record"  # the privacy unit of the round: record or patient


@dataclass
class OpenRound:
    """The state seen inside a round's transaction; ``record`` writes the round's one row."""

    conn: sqlite3.Connection
    rows: list[dict[str, Any]]
    recorded: bool = False

    @property
    def rounds_done(self) -> int:
        return len(self.rows)

    def federation_rounds(self, federation: str) -> int:
        return sum(1 for r in self.rows if r["federation"] == federation)

    def has_round(self, federation: str, round: int) -> bool:
        return any(r["federation"] == federation and r["round"] == round for r in self.rows)

    def epsilon_after(self, record: StepRecord, *, delta: float, accountant: str) -> float:
        return cumulative_epsilon([*spend_history(self.rows), record], delta=delta, accountant=accountant)

    def epsilon(self, *, delta: float, accountant: str, federation: str | None = None) -> float:
        """Cumulative epsilon of the rows seen so far (of one federation's rows when given)."""
        rows = [r for r in self.rows if federation is None or r["federation"] == federation]
        return cumulative_epsilon(spend_history(rows), delta=delta, accountant=accountant)

    def record(
        self, *, site: str, federation: str, round: int, sigma: float, sample_rate: float, steps: int,
        delta: float, budget: float, accountant: str, mechanism: Mechanism, state: str = "done",
        noise_seed: int | None = None, data_version: str | None = None, request_digest: str | None = None,
    ) -> float:
        """Insert the round's row (validated first); returns the cumulative epsilon written.

        ``state='charged'`` (the site's rounds): the spend is on disk before any private record is read;
        ``noise_seed``, ``data_version`` and ``request_digest`` let an unfinished round be replayed on the same
        data for the identical request only, never spent twice (P16).
        """
        if state not in ("charged", "done"):
            raise ValueError(f"state={state!r} must be 'charged' or 'done'")
        if (state == "charged") != (noise_seed is not None):
            raise ValueError("a charged row keeps its noise seed until it is done; a done row keeps none")
        if state == "charged" and not request_digest:
            raise ValueError("a charged row is bound to the digest of the request it was charged for (P16)")
        if self.recorded:
            raise ValueError("this round already has its ledger row; one row per round")
        if self.has_round(federation, round):
            raise ValueError(f"federation {federation} round {round} is already in the ledger; never twice")
        entry = check_entry(sigma=sigma, sample_rate=sample_rate, steps=steps, delta=delta, accountant=accountant)
        eps = self.epsilon_after(entry, delta=delta, accountant=accountant)
        values = dict(site=site, federation=federation, round=int(round), sigma=float(sigma),
                      sample_rate=float(sample_rate), steps=int(steps), delta=float(delta), epsilon=eps,
                      budget=float(budget), accountant=accountant, recorded_at=utc_now(), method=mechanism.method,
                      psi=mechanism.psi, clip_norm=float(mechanism.clip_norm), augment=int(mechanism.augment),
                      unit=mechanism.unit, state=state, noise_seed=noise_seed, data_version=data_version,
                      request_digest=request_digest, outcome=None)
        self.conn.execute(f"INSERT INTO spend ({', '.join(values)}) VALUES ({', '.join('?' for _ in values)})",
                          tuple(values.values()))
        self.rows.append(values)
        self.recorded = True
        return eps
