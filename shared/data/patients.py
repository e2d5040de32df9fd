"""Patient ids and per-patient groups of records: the unit of patient-level DP (issue #11).

A hospital camera films the same patient in many frames; record-level DP then
protects a patient only through group privacy (``fedpose.shared.privacy.accounting.group``).
Patient-level DP needs to know which records show the same person:

- the synthetic ward writes ``identities.json`` beside each split's
  annotations (one identity string per annotation);
- real data gives a ``patients.json`` sidecar in the same form (a json list of
  one patient id string per annotation, aligned with ``annotations.json``);
  it wins over ``identities.json`` when both exist;
- MPII and COCO carry no patient ids: record level is the only unit there,
  and asking for ``privacy.unit: patient`` on such data is an error.

``group_by_patient`` keeps at most ``cap`` records of each patient: a fixed
subset chosen by a hash of (seed, patient id, image file name, position), so
the same records are kept in every step, every round and every restart; the
rest of that patient's records are not used at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedpose.shared.data.records import MAX_PATIENT_ID, PoseRecord

log = logging.getLogger(__name__)

# Sidecars holding one patient id per annotation, in order of preference.
PATIENT_SIDECARS = ("patients.json", "identities.json")


def patient_sidecar(split_dir: str | Path) -> Path | None:
    """The split's patient-id sidecar (``patients.json``, else the ward's ``identities.json``), or None."""
    for name in PATIENT_SIDECARS:
        path = Path(split_dir) / name
        if path.is_file():
            return path
    return None


def read_patient_ids(path: str | Path, count: int) -> list[str]:
    """One patient id per annotation from a json list of strings; errors name the file."""
    path = Path(path)
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"cannot parse patient-id sidecar {path}: {err}") from err
    if not isinstance(ids, list) or not all(isinstance(i, str) and 0 < len(i) <= MAX_PATIENT_ID for i in ids):
        raise ValueError(f"patient-id sidecar {path}: expected a json list of non-empty strings (at most "
                         f"{MAX_PATIENT_ID} characters), one per annotation")
    if len(ids) != count:
        raise ValueError(f"patient-id sidecar {path} holds {len(ids)} ids but the annotation file has {count} "
                         "entries; they must be aligned one to one")
    return ids


def largest_group(records: Sequence[PoseRecord]) -> int | None:
    """The most records any one patient has, or None when some record carries no patient id."""
    counts: dict[str, int] = {}
    for record in records:
        if record.patient is None:
            return None
        counts[record.patient] = counts.get(record.patient, 0) + 1
    return max(counts.values(), default=0)


@dataclass(frozen=True)
class PatientGroups:
    """Records grouped by patient: ``members[j]`` are the indices (into the kept records) of patient j.

    ``largest`` is the most records any patient had before the cap (private
    data of the site: it is never sent; a record-level claim uses a stated cap).
    """

    members: tuple[tuple[int, ...], ...]
    largest: int

    @property
    def count(self) -> int:
        """Number of patients (the n of patient-level sampling)."""
        return len(self.members)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(m) for m in self.members)

    def expand(self, patients: Sequence[int]) -> tuple[list[int], list[int]]:
        """(record indices, group id per record) of the sampled ``patients``, patient by patient.

        Group ids are 0..len(patients)-1 in the order given, each patient's records contiguous.
        """
        records: list[int] = []
        groups: list[int] = []
        for position, patient in enumerate(patients):
            members = self.members[int(patient)]
            records.extend(members)
            groups.extend([position] * len(members))
        return records, groups


def _rank(seed: int, patient: str, record: PoseRecord, position: int) -> bytes:
    return hashlib.sha256(f"{seed}/{patient}/{record.image.name}/{position}".encode()).digest()


def group_by_patient(records: Sequence[PoseRecord], *, cap: int | None,
                     seed: int = 0) -> tuple[list[PoseRecord], PatientGroups]:
    """(kept records, their patient groups): at most ``cap`` records per patient (None: all).

    Which records of a patient with more than ``cap`` are kept depends only on
    (seed, patient id, image file name, position among the patient's records),
    never on other patients or on the step. Patients are numbered in order of
    first appearance; kept records stay in their original order.
    """
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"cap={cap!r} must be an int >= 1 or None")
    by_patient: dict[str, list[int]] = {}
    for index, record in enumerate(records):
        if record.patient is None:
            raise ValueError(
                f"record {index} ({record.image.name}) has no patient id: patient-level DP needs one per record "
                f"(a {' or '.join(PATIENT_SIDECARS)} sidecar beside annotations.json; MPII and COCO have none, so "
                "record level is the only unit there)")
        by_patient.setdefault(record.patient, []).append(index)
    keep: set[int] = set()
    for patient, indices in by_patient.items():
        if cap is None or len(indices) <= cap:
            keep.update(indices)
        else:
            ranked = sorted(range(len(indices)), key=lambda i: _rank(seed, patient, records[indices[i]], i))
            keep.update(indices[i] for i in ranked[:cap])
    kept_order = [i for i in range(len(records)) if i in keep]
    new_index = {old: new for new, old in enumerate(kept_order)}
    members = tuple(tuple(new_index[i] for i in indices if i in keep) for indices in by_patient.values())
    largest = max((len(v) for v in by_patient.values()), default=0)
    dropped = len(records) - len(kept_order)
    if dropped:
        log.info("patient cap %d: %d of %d records left out (a fixed subset per patient)", cap, dropped, len(records))
    return [records[i] for i in kept_order], PatientGroups(members=members, largest=largest)


def stated_group_size(records: Sequence[PoseRecord], cap: int | None) -> tuple[int | None, str | None]:
    """(k, where k comes from) for the group-privacy bound of a record-level claim on ``records``.

    With a stated ``cap`` the data must not hold more records of one patient
    (checked where it carries patient ids; ValueError otherwise) and k is the
    cap; without one, k is the most records any patient has (None when the
    data has no patient ids: nothing can be stated).
    """
    largest = largest_group(records)
    if cap is not None:
        if largest is not None and largest > cap:
            raise ValueError(f"max_records_per_patient = {cap}, but a patient has {largest} records in this data: "
                             "a record-level claim would understate what it means for that patient; raise the "
                             "cap or train at patient level")
        checked = "checked against this data's patient ids" if largest is not None else \
            "not checked: this data has no patient ids"
        return cap, f"the stated max_records_per_patient, {checked}"
    if largest is None:
        return None, None
    return largest, "the most any patient has in this data, from its patient ids"
