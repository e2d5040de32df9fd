"""The site's data and its own start-up checks (public digest, P2 disjointness, no duplicates,
delta < 1/n), run once per policy and data version; what the site declares to the server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from client.ledger import SiteLedger
from client.policy import SitePolicy, min_sigma_for
from shared.data.mpii import load_split
from shared.data.patients import PatientGroups, group_by_patient, stated_group_size
from shared.data.records import PoseRecord
from shared.data.split import check_disjoint, check_no_duplicates
from shared.data.split import manifest_digest as public_digest
from shared.federation_messages import Refusal, RefusalCode, SiteInfo
from shared.privacy.accountant import check_delta

log = logging.getLogger(__name__)



def load_split_dir(path: str | Path, what: str) -> list[PoseRecord]:
    path = Path(path)
    if not (path / "annotations.json").is_file():
        raise ValueError(f"{what} {path} is not a split directory (needs annotations.json and images/)")
    records = load_split(path.parent, path.name)
    if not records:
        raise ValueError(f"{what} {path} has no records")
    return records


@dataclass(frozen=True)
class CheckedSite:
    """A site's data after its own start-up checks passed.

    ``private``: the records it trains on (at patient level at most the policy's cap per patient);
    ``patients``: their patient groups at patient level, else None.
    """

    private: list[PoseRecord]
    public: list[PoseRecord] | None
    patients: PatientGroups | None = None


_CHECKED: dict[tuple, CheckedSite] = {}


def _data_version(*paths: str | None) -> tuple:
    out = []
    for path in paths:
        if path:
            stat = (Path(path) / "annotations.json").stat()
            out.append((path, stat.st_mtime_ns, stat.st_size))
    return tuple(out)


def check_site(policy: SitePolicy) -> CheckedSite:
    """The site's own checks of its policy and data; ValueError naming the problem (for the operator).

    - the private data loads, and delta < 1/n (n: records, or patients at
      patient level, whose records are then grouped and capped);
    - record level with a stated ``max_records_per_patient``: no patient has
      more records (where the data carries patient ids);
    - no image appears twice in the private data (a duplicate is a group of
      two, which record-level DP does not cover);
    - the public set matches the digest the operator approved, and shares
      no image with the private data (P2: V would see it without noise).
    """
    private = load_split_dir(policy.data_path, "site data")
    check_no_duplicates(private, what=f"site data {policy.data_path}")
    patients = None
    if policy.unit == "patient":
        private, patients = group_by_patient(private, cap=policy.max_records_per_patient)
        check_delta(policy.delta, patients.count)
    else:
        check_delta(policy.delta, len(private))
        stated_group_size(private, policy.max_records_per_patient)
    public = None
    if policy.public_path:
        public = load_split_dir(policy.public_path, "public set")
        digest = public_digest(public)
        if digest != policy.public_digest:
            raise ValueError(f"public set {policy.public_path} has manifest digest {digest}, but the policy approves "
                             f"{policy.public_digest}: approve the new set (`fedpose site-policy --check`) or "
                             "restore the approved one")
        try:
            check_disjoint(public, private)
        except ValueError as err:
            raise ValueError(f"public set {policy.public_path} holds some of this site's private images: {err}; "
                             "then approve its new digest") from err
    return CheckedSite(private=private, public=public, patients=patients)


def site_check(policy: SitePolicy) -> CheckedSite:
    """``check_site`` once per policy and data version; a failure refuses every request, generically.

    The detail goes to the site's own log; the server only learns that the
    site is misconfigured, the same answer whatever it sends (P10).
    """
    key = (policy, _data_version(policy.data_path, policy.public_path))
    if key not in _CHECKED:
        try:
            checked = check_site(policy)
        except (OSError, ValueError) as err:
            log.error("site %s is misconfigured and refuses every request until fixed: %s", policy.site, err)
            raise Refusal(RefusalCode.MISCONFIGURED,
                          "this site's own checks failed; its operator must run `fedpose site-policy --check`") from err
        log.info("site %s: policy and data checked (public set digest, P2 disjointness, no duplicates)", policy.site)
        _CHECKED.clear()
        _CHECKED[key] = checked
    return _CHECKED[key]


def site_info(policy: SitePolicy) -> SiteInfo:
    """Answer to the server's query: what the policy declares, and the spend so far (never n)."""
    site_check(policy)
    spend = spend_so_far(policy, None)
    return SiteInfo(
        site=policy.site, epsilon=policy.epsilon, delta=policy.delta, lifetime_rounds=policy.lifetime_rounds,
        rounds_per_federation=policy.rounds_per_federation, rounds_done=int(spend["site_rounds"]),
        epsilon_spent=spend["site_epsilon"],
        min_sigma=min_sigma_for(policy), sample_rate=policy.sample_rate, steps_per_round=policy.steps_per_round,
        clip_norm=policy.clip_norm, psi=policy.psi, psi_min=policy.psi_min, augment=policy.augment,
        accountant=policy.accountant, methods=policy.methods, unit=policy.unit,
        max_records_per_patient=policy.max_records_per_patient,
    )


def spend_so_far(policy: SitePolicy, federation: str | None) -> dict[str, float]:
    """The site's lifetime and per-federation epsilon and its rounds, from its own ledger."""
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
        life = ledger.epsilon(delta=policy.delta, accountant=policy.accountant)
        run = ledger.epsilon(delta=policy.delta, accountant=policy.accountant, federation=federation) \
            if federation else 0.0
        return {"site_epsilon": life, "run_epsilon": run, "site_rounds": ledger.rounds_done()}
