"""The privacy claim the tool prints (invariant P8): what is and is not promised.

Feature-DP (fdp, fpdp) protects only what psi removes: psi(x) and the pose
labels are used without noise, so they are public by assumption and may be
revealed by the model. Only dpsgd and proj give record-level DP. Saying
"(eps, delta)-DP" for a Feature-DP run would overstate the guarantee, so the
claim text is produced in one place and worded for each method.
"""

from __future__ import annotations

import logging
import math

from shared.privacy.fpdp import FEATURE_METHODS, METHODS, PROJECTED_METHODS

log = logging.getLogger(__name__)


def privacy_claim(
    *,
    method: str,
    epsilon: float | None,
    delta: float | None,
    psi: str | None,
    seeded: bool,
    accountant: str,
    released: str | None = None,
) -> str:
    """One honest sentence (or a few) describing the guarantee of a finished run.

    ``epsilon`` is the accountant's value for the history that actually ran
    (the max over sites for a federation); ``psi`` is the feature map's
    description (required for fdp/fpdp). ``seeded`` appends the P7 warning.
    ``released`` names what else the run releases beside the model (P10),
    and how that bears on the adjacency; it is appended as given.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; choose one of {METHODS}")
    if method == "nonprivate":
        text = "no privacy guarantee: non-private training on raw images"
    else:
        if epsilon is None or delta is None:
            raise ValueError(f"method={method!r} needs the epsilon and delta that were spent")
        if not (epsilon >= 0 and math.isfinite(epsilon)):
            raise ValueError(f"epsilon={epsilon!r} must be a finite non-negative number")
        if not 0 < delta < 1:
            raise ValueError(f"delta={delta!r} must be in (0, 1)")
        budget = f"(eps={epsilon:.4g}, delta={delta:.3g})"
        mechanism = (
            f"per site, Poisson sampling, add/remove-one-record adjacency, "
            f"{accountant.upper()} accountant"
        )
        if method in FEATURE_METHODS:
            if not psi:
                raise ValueError(f"method={method!r} needs the psi description for its claim")
            text = (
                f"{budget}-Feature-DP {mechanism}: psi(x) = {psi} of each image and the pose "
                "labels are treated as public and may be revealed by the model; this is not "
                "record-level DP"
            )
        else:
            text = f"record-level {budget}-DP {mechanism}"
        if method in PROJECTED_METHODS:
            text += "; the projection basis is computed from public data only"
    if released and method != "nonprivate":
        text += f"; {released}"
    if seeded:
        text += "; seeded noise: not for production"
    return text
