"""``fedpose site-policy``: write a site's privacy policy YAML, or check one (the site's own checks, recorded).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _units(policy_data: dict, base: Path) -> int:
    """The site's privacy units (records, or patients at patient level) in its data: read locally, once."""
    from fedpose.client.site_data import load_split_dir
    from fedpose.shared.data.patients import group_by_patient

    data = Path(policy_data["data_path"])
    records = load_split_dir(data if data.is_absolute() else base / data, "site data")
    if policy_data.get("unit") == "patient":
        return group_by_patient(records, cap=policy_data.get("max_records_per_patient"))[1].count
    return len(records)


def cmd_site_policy(args: argparse.Namespace) -> int:
    from fedpose.client.policy import load_policy, policy_from_dict, policy_to_dict, write_policy
    from fedpose.client.site_data import load_split_dir
    from fedpose.shared.data.split import manifest_digest as public_digest

    if args.check:
        policy = load_policy(args.check)
    else:
        required = ("out", "site", "epsilon", "delta", "lifetime_rounds", "expected_batch", "steps_per_round",
                    "data_path")
        missing = [f"--{n.replace('_', '-')}" for n in required if getattr(args, n) is None]
        if missing:
            raise ValueError(f"site-policy: give {', '.join(missing)} (or --check FILE)")
        out = Path(args.out).resolve()
        digest = None
        if args.public_path:
            public = Path(args.public_path)
            public = public if public.is_absolute() else (out.parent / public)
            digest = public_digest(load_split_dir(public.resolve(), "public set"))
        data = {
            "policy_version": 3, "site": args.site, "epsilon": args.epsilon, "delta": args.delta,
            "lifetime_rounds": args.lifetime_rounds,
            "rounds_per_federation": args.rounds_per_federation or args.lifetime_rounds,
            "sample_rate": args.sample_rate, "expected_batch": args.expected_batch,
            "steps_per_round": args.steps_per_round, "clip_norm": args.clip_norm,
            "psi": args.psi, "psi_min": args.psi_min, "augment": not args.no_augment,
            "data_path": args.data_path, "ledger_path": args.ledger_path or "ledger.sqlite",
            "public_path": args.public_path, "public_digest": digest, "min_sigma": args.min_sigma,
            "eval_path": args.eval_path, "accountant": args.accountant,
            "methods": args.methods.split(",") if args.methods else None,
            "release_blurred_images_and_labels": args.release_blurred_images_and_labels,
            "public_batch_size": args.public_batch_size,
            "unit": args.unit, "max_records_per_patient": args.max_records_per_patient,
        }
        if data["sample_rate"] is None:  # q = B / n from the data, here, once: n itself is never written
            data["sample_rate"] = round(min(1.0, args.expected_batch / _units(data, out.parent)), 4)
        policy = policy_from_dict(data, base=out.parent)
        write_policy(out, policy)
        print(f"wrote {out}" + (f" (approving the public set {policy.public_path}, digest {digest})" if digest else ""))
    print(json.dumps(policy_to_dict(policy), indent=1))
    report_check(policy, Path(args.check or args.out).resolve())
    return 0


def report_check(policy, policy_path: Path) -> None:
    """Run the site's own checks (recorded for its SuperNode, which never re-reads the data) and say how they went.

    The ledger's id is kept in ``ledger.id`` beside the policy: a ledger lost later is refused, not re-created.
    """
    from fedpose.client.policy import min_sigma_for
    from fedpose.client.site_data import prepare_site, spend_so_far

    check = prepare_site(policy, id_file=policy_path.parent / "ledger.id")
    spend = spend_so_far(policy, None)
    unit = "patients" if policy.unit == "patient" else "records"
    print(f"checked: {check.units} {unit} to train on, delta < 1/n, no image twice"
          + (", the public set matches its approved digest and shares no image with the private data"
             if policy.public_path else ", no public set (basis_mode site needs one)"))
    for alert in check.alerts:
        print(f"alert: {alert}")
    print(f"ledger {policy.ledger_path}: writable, {int(spend['site_rounds'])} rounds recorded, lifetime eps spent "
          f"{spend['site_epsilon']:.4f} of {policy.epsilon:g}")
    cap = policy.max_records_per_patient
    if policy.unit == "patient":
        print(f"unit: patient ({check.units} patients; each contributes the clipped mean gradient of "
              f"{'all' if cap is None else f'at most {cap}'} of their records; sample_rate is per patient)")
    else:
        print("unit: record" + (f" (stated cap {cap} records per patient: the claim's group bound)" if cap else
                                " (no cap on records per patient stated: the claim says a patient with k records "
                                "gets only k eps)"))
    print(f"public constants the server sees: sample_rate q={policy.sample_rate:g} and expected batch "
          f"B={policy.expected_batch:g} (together they tell the size of the data when the policy was written, "
          f"about B / q = {policy.expected_batch / policy.sample_rate:.0f} {unit})")
    print(f"minimum sigma this site accepts: {min_sigma_for(policy):.4f} ({policy.lifetime_rounds} lifetime rounds x "
          f"{policy.steps_per_round} steps at q={policy.sample_rate:g}, eps={policy.epsilon:g}, "
          f"delta={policy.delta:g}, {policy.accountant})")
