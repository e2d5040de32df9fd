"""The projection basis V of a federation: when it is refreshed, who computes it, who holds it.

Every ``privacy.basis_every`` rounds V is recomputed at the current global
weights from public data only (P2): the top-k directions of m per-sample
gradients on S_pub (``fedpose.shared.privacy.step.subspace.public_basis_at``). Its version is the
round it was made for.

- ``basis_mode: broadcast`` - the server computes V and sends it as its own
  ArrayRecord (float16 by default) to each site that does not hold that
  version yet; sites cache it by version, so an unchanged V is not re-sent.
- ``basis_mode: site`` - the server only announces the version; each site
  computes V itself from the public set it holds, at the global weights it
  received (same function, same public data: no V on the wire).

The trade-off (benchmarks/federation.py): V is p x k, i.e. k/2 times the
trainable weights in float16, so broadcasting it costs far more downlink
than the weights unless basis_every is large; "site" mode costs each site
the basis computation instead (m per-sample gradients per refresh).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from fedpose.shared.configuration.schema import Config
from fedpose.shared.data.records import PoseRecord
from fedpose.shared.flower.messages import basis_record
from fedpose.shared.configuration.methods import PROJECTED

if TYPE_CHECKING:  # the model module is imported where it is used (it is not needed to plan a round)
    from fedpose.shared.model.posenet import PoseNet

log = logging.getLogger(__name__)


class BasisKeeper:
    """Versions of V for one federation run, and which site holds which version."""

    def __init__(self, cfg: Config, public: list[PoseRecord]) -> None:
        self.cfg = cfg
        self.public = public
        self.mode = cfg.federation.basis_mode
        self.every = cfg.privacy.basis_every
        self.version = 0  # 0: none yet
        self.record: Any = None  # the serialised V (broadcast mode), built once per version
        self.held: dict[str, int] = {}

    @property
    def needed(self) -> bool:
        return self.cfg.train.method in PROJECTED

    def due(self, round: int) -> bool:
        return self.needed and (self.version == 0 or round - self.version >= self.every)

    def refresh(self, round: int, model: PoseNet, trainable: list[str]) -> float:
        """New version for ``round`` if due; returns seconds spent computing V on the server."""
        if not self.due(round):
            return 0.0
        self.version = round
        if self.mode == "site":
            log.info("basis version %d: sites compute V from their public set", round)
            return 0.0
        from fedpose.shared.model.pose_loss import make_loss_fn
        from fedpose.shared.training.batches import make_dataset
        from fedpose.shared.privacy.step.subspace import public_basis_at

        t0 = time.perf_counter()
        device = next(model.parameters()).device
        basis = public_basis_at(model, make_loss_fn(model, trainable), trainable,
                                make_dataset(self.public, self.cfg, train=False), self.cfg.privacy, device)
        self.record = basis_record(basis.cpu(), version=round, dtype=self.cfg.federation.basis_dtype)
        seconds = time.perf_counter() - t0
        log.info("basis version %d: V %s computed in %.1f s, %d bytes as %s", round, tuple(basis.shape), seconds,
                 self.record.count_bytes(), self.cfg.federation.basis_dtype)
        return seconds

    def attach_for(self, site: str) -> Any:
        """The basis ArrayRecord to send to ``site`` this round, or None (not needed, or already held)."""
        if not self.needed or self.mode != "broadcast":
            return None
        if self.held.get(site) == self.version:
            return None
        return self.record

    def mark_held(self, site: str) -> None:
        if self.needed:
            self.held[site] = self.version

    def forget(self, site: str) -> None:
        self.held.pop(site, None)
