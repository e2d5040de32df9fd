"""The privacy claim the tool prints (invariant P8): what is and is not promised.

Feature-DP (fdp, fpdp) protects only what psi removes: psi(x) and the pose
labels are used without noise, so they are public by assumption and may be
revealed by the model. Only dpsgd and proj give record-level DP. Saying
"(eps, delta)-DP" for a Feature-DP run would overstate the guarantee, so the
claim text is produced in one place and worded for each method.

Every claim names its privacy unit (issue #11). A record-level claim also says
what it means for a patient filmed in several frames: the group-privacy bound
(``fedpose.shared.privacy.accounting.group``) at the most records a patient has, or, when that
number is not known, that a patient with k records gets only (k eps, ...).
A patient-level claim covers all of a patient's records at once.
"""

from __future__ import annotations

import logging
import math

from fedpose.shared.configuration.methods import METHODS, PROJECTED, UNITS, WITH_PUBLIC
from fedpose.shared.privacy.accounting.group import group_privacy

log = logging.getLogger(__name__)


# What each face task's labels are (model.face_tasks): under Feature-DP they are public like the pose labels.
FACE_LABELS = {"detect": "face presence and box", "landmarks": "facial landmarks", "head_pose": "head pose",
               "attribute": "face attribute"}


# What a Feature-DP reply gives the server (P17): outside V its update is the noise-free public gradient.
SERVER_READS = ("the server can read, exactly, psi(x) of each image drawn for the public term and its {labels} "
                "from a single reply (the noise-free public gradient), and estimate how many records a site holds")


def public_labels(face_tasks: tuple[str, ...] = ()) -> str:
    """The labels a Feature-DP run uses without noise: the pose labels, and those of any face task."""
    if not face_tasks:
        return "the pose labels"
    return "the labels (pose, " + ", ".join(FACE_LABELS[t] for t in face_tasks) + ")"


