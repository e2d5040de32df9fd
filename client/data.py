"""The site's data and its own checks (public digest, P2 disjointness, duplicates, patient cap, delta < 1/n),
run by its operator, not per message (P13); what the site declares to the server.

``prepare_site`` is the operator's step (``fedpose site check``, ``fedpose site start --policy``,
``fedpose site-policy --check``, and ``fedpose simulate`` for its simulated sites): it reads every
private image once, leaves out the records that would break the claim (an image present twice, a
private image also in the public set, records of a patient beyond the policy's cap) with an alert for
the operator, and records the outcome beside the ledger (``<ledger>.check.json``), keyed by the policy
and by the data's version (file sizes and modification times, never their content:
``fedpose.client.fingerprint``).

Serving a message (``site_ready``) reads only that record and a few ``stat`` calls: a query or a
refused request costs the same time and gives the same answer whatever the private data holds. The
private records are loaded only after a round is charged (``load_checked``). What the server can
still observe is whether the site's files changed since its operator last checked them (a refusal
until the operator runs the check again), never what changed; the threat model names it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fedpose.client.ledger import SiteLedger
from fedpose.client.policy import SitePolicy, min_sigma_for
from fedpose.client.fingerprint import data_version, policy_fingerprint
from fedpose.shared.configuration.methods import WITH_PUBLIC
from fedpose.shared.data.mpii import load_split
from fedpose.shared.data.patients import PatientGroups, group_by_patient
from fedpose.shared.data.records import PoseRecord
from fedpose.shared.data.records import content_hash
from fedpose.shared.errors import PrivacyRefusal
from fedpose.shared.data.split import manifest_digest as public_digest
from fedpose.shared.flower.messages import Refusal, RefusalCode, SiteInfo
from fedpose.shared.private_files import open_private, private_dir
from fedpose.shared.privacy.accounting.accountant import check_delta

log = logging.getLogger(__name__)

CHECK_VERSION = 1


def load_split_dir(path: str | Path, what: str) -> list[PoseRecord]:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{what} {path} does not exist (no such directory): give the split's folder, which "
                                "holds annotations.json and images/")
    if not (path / "annotations.json").is_file():
        raise ValueError(f"{what} {path} is not a split directory (needs annotations.json and images/)")
    records = load_split(path.parent, path.name)
    if not records:
        raise ValueError(f"{what} {path} has no records")
    return records


@dataclass(frozen=True)
class CheckedSite:
    """A site's data after its own checks.

    ``private``: the records it trains on (records that would break the claim left out);
    ``patients``: their patient groups at patient level, else None; ``dropped``: indices (in the split's
    load order) of the records left out; ``alerts``: what the operator should know, in words.
    """

    private: list[PoseRecord]
    public: list[PoseRecord] | None
    patients: PatientGroups | None = None
    dropped: tuple[int, ...] = ()
    alerts: tuple[str, ...] = ()
    public_pool: tuple[int, ...] | None = None  # ``public_records``: indices of ``private`` the public term draws from


@dataclass(frozen=True)
class SiteCheck:
    """The persisted outcome of ``prepare_site`` (the site's own file; it never leaves the site)."""

    policy: str  # fingerprint of the policy checked
    data_version: str  # of the private, public and eval files when checked
    records: int  # private records kept (the site's n at record level)
    units: int  # privacy units kept: records, or patients at patient level
    dropped: tuple[int, ...]
    alerts: tuple[str, ...]
    checked_at: str
    version: int = CHECK_VERSION
    extra: dict = field(default_factory=dict)


def _check_path(policy: SitePolicy) -> Path:
    return Path(policy.ledger_path).with_suffix(".check.json")


def _duplicates(records: list[PoseRecord], public_hashes: set[str]) -> tuple[set[int], int, int, dict[Path, str]]:
    """Indices of records whose image repeats an earlier private image or is in the public set; and each image's
    content hash."""
    seen: dict[str, Path] = {}
    drop: set[int] = set()
    repeated = in_public = 0
    by_image: dict[Path, str] = {}
    for index, record in enumerate(records):
        if record.image not in by_image:
            by_image[record.image] = content_hash(record.image)
            digest = by_image[record.image]
            if digest in public_hashes:
                in_public += 1
            elif digest in seen:
                repeated += 1
            else:
                seen[digest] = record.image
        digest = by_image[record.image]
        if digest in public_hashes or seen.get(digest) != record.image:
            drop.add(index)
    return drop, repeated, in_public, by_image


def public_pool(policy: SitePolicy, records: list[PoseRecord], hashes: dict[Path, str]) -> tuple[int, ...] | None:
    """The fixed set the public term draws from (``public_records``; P17): indices into ``records`` of the first
    ``public_records`` in the order of their images' content hashes (then load order), so every check of the same
    data chooses the same set, and a server cannot steer which. None: the draws reach every record."""
    m = policy.public_records
    if m is None or not set(policy.allowed_methods) & set(WITH_PUBLIC):
        return None
    if m > len(records):
        raise ValueError(f"site policy: public_records={m} is more than the {len(records)} records kept at this "
                         "site; lower it")
    order = sorted(range(len(records)), key=lambda i: (hashes[records[i].image], i))
    return tuple(sorted(order[:m]))


def check_site(policy: SitePolicy) -> CheckedSite:
    """The site's own checks of its policy and data (reads every private image; the operator's step).

    Hard failures (ValueError naming the problem, for the operator): unreadable or empty data, a public
    set whose digest is not the approved one, delta >= 1/n. Records that would break the claim are left
    out, each kind with an alert: an image present twice (a duplicate is a group of two, which
    record-level DP does not cover), a private image also in the public set (V would see it without
    noise, P2), records of a patient beyond ``max_records_per_patient``. Leaving them out here, once,
    keeps the outcome off every reply: the server sees the same site whatever the data holds.
    """
    private = load_split_dir(policy.data_path, "site data")
    public = None
    public_hashes: set[str] = set()
    if policy.public_path:
        public = load_split_dir(policy.public_path, "public set")
        digest = public_digest(public)
        if digest != policy.public_digest:
            raise ValueError(f"public set {policy.public_path} has manifest digest {digest}, but the policy approves "
                             f"{policy.public_digest}: approve the new set (`fedpose site approve-public`) or "
                             "restore the approved one")
        public_hashes = {content_hash(path) for path in dict.fromkeys(r.image for r in public)}
    drop, repeated, in_public, hashes = _duplicates(private, public_hashes)
    alerts = []
    if repeated:
        alerts.append(f"{repeated} private image(s) repeat another private image (same pixels): their records are "
                      "left out, each image is trained on once")
    if in_public:
        alerts.append(f"{in_public} private image(s) are also in the public set: their records are left out of "
                      "training (the public set must not hold private images)")
    kept = [i for i in range(len(private)) if i not in drop]
    records = [private[i] for i in kept]
    patients = None
    cap = policy.max_records_per_patient
    has_ids = all(r.patient is not None for r in records)
    if policy.unit == "patient" or (cap is not None and has_ids):
        grouped, patients = group_by_patient(records, cap=cap)
        if len(grouped) < len(records):
            keep_ids = {id(r) for r in grouped}
            beyond = [i for i, r in zip(kept, records) if id(r) not in keep_ids]
            drop.update(beyond)
            alerts.append(f"{len(beyond)} record(s) of patients with more than max_records_per_patient={cap} are "
                          "left out (a fixed subset of each such patient is kept)")
            records = grouped
        elif policy.unit == "patient":  # in the order load_checked trains on them
            records = grouped
        if policy.unit != "patient":
            patients = None
    units = patients.count if patients is not None else len(records)
    if units == 0:
        raise ValueError(f"site data {policy.data_path}: no record is left to train on after the checks")
    check_delta(policy.delta, units)
    if set(policy.allowed_methods) & set(WITH_PUBLIC) and policy.public_batch_size > len(records):
        raise ValueError(f"site policy: public_batch_size={policy.public_batch_size} is larger than the "
                         f"{len(records)} records kept at this site: fdp/fpdp draw that many distinct records each "
                         "step; lower it")
    pool = public_pool(policy, records, hashes)
    for alert in alerts:
        log.warning("site %s: %s", policy.site, alert)
    return CheckedSite(private=records, public=public, patients=patients, dropped=tuple(sorted(drop)),
                       alerts=tuple(alerts), public_pool=pool)


def check_ledger_continuity(policy: SitePolicy, id_file: Path) -> str:
    """The site's ledger is the one it always had: refuse a missing or replaced ledger once one existed.

    Losing the ledger would silently reset the lifetime budget. ``id_file`` (beside the policy, outside the
    state folder) keeps the ledger's id from its first check; a ledger that is missing, or that is another
    file, is refused until it is restored from backup (or ``id_file`` is deleted on purpose, to start over).
    """
    ledger_path = Path(policy.ledger_path)
    known = id_file.read_text().strip() if id_file.is_file() else None
    if known is not None and not ledger_path.exists():
        raise PrivacyRefusal(f"site ledger {ledger_path} is missing, but this site had one (id {known}, in {id_file}): "
                         "restore it from its backup; to start a new budget on purpose, delete that file")
    with SiteLedger(ledger_path, site=policy.site) as ledger:
        current = ledger.ledger_id()
    if known is not None and known != current:
        raise PrivacyRefusal(f"site ledger {ledger_path} is not the ledger this site had "
                         f"(id {current}, expected {known}): restore the right one from its backup; to start a new "
                         f"budget on purpose, delete {id_file}")
    if known is None:
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(current + "\n")
    return current


def prepare_site(policy: SitePolicy, *, id_file: Path | None = None) -> SiteCheck:
    """Run the site's checks and record their outcome beside the ledger (atomic); the operator's step.

    ``id_file`` (the operator's commands pass ``ledger.id`` beside the policy): refuse a missing or replaced
    ledger once one existed (``check_ledger_continuity``).
    """
    if id_file is not None:
        check_ledger_continuity(policy, id_file)
    version = data_version(policy)
    checked = check_site(policy)
    record = SiteCheck(policy=policy_fingerprint(policy), data_version=version, records=len(checked.private),
                       units=checked.patients.count if checked.patients is not None else len(checked.private),
                       dropped=checked.dropped, alerts=checked.alerts,
                       checked_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       extra={} if checked.public_pool is None else {"public_pool": list(checked.public_pool)})
    if data_version(policy) != version:
        raise ValueError(f"site data {policy.data_path} changed while it was being checked: run the check again")
    path = _check_path(policy)
    private_dir(path.parent)  # the state folder: made 0700; the record (it holds the record count) 0600
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8", opener=open_private) as fh:
        fh.write(json.dumps(asdict(record), indent=1))
    tmp.replace(path)
    log.info("site %s: policy and data checked (%d records kept, %d left out); outcome in %s", policy.site,
             record.records, len(record.dropped), path)
    return record


def read_site_check(policy: SitePolicy) -> SiteCheck | None:
    """The recorded outcome of the site's checks, or None when there is none (or it is unreadable)."""
    path = _check_path(policy)
    try:
        data = json.loads(path.read_text())
        data["dropped"] = tuple(data["dropped"])
        data["alerts"] = tuple(data["alerts"])
        return SiteCheck(**data)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def site_ready(policy: SitePolicy) -> SiteCheck:
    """The site's checks passed for this policy and these files, or a generic refusal; reads no private data.

    A message never runs the checks itself: their time and outcome would depend on the private data. The
    refusal says the same thing whatever is wrong; the detail goes to the site's own log.
    """
    record = read_site_check(policy)
    problem = None
    if record is None or record.version != CHECK_VERSION:
        problem = "its checks have not been run"
    elif record.policy != policy_fingerprint(policy):
        problem = "its policy changed since its checks ran"
    elif record.data_version != data_version(policy):
        problem = "its data files changed since its checks ran"
    if problem is not None or record is None:  # record is None only with a problem: this narrows its type
        log.error("site %s refuses every request until its operator runs `fedpose site check --policy ...`: %s",
                  policy.site, problem)
        raise Refusal(RefusalCode.MISCONFIGURED,
                      "this site's own checks are not current; its operator must run `fedpose site check`")
    return record


def load_public(policy: SitePolicy) -> list[PoseRecord] | None:
    """The site's copy of the public set (approved by digest when the checks ran); None without one."""
    return load_split_dir(policy.public_path, "public set") if policy.public_path else None


def load_checked(policy: SitePolicy, ready: SiteCheck) -> CheckedSite:
    """The records to train on, as the checks left them: only after the round is charged (reads private data)."""
    private = load_split_dir(policy.data_path, "site data")
    drop = set(ready.dropped)
    records = [r for i, r in enumerate(private) if i not in drop]
    patients = None
    if policy.unit == "patient":
        records, patients = group_by_patient(records, cap=policy.max_records_per_patient)
    if len(records) != ready.records:
        raise ValueError(f"site data {policy.data_path} holds other records than when it was checked "
                         f"({len(records)} kept now, {ready.records} then): run `fedpose site check` again")
    pool = ready.extra.get("public_pool")
    return CheckedSite(private=records, public=None, patients=patients, dropped=ready.dropped, alerts=ready.alerts,
                       public_pool=None if pool is None else tuple(int(i) for i in pool))


def site_info(policy: SitePolicy) -> SiteInfo:
    """Answer to the server's query: what the policy declares, and the spend so far (never n)."""
    site_ready(policy)
    spend = spend_so_far(policy, None)
    return SiteInfo(
        site=policy.site, epsilon=policy.epsilon, delta=policy.delta, lifetime_rounds=policy.lifetime_rounds,
        rounds_per_federation=policy.rounds_per_federation, rounds_done=int(spend["site_rounds"]),
        epsilon_spent=spend["site_epsilon"],
        min_sigma=min_sigma_for(policy), sample_rate=policy.sample_rate, steps_per_round=policy.steps_per_round,
        clip_norm=policy.clip_norm, psi=policy.psi, psi_min=policy.psi_min, augment=policy.augment,
        accountant=policy.accountant, methods=policy.allowed_methods, unit=policy.unit,
        max_records_per_patient=policy.max_records_per_patient,
    )


def spend_so_far(policy: SitePolicy, federation: str | None) -> dict[str, float]:
    """The site's lifetime and per-federation epsilon and its rounds, from its own ledger."""
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
        life = ledger.epsilon(delta=policy.delta, accountant=policy.accountant)
        run = ledger.epsilon(delta=policy.delta, accountant=policy.accountant, federation=federation) \
            if federation else 0.0
        return {"site_epsilon": life, "run_epsilon": run, "site_rounds": ledger.rounds_done()}


def report_check(policy: SitePolicy, policy_path: Path, *, echo: Callable[[str], None] = print,
                 measure: bool = True) -> None:
    """Run the site's own checks (``prepare_site``: recorded for its SuperNode, which never re-reads the data) and
    say through ``echo`` how they went (``fedpose site check``, ``site start --policy``, ``site-policy``).

    The ledger's id is kept in ``ledger.id`` beside the policy: a ledger lost later is refused, not re-created.
    ``measure`` (``site check``, ``site-policy --check``; not ``site start``, which checks again what changed):
    time and measure one private chunk at the policy's limits, refusing a policy whose worst case does not fit
    (``fedpose.client.capacity.worst_case_report``).
    """
    check = prepare_site(policy, id_file=policy_path.parent / "ledger.id")
    spend = spend_so_far(policy, None)
    unit = "patients" if policy.unit == "patient" else "records"
    echo(f"checked: {check.units} {unit} to train on, delta < 1/n, no image twice"
         + (", the public set matches its approved digest and shares no image with the private data"
            if policy.public_path else ", no public set (basis_mode site needs one)"))
    for alert in check.alerts:
        echo(f"alert: {alert}")
    echo(f"ledger {policy.ledger_path}: writable, {int(spend['site_rounds'])} rounds recorded, lifetime eps spent "
         f"{spend['site_epsilon']:.4f} of {policy.epsilon:g}")
    cap = policy.max_records_per_patient
    if policy.unit == "patient":
        echo(f"unit: patient ({check.units} patients; each contributes the clipped mean gradient of "
             f"{'all' if cap is None else f'at most {cap}'} of their records; sample_rate is per patient)")
    else:
        echo("unit: record" + (f" (stated cap {cap} records per patient: the claim's group bound)" if cap else
                               " (no cap on records per patient stated: the claim says a patient with k records "
                               "gets only k eps)"))
    echo(f"public constants the server sees: sample_rate q={policy.sample_rate:g} and expected batch "
         f"B={policy.expected_batch:g} (together they tell the size of the data when the policy was written, "
         f"about B / q = {policy.expected_batch / policy.sample_rate:.0f} {unit})")
    from fedpose.client.capacity import worst_case_report

    try:
        worst = worst_case_report(policy, check.units) if measure else []
    except ValueError:  # the worst case does not fit: no record of a passed check, so the site serves nothing
        _check_path(policy).unlink(missing_ok=True)
        raise
    for line in worst:
        echo(line)
    echo(f"minimum sigma this site accepts: {min_sigma_for(policy):.4f} ({policy.lifetime_rounds} lifetime rounds x "
         f"{policy.steps_per_round} steps at q={policy.sample_rate:g}, eps={policy.epsilon:g}, "
         f"delta={policy.delta:g}, {policy.accountant})")
    if policy.unit == "record":  # the measured curve is record-level
        from fedpose.client.outlook import outlook

        echo(outlook(records=check.units, sigma=min_sigma_for(policy), expected_batch=policy.expected_batch,
                     steps=policy.lifetime_rounds * policy.steps_per_round, epsilon=policy.epsilon))
