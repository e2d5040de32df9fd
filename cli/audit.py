"""``fedpose audit`` and ``fedpose attack {mia,reid}``: check the printed guarantee from the outside.

``audit`` runs the one-run privacy audit (shared/audit.py) and prints the
empirical lower bound eps_LB next to the accountant's claim; ``attack mia``
runs membership inference on trained pose models (shared/attacks/mia.py);
``attack reid`` re-identifies people in DP-pixelized crops (edge/reid.py).
Each writes JSON and a PNG under --out. Handlers import lazily.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cli.main import _add_common, _load


def cmd_audit(args: argparse.Namespace) -> int:
    from shared.audit import AuditSpec, run_audit

    cfg = _load(args, {"data.root": args.data, "train.epochs": args.epochs})
    spec = AuditSpec(method=args.method, epsilon=args.epsilon, canaries=args.canaries, mode=args.mode,
                     confidence=args.confidence, noise_scale=args.noise_scale, seed=args.seed)
    result = run_audit(cfg, spec, args.out, progress=not args.quiet)
    print(f"audit of {result['method']} with {result['canaries']} {result['mode']} canaries "
          f"({result['included']} included), one run of {result['steps']} steps, q = {result['sample_rate']:.4f}, "
          f"sigma = {result['sigma_ran']:.4f}, C = {result['clip']}, delta = {result['delta']:g}")
    print(f"  claimed eps  = {result['epsilon_claimed']:.4f}  ({result['accountant'].upper()} accountant, "
          f"sigma {result['sigma_claimed']:.4f})")
    if result["noise_scale"] != 1.0:
        print(f"  ran eps      = {result['epsilon_ran']:.4g}  (accountant on the sigma that actually ran)")
    print(f"  eps_LB       = {result['epsilon_lb']:.4f}  at {result['confidence']:.0%} confidence "
          f"({result['v']} of {result['r']} guesses correct, best of {result['tests']} guess counts, Bonferroni)")
    print(f"  {'sound: eps_LB <= claimed eps' if result['sound'] else 'VIOLATION: eps_LB > claimed eps'}")
    print(f"note: {result['note']}")
    if args.out:
        print(f"wrote {Path(args.out) / 'audit.json'} and {Path(args.out) / 'audit.png'} ({result['seconds']:.0f} s)")
    return 0


def register(sub: Any) -> None:
    au = sub.add_parser("audit", help="one-run privacy audit: empirical lower bound on epsilon (Steinke et al. 2023)")
    au.add_argument("--method", required=True, choices=("dpsgd", "proj", "fdp", "fpdp"))
    au.add_argument("--epsilon", type=float, required=True, help="target epsilon the run is calibrated to")
    au.add_argument("--canaries", type=int, required=True, help="m canaries, each included with probability 1/2")
    au.add_argument("--mode", choices=("gradient", "input"), default="gradient",
                    help="gradient: white-box Dirac gradient canaries; input: mislabelled images, final model only")
    au.add_argument("--confidence", type=float, default=0.95)
    au.add_argument("--noise-scale", type=float, default=1.0,
                    help="POSITIVE CONTROL ONLY: add this fraction of the calibrated noise (the claim is then false)")
    au.add_argument("--epochs", type=int, default=None)
    au.add_argument("--seed", type=int, default=None, help="reproducible canaries and noise (NOT for production)")
    au.add_argument("--data", default=None)
    au.add_argument("--out", default=None, help="write audit.json and audit.png here")
    _add_common(au)
    au.set_defaults(func=cmd_audit)
