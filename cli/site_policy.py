"""``fedpose site-policy``: write a site's privacy policy YAML, or check one (the site's own checks).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_site_policy(args: argparse.Namespace) -> int:
    from client.ledger import SiteLedger
    from client.policy import (
        load_policy,
        min_sigma_for,
        policy_from_dict,
        policy_to_dict,
        write_policy,
    )
    from client.site_data import check_site, load_split_dir, public_digest

    if args.check:
        policy = load_policy(args.check)
    else:
        required = ("out", "site", "epsilon", "delta", "lifetime_rounds", "sample_rate", "steps_per_round",
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
        policy = policy_from_dict({
            "policy_version": 2, "site": args.site, "epsilon": args.epsilon, "delta": args.delta,
            "lifetime_rounds": args.lifetime_rounds,
            "rounds_per_federation": args.rounds_per_federation or args.lifetime_rounds,
            "sample_rate": args.sample_rate, "steps_per_round": args.steps_per_round, "clip_norm": args.clip_norm,
            "psi": args.psi, "psi_min": args.psi_min, "augment": not args.no_augment,
            "data_path": args.data_path, "ledger_path": args.ledger_path or "ledger.sqlite",
            "public_path": args.public_path, "public_digest": digest, "min_sigma": args.min_sigma,
            "eval_path": args.eval_path, "accountant": args.accountant, "methods": args.methods.split(","),
            "unit": args.unit, "max_records_per_patient": args.max_records_per_patient,
        }, base=out.parent)
        write_policy(out, policy)
        print(f"wrote {out}" + (f" (approving the public set {policy.public_path}, digest {digest})" if digest else ""))
    print(json.dumps(policy_to_dict(policy), indent=1))
    checked = check_site(policy)  # the site's own checks: data, delta < 1/n, duplicates, public digest, P2
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
        rounds, spent = ledger.rounds_done(), ledger.epsilon(delta=policy.delta, accountant=policy.accountant)
    print(f"checked: {len(checked.private)} private records, delta < 1/n, no duplicate images"
          + (f", public set {len(checked.public)} records matching digest {policy.public_digest} and disjoint from "
             "the private images (P2)" if checked.public is not None else ", no public set (basis_mode site needs one)"))
    print(f"ledger {policy.ledger_path}: writable, {rounds} rounds recorded, lifetime eps spent {spent:.4f} of "
          f"{policy.epsilon:g}")
    cap = policy.max_records_per_patient
    if policy.unit == "patient":
        print(f"unit: patient ({checked.patients.count} patients; each contributes the clipped mean gradient of "
              f"{'all' if cap is None else f'at most {cap}'} of their records; sample_rate is per patient)")
    else:
        print("unit: record" + (f" (stated cap {cap} records per patient: the claim's group bound)" if cap else
                                " (no cap on records per patient stated: the claim says a patient with k records "
                                "gets only k eps)"))
    print(f"minimum sigma this site accepts: {min_sigma_for(policy):.4f} ({policy.lifetime_rounds} lifetime rounds x "
          f"{policy.steps_per_round} steps at q={policy.sample_rate:g}, eps={policy.epsilon:g}, "
          f"delta={policy.delta:g}, {policy.accountant})")
    return 0
