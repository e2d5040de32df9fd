"""The training methods, and what each one implies, defined once (docs/explanation/design.md: the step).

``nonprivate`` is plain SGD on the loss; the four private methods add clipping and Gaussian noise to the
private gradient, ``proj``/``fpdp`` project it onto the public subspace V after the noise, and ``fdp``/``fpdp``
add the noise-free public gradient on psi(x) (Feature-DP: psi(x) and the labels are public). A guarantee is
record-level DP only for the methods without that public term.
"""

from __future__ import annotations

from typing import Literal, get_args

Method = Literal["nonprivate", "dpsgd", "proj", "fdp", "fpdp"]
METHODS: tuple[Method, ...] = get_args(Method)

# method: (private: clipped and noised, projected: V (V^T g), public term: g_pub on psi(x))
_PROPERTIES: dict[str, tuple[bool, bool, bool]] = {
    "nonprivate": (False, False, False),
    "dpsgd": (True, False, False),
    "proj": (True, True, False),
    "fdp": (True, False, True),
    "fpdp": (True, True, True),
}
PRIVATE: tuple[Method, ...] = tuple(m for m in METHODS if _PROPERTIES[m][0])
PROJECTED: tuple[Method, ...] = tuple(m for m in METHODS if _PROPERTIES[m][1])
WITH_PUBLIC: tuple[Method, ...] = tuple(m for m in METHODS if _PROPERTIES[m][2])  # Feature-DP (opt-in, P17)
RECORD_LEVEL: tuple[Method, ...] = tuple(m for m in PRIVATE if m not in WITH_PUBLIC)  # record-level DP claims

# The privacy unit a private method protects: one record (image), or one patient with all of their records.
Unit = Literal["record", "patient"]
UNITS: tuple[Unit, ...] = get_args(Unit)


def raw_psi_conflict(images: str, method: str, unit: str, multiplicity: int) -> str | None:
    """Why ``train.images`` raw+psi cannot run with this method, unit and augmentation multiplicity; None if it can
    (and for any other ``images``).

    It clips a record's image and psi of its crop as one group, which keeps one record's bound only where the step
    clips per record and adds nothing of psi(x) outside the clip. The one rule the run, a site and the server read.
    """
    if images == "raw+psi" and (method in WITH_PUBLIC or unit != "record" or multiplicity > 1):
        return (f"train.images: raw+psi clips a record's image and its psi(x) as one group, for nonprivate, dpsgd "
                f"or proj at record level without augmentation multiplicity; method is {method!r}, privacy.unit "
                f"{unit!r}, augment_multiplicity {multiplicity}")
    return None


def rows_per_record(images: str, augment_multiplicity: int) -> int:
    """The rows one sampled record gives a private step: its image and psi of its crop under ``train.images``
    raw+psi, else its ``augment_multiplicity`` augmented copies."""
    return 2 if images == "raw+psi" else augment_multiplicity


def clips_groups(unit: str, rows: int) -> bool:
    """True when the step clips groups of rows as one: a patient's records, or a record's ``rows`` (above 1) as
    one mean. The one rule the step's spec and a site's memory sizing read."""
    return unit == "patient" or rows > 1