def privacy_claim(
    *,
    method: str,
    epsilon: float | None,
    delta: float | None,
    psi: str | None,
    seeded: bool,
    accountant: str,
    released: str | None = None,
    unit: str = "record",
    records_per_patient: int | None = None,
    records_source: str | None = None,
    psi_dp: tuple[float, int] | None = None,
    face_tasks: tuple[str, ...] = (),
) -> str:
    """One honest sentence (or a few) describing the guarantee of a finished run.

    ``epsilon`` is the accountant's value for the history that actually ran
    (the max over sites for a federation); ``psi`` is the feature map's
    description (required for fdp/fpdp). ``seeded`` appends the P7 warning.
    ``released`` names what else the run releases beside the model (P10),
    and how that bears on the adjacency; it is appended as given.

    ``unit``: the privacy unit that ran. ``records_per_patient``: at record
    level, the most records any patient has (the group size of the bound;
    None: not known), ``records_source`` saying where that number comes from
    (a policy cap, this data's patient ids); at patient level, the cap on the
    records of a patient that training used (None: all of them).

    ``psi_dp`` = (eps_pix, m) when psi is itself a DP mechanism (dp-pixelize, released once per
    record): the claim adds what holds for a change of up to m pixels of one record, by basic
    composition of the psi release with the Feature-DP guarantee.

    ``face_tasks``: the face tasks that trained; under Feature-DP their labels are named as public too.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; choose one of {METHODS}")
    if unit not in UNITS:
        raise ValueError(f"unit={unit!r} is unknown; choose one of {UNITS}")
    if method == "nonprivate":
        text = "no privacy guarantee: non-private training on raw images"
    else:
        if epsilon is None or delta is None:
            raise ValueError(f"method={method!r} needs the epsilon and delta that were spent")
        if not (epsilon >= 0 and math.isfinite(epsilon)):
            raise ValueError(f"epsilon={epsilon!r} must be a finite non-negative number")
        if not 0 < delta < 1:
            raise ValueError(f"delta={delta!r} must be in (0, 1)")
        if method in WITH_PUBLIC and not psi:
            raise ValueError(f"method={method!r} needs the psi description for its claim")
        budget = f"(eps={epsilon:.4g}, delta={delta:.3g})"
        if unit == "patient":
            text = _patient_level(method, budget, psi, accountant, records_per_patient, face_tasks)
        else:
            text = _record_level(method, budget, psi, accountant, face_tasks)
            text += "; " + _for_a_patient(epsilon, delta, records_per_patient, records_source,
                                          feature=method in WITH_PUBLIC)
        if psi_dp is not None and method in WITH_PUBLIC:
            text += _psi_dp(epsilon, delta, psi_dp, unit)
        if method in PROJECTED:
            text += "; the projection basis is computed from public data only"
    if released and method != "nonprivate":
        text += f"; {released}"
    if seeded:
        text += "; seeded noise: not for production"
    return text


def _patient_level(method: str, budget: str, psi: str | None, accountant: str, records_per_patient: int | None,
                   face_tasks: tuple[str, ...]) -> str:
    used = "all of their records" if records_per_patient is None else \
        f"at most {records_per_patient} of their records"
    mechanism = (
        f"per site, Poisson sampling of patients, add/remove-one-patient adjacency (all of a "
        f"patient's records; each sampled patient contributes the clipped mean gradient of {used}), "
        f"{accountant.upper()} accountant"
    )
    if method not in WITH_PUBLIC:
        return f"patient-level {budget}-DP {mechanism}"
    labels = public_labels(face_tasks)
    return (
        f"{budget}-Feature-DP at patient level {mechanism}: psi(x) = {psi} of every image of a "
        f"patient and {labels} are treated as public and may be revealed by the model; "
        "this is not patient-level DP of the images; "
        + SERVER_READS.format(labels=labels.removeprefix("the "))
    )


def _record_level(method: str, budget: str, psi: str | None, accountant: str, face_tasks: tuple[str, ...]) -> str:
    mechanism = f"per site, Poisson sampling, add/remove-one-record adjacency, {accountant.upper()} accountant"
    if method not in WITH_PUBLIC:
        return f"record-level {budget}-DP {mechanism}"
    labels = public_labels(face_tasks)
    return (
        f"{budget}-Feature-DP {mechanism}: psi(x) = {psi} of each image and "
        f"{labels} are treated as public and may be revealed by the model; this is not "
        "record-level DP; " + SERVER_READS.format(labels=labels.removeprefix("the "))
    )


def _psi_dp(epsilon: float, delta: float, psi_dp: tuple[float, int], unit: str) -> str:
    """What holds for a change of up to m pixels of one record when psi is itself a DP pixelization."""
    eps_pix, m = psi_dp
    pixels = f"{m} pixel{'s' if m != 1 else ''}"
    text = (f"; psi(x) is itself an eps_pix={eps_pix:g} DP pixelization of each record's input crop, released "
            f"once: a change of up to {pixels} in one record's crop is "
            f"({epsilon + eps_pix:.4g}, {delta:.3g})-DP (basic composition)")
    if unit == "patient":
        text += f", in j of a patient's records (eps + j x {eps_pix:g}, {delta:.3g})-DP"
    return text + "; a larger change is covered by the Feature-DP statement only"


def _for_a_patient(epsilon: float, delta: float, k: int | None, source: str | None, *, feature: bool) -> str:
    """What a record-level guarantee means for a patient with up to k records (group privacy)."""
    kind = "Feature-DP" if feature else "DP"
    if k is None:
        return (f"no cap on records per patient is stated: a patient with k records is protected only at "
                f"(k eps, delta (e^(k eps) - 1) / (e^eps - 1))-{kind} by group privacy")
    eps_k, delta_k = group_privacy(epsilon=float(epsilon), delta=float(delta), k=int(k))
    where = f" ({source})" if source else ""
    if delta_k >= 1:
        return (f"for a patient with up to {k} records{where} group privacy gives no guarantee "
                f"(delta {delta_k:.3g} >= 1)")
    return (f"for a patient with up to {k} records{where}: (eps={eps_k:.4g}, delta={delta_k:.3g})-{kind} "
            "by group privacy")
