"""``fedpose site-policy``: write a site's privacy policy YAML, or check one (the site's own checks, recorded):
``fedpose.client.policy_resolve.write_site_policy`` and ``fedpose.client.data.report_check``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_site_policy(args: argparse.Namespace) -> int:
    from fedpose.client.data import report_check
    from fedpose.client.policy import load_policy, policy_to_dict
    from fedpose.client.policy_resolve import write_site_policy

    if args.check:
        policy = load_policy(args.check)
    else:
        required = ("out", "site", "epsilon", "delta", "lifetime_rounds", "expected_batch", "steps_per_round",
                    "data_path")
        missing = [f"--{n.replace('_', '-')}" for n in required if getattr(args, n) is None]
        if missing:
            raise ValueError(f"site-policy: give {', '.join(missing)} (or --check FILE)")
        out = Path(args.out).resolve()
        policy = write_site_policy(out, {
            "site": args.site, "epsilon": args.epsilon, "delta": args.delta,
            "lifetime_rounds": args.lifetime_rounds,
            "rounds_per_federation": args.rounds_per_federation or args.lifetime_rounds,
            "sample_rate": args.sample_rate, "expected_batch": args.expected_batch,
            "steps_per_round": args.steps_per_round, "clip_norm": args.clip_norm,
            "psi": args.psi, "psi_min": args.psi_min, "augment": not args.no_augment,
            "augment_multiplicity": args.augment_multiplicity,
            "data_path": args.data_path, "ledger_path": args.ledger_path or "ledger.sqlite",
            "public_path": args.public_path, "min_sigma": args.min_sigma,
            "eval_path": args.eval_path, "accountant": args.accountant,
            "methods": args.methods.split(",") if args.methods else None,
            "release_blurred_images_and_labels": args.release_blurred_images_and_labels,
            "public_batch_size": args.public_batch_size, "public_records": args.public_records,
            "unit": args.unit, "max_records_per_patient": args.max_records_per_patient,
        })
        digest = policy.public_digest
        print(f"wrote {out}" + (f" (approving the public set {policy.public_path}, digest {digest})" if digest else ""))
    print(json.dumps(policy_to_dict(policy), indent=1))
    report_check(policy, Path(args.check or args.out).resolve())
    return 0
