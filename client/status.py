"""A hospital site's status in its operator's terms: ``fedpose site status`` and the site console.

Read-only, from the files the SuperNode itself uses: the policy, the record of the site's checks, its
ledger (spend and refusals), its approved-apps file, its CA certificate, and the kit's ``kit.json``
(the SuperLink address). Nothing here is sent anywhere.
"""

from __future__ import annotations

import datetime
import json
import socket
from pathlib import Path
from typing import Any

from fedpose.shared.flower.messages import RefusalCode
from fedpose.shared.privacy.accounting.claims import public_labels
from fedpose.shared.configuration.methods import RECORD_LEVEL

RECENT = 25  # rows and refusals shown


def guarantee_in_force(policy: Any) -> str:
    """The guarantee this site's policy allows, in one line (``fedpose site status``, the console)."""
    from fedpose.shared.configuration.methods import WITH_PUBLIC

    unit = "patient" if policy.unit == "patient" else "record"
    feature = [m for m in policy.methods if m in WITH_PUBLIC]
    if not feature:
        return f"record-level DP ({unit} level; methods {', '.join(policy.methods)}); Feature-DP not allowed"
    from fedpose.client.policy import what_the_draws_show

    return (f"Feature-DP opted in (methods {', '.join(policy.methods)}): under {' and '.join(feature)} the server can "
            f"read, exactly, a blurred copy of each image drawn and its labels; {what_the_draws_show(policy)}; "
            "record-level DP only when a federation runs dpsgd or proj")


def plain_policy(policy: Any) -> list[str]:
    """What the policy means, in sentences a data-protection officer can check."""
    from fedpose.client.policy import min_sigma_for, what_the_draws_show
    from fedpose.shared.configuration.methods import WITH_PUBLIC

    unit = "patient-level (every image of one person)" if policy.unit == "patient" else "record-level (one image)"
    methods = set(policy.methods)
    noised = (f"each update is {policy.steps_per_round} training steps at most, with Gaussian noise of at least "
              f"sigma = {min_sigma_for(policy):.3f} times the clip bound C = {policy.clip_norm:g} added to the sum of "
              "the clipped per-image gradients.")
    if methods & set(WITH_PUBLIC):
        first = ("Model updates leave this hospital, and under Feature-DP (fdp, fpdp, opted in by this policy) they "
                 "carry blurred images and labels too: " + noised)
    else:
        first = "Only model updates leave this hospital, never images, labels or records: " + noised
    lines = [
        first,
        f"Budget: epsilon = {policy.epsilon:g} at delta = {policy.delta:g} over this site's whole life "
        f"({policy.lifetime_rounds} rounds, at most {policy.rounds_per_federation} in any one federation), counted "
        f"by the {policy.accountant.upper()} accountant from what actually ran; no request can take more.",
    ]
    if methods & set(RECORD_LEVEL):
        lines.append(f"With dpsgd or proj the guarantee is {unit} (epsilon, delta)-differential privacy: adding "
                     f"or removing one {policy.unit} changes what leaves the site only within epsilon, delta.")
    if methods & set(WITH_PUBLIC):
        kind = "a Gaussian blur" if policy.psi == "blur" else "a pixelation"
        lines.append(f"With fdp or fpdp it is Feature-DP, not record-level DP: {kind} of each image (strength at "
                     f"least {policy.psi_min:g} of its shorter side) and {public_labels(policy.face_tasks)} are "
                     "treated as public; only what the blur removes is protected. The server can read, exactly, a "
                     "blurred copy of each image drawn for the public term and its pose labels "
                     f"({policy.public_batch_size} records a step, each at most once a step) from a single reply; "
                     f"{what_the_draws_show(policy)}. This policy opts in to that "
                     "(release_blurred_images_and_labels: true).")
    lines.append(f"The server sees what this policy declares: the sample rate q = {policy.sample_rate:g} and the "
                 f"expected batch B = {policy.expected_batch:g} (together about B / q = "
                 f"{policy.expected_batch / policy.sample_rate:.0f} {policy.unit}s, the size of the data when the "
                 "policy was written), steps, clip, psi, privacy unit, budget and spend.")
    lines.append("A reply leaves at a fixed " + (f"{policy.round_seconds:g} s after its request" if policy.round_seconds
                 else "time only if round_seconds is set: without it the server sees how long a round took") + "; "
                 "whether this site's files changed since its checks ran shows as a refusal until they run again.")
    return lines


