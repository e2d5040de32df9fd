"""``fedpose audit`` and ``fedpose attack {mia,reid}``: check the printed guarantee from the outside.

``audit`` runs the one-run privacy audit (shared/experiments/audit.py) and prints the
empirical lower bound eps_LB next to the accountant's claim; ``attack mia``
runs membership inference on trained pose models (shared/experiments/membership.py);
``attack reid`` re-identifies people in DP-pixelized crops (shared/experiments/reid.py).
Each writes JSON and a PNG under --out. Handlers import lazily.
"""

from __future__ import annotations

import argparse
from typing import Any

from fedpose.cli.common import add_common, add_json, emit_json, load_cli_config
from fedpose.shared.configuration.methods import PRIVATE


def cmd_audit(args: argparse.Namespace) -> int:
    from fedpose.shared.experiments.audit import AuditSpec, audit_summary, run_audit

    cfg = load_cli_config(args, {"data.root": args.data, "data.source": "files" if args.data else None,
                                 "train.epochs": args.epochs, "privacy.unit": args.unit})
    spec = AuditSpec(method=args.method, epsilon=args.epsilon, canaries=args.canaries, mode=args.mode,
                     confidence=args.confidence, noise_scale=args.noise_scale, seed=args.seed,
                     placement=args.canary_placement)
    result = run_audit(cfg, spec, args.out, progress=not args.quiet)
    if emit_json(args, result):
        return 0
    print("\n".join(audit_summary(result, args.out)))
    return 0


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from err


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def cmd_mia(args: argparse.Namespace) -> int:
    from fedpose.shared.experiments.membership import MiaSpec, mia_summary, run_mia

    cfg = load_cli_config(args, {"data.root": args.data, "data.source": "files" if args.data else None,
                                 "train.epochs": args.epochs})
    spec = MiaSpec(methods=tuple(m for m in args.methods.split(",") if m), models=args.models, pool=args.pool,
                   split=args.split, epsilon=args.epsilon, seed=args.seed)
    res = run_mia(cfg, spec, args.out, progress=not args.quiet)
    if emit_json(args, res):
        return 0
    print("\n".join(mia_summary(res, args.out)))
    return 0


def cmd_reid(args: argparse.Namespace) -> int:
    from fedpose.shared.experiments.reid import ReidSpec, reid_summary, run_reid

    spec = ReidSpec(epsilons=args.epsilons, cells=args.cells, m=args.m, n=args.n, steps=args.steps,
                    train_per_identity=args.train_per_identity, color=not args.gray, seed=args.seed)
    res = run_reid(args.data, args.split, spec, args.out, progress=not args.quiet)
    if emit_json(args, res):
        return 0
    print("\n".join(reid_summary(res, args.out)))
    return 0


def register(sub: Any) -> None:
    au = sub.add_parser("audit", help="one-run privacy audit: empirical lower bound on epsilon (Steinke et al. 2023)")
    au.add_argument("--method", required=True, choices=PRIVATE,
                    help="the private method to audit")
    au.add_argument("--epsilon", type=float, required=True, help="target epsilon the run is calibrated to")
    au.add_argument("--canaries", type=int, required=True, help="m canaries, each included with probability 1/2")
    au.add_argument("--mode", choices=("gradient", "input"), default="gradient",
                    help="gradient: white-box gradient canaries; input: mislabelled images, final model only")
    au.add_argument("--canary-placement", choices=("dirac", "span"), default=None,
                    help="gradient canaries: dirac (C e_j, default for dpsgd/fdp) or span (+-C V_t u_j inside the "
                         "projection's span, default for proj/fpdp, where a Dirac canary is projected away)")
    au.add_argument("--confidence", type=float, default=0.95,
                    help="confidence of the epsilon lower bound (default 0.95)")
    au.add_argument("--noise-scale", type=float, default=1.0,
                    help="POSITIVE CONTROL ONLY: add this fraction of the calibrated noise (the claim is then false)")
    au.add_argument("--unit", choices=("record", "patient"), default=None,
                    help="privacy unit (default: the config's privacy.unit); at patient level a canary is a patient")
    au.add_argument("--epochs", type=int, default=None, help="epochs of the audited run (default: the config's)")
    au.add_argument("--seed", type=int, default=None, help="reproducible canaries and noise (NOT for production)")
    au.add_argument("--data", default=None, help="a data root of splits on disk (default: the config's)")
    au.add_argument("--out", default=None, help="write audit.json and audit.png here")
    add_common(au)
    add_json(au, "audit.json's content")
    au.set_defaults(func=cmd_audit)

    attack = sub.add_parser("attack", help="attacks on trained models and released frames")
    at = attack.add_subparsers(dest="attack_command", required=True)
    mia = at.add_parser("mia", help="membership inference (loss, confidence, LiRA) against K models per method")
    mia.add_argument("--methods", default="nonprivate,dpsgd,fpdp", help="comma-separated training methods")
    mia.add_argument("--models", type=int, default=8, help="models per method (each is target once, shadows else)")
    mia.add_argument("--pool", type=int, default=200, help="records in the pool; each model trains on a random half")
    mia.add_argument("--split", default="site-0", help="the split members are drawn from (default site-0)")
    mia.add_argument("--epsilon", type=float, default=None, help="default: the config's privacy.epsilon")
    mia.add_argument("--epochs", type=int, default=None, help="epochs of each model (default: the config's)")
    mia.add_argument("--seed", type=int, default=None, help="reproducible splits and noise (NOT for production)")
    mia.add_argument("--data", default=None, help="a data root of splits on disk (default: the config's)")
    mia.add_argument("--out", default=None, help="write mia.json and mia.png here")
    add_common(mia)
    add_json(mia, "mia.json's content")
    mia.set_defaults(func=cmd_mia)

    reid = at.add_parser("reid", help="re-identification of people in DP-pixelized frames")
    reid.add_argument("--data", required=True, help="a synthetic ward (with identities.json)")
    reid.add_argument("--split", default="site-0", help="the split to re-identify people in (default site-0)")
    reid.add_argument("--epsilons", type=_floats, default=(0.1, 0.5, 1.0, 5.0),
                      help="comma-separated pixelization epsilons (default 0.1,0.5,1,5)")
    reid.add_argument("--cells", type=_ints, default=(8, 16), help="cell sides b")
    reid.add_argument("--m", type=int, default=16, help="pixels a neighbouring image may differ in (default 16)")
    reid.add_argument("--n", type=int, default=4, help="adaptive split of body cells (n x n)")
    reid.add_argument("--steps", type=int, default=800, help="attacker training steps")
    reid.add_argument("--train-per-identity", type=int, default=5,
                      help="images per person the attacker learns from (default 5)")
    reid.add_argument("--gray", action="store_true", help="grayscale frames (the pipeline's default release)")
    reid.add_argument("--seed", type=int, default=0, help="seed of the attack and the noise (default 0)")
    reid.add_argument("--out", default=None, help="write reid.json and reid.png here")
    add_common(reid, config=False)
    add_json(reid, "reid.json's content")
    reid.set_defaults(func=cmd_reid)
