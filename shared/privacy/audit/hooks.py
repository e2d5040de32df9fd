"""What ``fedpose audit`` may attach to a private run of ``fedpose.shared.training.loop.local_train`` (never set in
production).

``AuditHooks`` carries the canaries and the observer; ``ReleasedStep`` is what the
observer sees after every step. Both are plain data: the audit itself lives in
``fedpose.shared.experiments.audit``, the canaries in ``fedpose.shared.privacy.audit.canaries``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedpose.shared.data.dataset import PoseDataset
from fedpose.shared.privacy.audit.canaries import DiracCanaries, SpanCanaries


@dataclass(frozen=True)
class ReleasedStep:
    """The white-box auditor's view of step ``step`` (all of it covered by the accountant's composition).

    update: the direction the optimizer applies (private + g_pub). private: the
    noisy, projected-if-any private gradient, the step's DP release (update
    minus g_pub, which is public). basis: the V this step projected with
    (public, P2), None for dpsgd / fdp.
    """

    step: int
    update: dict[str, torch.Tensor]
    private: dict[str, torch.Tensor]
    basis: torch.Tensor | None


@dataclass(frozen=True)
class AuditHooks:
    """What ``fedpose audit`` adds to a private run (``fedpose.shared.experiments.audit``); never set in production.

    canaries: gradient canaries (Dirac or in-span), drawn every step with the
    records' q and added to their clipped sum before the noise
    (``fedpose.shared.privacy.audit.canaries``); in-span ones are built inside ``dp_gradient``
    on the V that step projects with.
    observe(released): called after every step with a ``ReleasedStep``: the
    white-box auditor's view.
    psi_source: the records psi batches are drawn from (default: the private
    records). For fdp / fpdp the audit puts every input-space canary there, IN or
    OUT, because Feature-DP treats psi(x) and the labels as public: canaries may
    differ only in x with psi(x) and labels fixed.
    """

    canaries: DiracCanaries | SpanCanaries | None = None
    observe: Callable[[ReleasedStep], None] | None = None
    psi_source: PoseDataset | None = None