def _certificate(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {"path": str(path) if path else None, "expires": None, "days_left": None}
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(path.read_bytes())
    expires = cert.not_valid_after_utc
    days = (expires - datetime.datetime.now(datetime.timezone.utc)).days
    return {"path": str(path), "expires": expires.date().isoformat(), "days_left": days}


def _reachable(address: str | None, timeout: float = 3.0) -> bool | None:
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _kit(policy_path: Path) -> dict[str, Any]:
    path = policy_path.parent / "kit.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}


def _named_site(policy_path: Path) -> str | None:
    """The site a policy file names, read from its YAML alone: a policy that does not load yet (a kit's, not
    filled in) still says whose it is."""
    import yaml

    try:
        raw = yaml.safe_load(policy_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    site = raw.get("site") if isinstance(raw, dict) else None
    return str(site) if isinstance(site, str) and site.strip() else None


def site_status(policy_path: str | Path, *, approved: str | Path | None = None, superlink: str | None = None,
                ca: str | Path | None = None) -> dict[str, Any]:
    """Everything an operator checks before and during a pilot; ``healthy`` is False when any of it fails."""
    from fedpose.client.app_trust import parse_approved
    from fedpose.client.ledger import SiteLedger
    from fedpose.client.policy import load_policy
    from fedpose.client.data import read_site_check
    from fedpose.client.fingerprint import data_version, policy_fingerprint
    from fedpose.shared.privacy.accounting.accountant import epsilon_spent

    policy_path = Path(policy_path).expanduser().resolve()
    kit = _kit(policy_path)
    problems: list[str] = []
    status: dict[str, Any] = {"kind": "site", "site": None, "problems": problems}
    try:
        policy = load_policy(policy_path)
    except (OSError, ValueError) as err:
        status.update(policy={"path": str(policy_path), "valid": False, "error": str(err), "plain": []},
                      healthy=False, site=_named_site(policy_path))
        problems.append(f"policy: {err}")
        return status
    status["site"] = policy.site
    status["policy"] = {"path": str(policy_path), "valid": True, "error": None, "plain": plain_policy(policy),
                        "guarantee": guarantee_in_force(policy),
                        "methods": list(policy.allowed_methods), "unit": policy.unit, "epsilon": policy.epsilon,
                        "delta": policy.delta, "sample_rate": policy.sample_rate,
                        "expected_batch": policy.expected_batch, "round_seconds": policy.round_seconds}
    record = read_site_check(policy)
    problem = None
    if record is None:
        problem = "the site's checks have not been run: fedpose site check --policy " + str(policy_path)
    elif record.policy != policy_fingerprint(policy):
        problem = "the policy changed since the checks ran: fedpose site check --policy " + str(policy_path)
    elif record.data_version != data_version(policy):
        problem = "the data files changed since the checks ran: fedpose site check --policy " + str(policy_path)
    if problem:
        problems.append(problem)
    status["checks"] = {"current": problem is None, "problem": problem,
                        "checked_at": record.checked_at if record else None,
                        "records": record.records if record else None,
                        "dropped": len(record.dropped) if record else None,
                        "alerts": list(record.alerts) if record else []}
    status["public_set"] = {"approved": bool(policy.public_digest) and problem is None, "path": policy.public_path,
                            "digest": policy.public_digest,
                            "problem": None if policy.public_path else "no public set (the site cannot compute V)"}
    approved_path = Path(approved) if approved else policy_path.parent / kit.get("approved", "approved.txt")
    bundles: list[dict[str, str]] = []
    if approved_path.is_file():
        for raw in approved_path.read_text(encoding="utf-8").splitlines():
            digest, _, note = raw.partition("#")
            if digest.strip():
                bundles.append({"digest": digest.strip().lower(), "note": note.strip()})
        parse_approved(approved_path.read_text(encoding="utf-8"), origin=str(approved_path))
    else:
        problems.append(f"no approved app bundle ({approved_path}): fedpose site approve --bundle APP.fab "
                        f"--approved {approved_path}")
    status["bundles"] = {"path": str(approved_path), "approved": bundles}

    with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
        rows = ledger.rows()
        events = ledger.events()
    history = [(r["sigma"], r["sample_rate"], r["steps"]) for r in rows]

    def eps(selected: list[tuple]) -> float:
        from fedpose.shared.privacy.accounting.accountant import StepRecord

        records = [StepRecord(sigma=s, sample_rate=q, steps=k) for s, q, k in selected]
        return epsilon_spent(records, delta=policy.delta, accountant=policy.accountant) if records else 0.0

    lifetime = eps(history)
    federations = []
    for federation in dict.fromkeys(r["federation"] for r in rows):
        mine = [r for r in rows if r["federation"] == federation]
        federations.append({"federation": federation, "spent": eps([(r["sigma"], r["sample_rate"], r["steps"])
                                                                     for r in mine]),
                            "rounds": len(mine), "rounds_max": policy.rounds_per_federation})
    status["budget"] = {"lifetime": {"spent": lifetime, "budget": policy.epsilon, "left": max(0.0, policy.epsilon -
                                                                                             lifetime),
                                     "rounds": len(rows), "rounds_max": policy.lifetime_rounds},
                        "federations": federations}
    if lifetime >= policy.epsilon * (1 - 1e-9):
        problems.append(f"the lifetime budget is spent (eps {lifetime:.4f} of {policy.epsilon:g}): this site refuses "
                        "every further round")
    elif len(rows) >= policy.lifetime_rounds:
        problems.append(f"all {policy.lifetime_rounds} lifetime rounds are used: this site refuses every further round "
                        "(a new budget needs a new policy, agreed with the data-protection officer)")
    status["rounds"] = [{k: r[k] for k in ("federation", "round", "method", "psi", "unit", "sigma", "sample_rate",
                                           "steps", "epsilon", "state", "recorded_at")} for r in rows[-RECENT:]]
    status["refusals"] = [{**e, "code_name": RefusalCode(e["code"]).name if e["code"] in
                           {int(c) for c in RefusalCode} else str(e["code"])} for e in events[-RECENT:]]
    address = superlink or kit.get("superlink")
    reachable = _reachable(address)
    if reachable is False:
        problems.append(f"the SuperLink {address} is not reachable from here (the one outbound TLS port)")
    status["superlink"] = {"address": address, "reachable": reachable}
    ca_path = Path(ca) if ca else (policy_path.parent / kit.get("ca", "ca.crt"))
    status["certificate"] = _certificate(ca_path)
    days = status["certificate"]["days_left"]
    if days is not None and days < 0:
        problems.append(f"the CA certificate {ca_path} has expired: ask the operator for the renewed kit")
    status["healthy"] = not problems
    return status


def site_metrics(status: dict[str, Any]) -> list[tuple[str, dict[str, str], float, str]]:
    """Prometheus samples of a site status."""
    site = status.get("site") or ""
    labels = {"site": site}
    out: list[tuple[str, dict[str, str], float, str]] = [
        ("fedpose_site_healthy", labels, float(bool(status.get("healthy"))), "1 when every check of the site passes")]
    if "budget" not in status:
        return out
    life = status["budget"]["lifetime"]
    out += [("fedpose_site_epsilon_spent", {**labels, "scope": "lifetime"}, life["spent"],
             "epsilon spent by the site's ledger"),
            ("fedpose_site_epsilon_budget", labels, life["budget"], "the site's lifetime epsilon budget"),
            ("fedpose_site_rounds", labels, life["rounds"], "rounds the site has spent"),
            ("fedpose_site_checks_current", labels, float(status["checks"]["current"]),
             "1 when the site's checks are current for its policy and files")]
    for f in status["budget"]["federations"]:
        out.append(("fedpose_site_epsilon_spent", {**labels, "scope": "federation", "federation": f["federation"]},
                    f["spent"], "epsilon spent by the site's ledger"))
    codes: dict[str, int] = {}
    for e in status["refusals"]:
        codes[e["code_name"]] = codes.get(e["code_name"], 0) + 1
    for code, count in sorted(codes.items()):
        out.append(("fedpose_site_refusals", {**labels, "code": code}, count, "recent refusals by code"))
    if status["certificate"]["days_left"] is not None:
        out.append(("fedpose_site_certificate_days_left", labels, status["certificate"]["days_left"],
                    "days until the CA certificate expires"))
    return out
