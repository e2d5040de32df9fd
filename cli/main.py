"""``fedpose`` command line: a thin layer that parses arguments and calls plain functions.

The core commands (config, pretrain, train, eval) are here; every other group is registered by its own
command module, imported here by name (an import error is a crash, not a missing command). Every handler
imports what it needs inside, so ``fedpose --help`` is instant, a CPU-only machine never imports GPU-only
packages, and a camera without torch still runs ``fedpose edge ...`` (a command that needs torch says which
extra brings it: ``install_hint``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedpose.cli import audit, console, data, edge, fed, provision, server, site, study
from fedpose.cli.common import add_common, add_json, data_line, emit_json, load_cli_config

log = logging.getLogger("fedpose")


def _setup_logging(verbose: bool, quiet: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("matplotlib", "PIL", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_config_show(args: argparse.Namespace) -> int:
    """The resolved config: the shipped defaults, the file, then every --set."""
    from fedpose.shared.configuration.flat import to_dict
    from fedpose.shared.configuration.yaml_io import yaml_text

    data = to_dict(load_cli_config(args))
    if not emit_json(args, data):
        print(yaml_text(data).rstrip())
    return 0


# ---------------------------------------------------------------------------
# core commands
# ---------------------------------------------------------------------------


def cmd_pretrain(args: argparse.Namespace) -> int:
    from fedpose.shared.metrics.pose import pckh_table
    from fedpose.shared.training.runs import run_pretrain

    cfg = load_cli_config(args, {"pretrain.out": args.out, "data.root": args.data,
                                 "data.source": "files" if args.data else None})
    metrics = run_pretrain(cfg, args.out, progress=not args.quiet)
    if emit_json(args, metrics):
        return 0
    print(pckh_table({"pretrained (public)": metrics["pckh"]}))
    print(f"PCKh@0.1 mean: {metrics['pckh@0.1']['mean']:.2f}")
    print(data_line(metrics))
    print(f"weights: {Path(args.out or cfg.pretrain.out) / 'model.pt'}  ({metrics['seconds']:.0f} s)")
    print(f"claim: {metrics['claim']}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from fedpose.shared.metrics.pose import pckh_table
    from fedpose.shared.training.runs import run_train

    cfg = load_cli_config(
        args,
        {
            "train.method": args.method,
            "train.strategy": args.strategy,
            "privacy.epsilon": args.epsilon,
            "privacy.clip_norm": args.clip,
            "train.seed": args.seed,
            "train.epochs": args.epochs,
            "train.batch_size": args.batch_size,
            "privacy.unit": args.unit,
            "privacy.max_records_per_patient": args.max_records_per_patient,
            "data.root": args.data,
            "data.source": "files" if args.data else None,
            "train.out": args.out,
        },
    )
    metrics = run_train(cfg, args.out, progress=not args.quiet)
    if emit_json(args, metrics):
        return 0
    print()
    print(pckh_table({f"{metrics['method']} ({metrics['strategy']})": metrics["pckh"]}))
    print(f"PCKh@0.5 mean: {metrics['pckh']['mean']:.2f} from a start of {metrics['initial_pckh_mean']:.2f} "
          f"({metrics['pckh']['mean'] - metrics['initial_pckh_mean']:+.2f}); PCKh@0.1 mean: "
          f"{metrics['pckh@0.1']['mean']:.2f}")
    print(data_line(metrics))
    if metrics["epsilon"] is not None:
        print(
            f"privacy: epsilon spent = {metrics['epsilon']:.4f} (target {metrics['target_epsilon']}), "
            f"delta = {metrics['delta']:g}, sigma = {metrics['sigma']:.4f}, q = {metrics['sample_rate']:.4f}, "
            f"steps = {metrics['steps']}, C = {metrics['clip']}, accountant = {metrics['accountant']}, "
            f"unit = {metrics['unit']}"
        )
    print(f"claim: {metrics['claim']}")
    print(f"wrote {Path(args.out) / 'model.pt'} and {Path(args.out) / 'metrics.json'} ({metrics['seconds']:.0f} s)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from fedpose.shared.data.face import FACES_FILE
    from fedpose.shared.data.mpii import load_mpii, prediction_rows
    from fedpose.shared.metrics.pose import pckh_table
    from fedpose.shared.model.posenet import load_checkpoint
    from fedpose.shared.metrics.evaluation import evaluate
    from fedpose.shared.configuration.yaml_io import write_json

    data = Path(args.data)
    ann = data / "annotations.json"
    if not ann.is_file():
        raise FileNotFoundError(f"{ann} not found: --data must be a split directory in the MPII json layout")
    heads = args.headboxes or (data / "headboxes.json")
    faces = data / FACES_FILE
    records = load_mpii(ann, data / "images", headboxes=heads if Path(heads).exists() else None,
                        faces=faces if faces.is_file() else None)
    model, _ = load_checkpoint(args.checkpoint)
    report, keypoints, scores = evaluate(model, records, progress=not args.quiet and not args.json)
    if args.predictions:
        write_json(args.predictions, prediction_rows(records, keypoints, scores, data / "images"))
    if args.json:
        print(json.dumps(report))
    else:
        print(pckh_table({Path(args.checkpoint).parent.name or "model": report["pckh"]}))
        print(f"PCKh@0.1 mean: {report['pckh@0.1']['mean']:.2f}  ({len(records)} people)")
        if "face" in report:
            from fedpose.shared.metrics.face import face_lines

            print("\n".join(face_lines(report["face"])))
        if args.predictions:
            print(f"predictions: {args.predictions}")
    return 0


# ---------------------------------------------------------------------------
# parser
# ---------------------------------------------------------------------------


def _options_along(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """The option strings of ``parser`` and of the subcommands ``argv`` names below it."""
    options = [o for action in parser._actions for o in action.option_strings]  # noqa: SLF001
    for action in parser._actions:  # noqa: SLF001 - argparse exposes no public walk of its tree
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for i, token in enumerate(argv):
                if token in action.choices:
                    return options + _options_along(action.choices[token], argv[i + 1:])
    return options


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors suggest the closest option for a mistyped one (``--conifg``: ``--config``)."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> Any:
        import difflib

        argv = getattr(self, "_argv", [])
        known = _options_along(self, argv)
        hints = []
        for token in argv:
            name = token.split("=", 1)[0]
            if name.startswith("--") and name not in known:
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                if close:
                    hints.append(f"{name}: did you mean {close[0]}?")
        super().error(message + ("" if not hints else " (" + "; ".join(hints) + ")"))


def build_parser() -> argparse.ArgumentParser:
    from fedpose.shared.configuration.methods import METHODS, UNITS
    from fedpose.shared.configuration.schema import STRATEGIES

    parser = SuggestingParser(
        prog="fedpose", description="Federated, differentially private 2D human pose estimation."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    conf = sub.add_parser("config", help="configs").add_subparsers(dest="config_command", required=True)
    show = conf.add_parser("show", help="print the resolved config: the file (or shipped name) and every --set")
    add_json(show, "the resolved config")
    add_common(show)
    show.set_defaults(func=cmd_config_show)

    pre = sub.add_parser("pretrain", help="non-private pretraining on the public split")
    pre.add_argument("--out", default=None, help="output directory (default: the config's pretrain.out)")
    pre.add_argument("--data", default=None, help="data root (default: the config's data.root)")
    add_json(pre)
    add_common(pre)
    pre.set_defaults(func=cmd_pretrain)

    tr = sub.add_parser("train", help="train with one of the five methods and evaluate")
    tr.add_argument("--method", choices=METHODS, default=None,
                    help="training method (default: the config's train.method)")
    tr.add_argument("--strategy", choices=STRATEGIES, default=None,
                    help="what trains (default: the config's train.strategy)")
    tr.add_argument("--epsilon", type=float, default=None,
                    help="target epsilon (default: the config's privacy.epsilon)")
    tr.add_argument("--clip", type=float, default=None,
                    help="per-sample clip C (default: the config's privacy.clip_norm)")
    tr.add_argument("--epochs", type=int, default=None,
                    help="expected passes over the private data (default: the config's train.epochs)")
    tr.add_argument("--batch-size", type=int, default=None,
                    help="expected batch: records, or patients at --unit patient (sets q = B / n)")
    tr.add_argument("--seed", type=int, default=None, help="reproducible noise (NOT for production)")
    tr.add_argument("--unit", choices=UNITS, default=None,
                    help="privacy unit: record (one image) or patient (all images of one person; needs patient ids; "
                         "train.batch_size counts patients then)")
    tr.add_argument("--max-records-per-patient", type=int, default=None,
                    help="patient: records of a patient used (a fixed subset); record: the stated cap of the "
                         "group-privacy bound in the claim")
    tr.add_argument("--data", default=None,
                    help="a data root of splits on disk (sets data.source files; default: the config's)")
    tr.add_argument("--out", required=True, help="results folder (model.pt, metrics.json, config.yaml)")
    add_json(tr)
    add_common(tr)
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="PCKh of a checkpoint on a split in the MPII json layout")
    ev.add_argument("--checkpoint", required=True, help="a model.pt written by pretrain, train or a federation")
    ev.add_argument("--data", required=True, help="split directory (annotations.json, images/)")
    ev.add_argument("--headboxes", default=None, help="headboxes.json or the official mpii_gt_val.mat")
    ev.add_argument("--predictions", default=None, help="write predictions (MPII json layout) here")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    add_common(ev, config=False)
    ev.set_defaults(func=cmd_eval)

    # The command groups of the data, the federation, the edge and the audit, each registered by its own module.
    for group in (data, fed, provision, server, site, console, edge, audit, study):
        group.register(sub)
    _common_options(parser)
    return parser


def _leaves(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    if not subs:
        return [parser]
    return [leaf for action in subs for child in action.choices.values() for leaf in _leaves(child)]


def _common_options(parser: argparse.ArgumentParser) -> None:
    """Every command takes -v/--verbose and -q/--quiet; the top level takes --version."""
    from importlib import metadata

    try:
        version = metadata.version("fedpose")
    except metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"fedpose {version}")
    for leaf in _leaves(parser):
        options = leaf._option_string_actions  # noqa: SLF001
        for long, short, text in (("--verbose", "-v", "debug logging"),
                                  ("--quiet", "-q", "no progress bars; warnings and errors only")):
            if long in options and short not in options:
                action = options[long]
                action.option_strings.append(short)
                options[short] = action
            elif long not in options:
                leaf.add_argument(short, long, action="store_true", help=text)


# The extra that brings each third-party module a command may need (pyproject.toml's optional dependencies).
EXTRA_OF_MODULE = {"torch": "train", "flwr": "train", "ray": "train", "opacus": "train", "onnx": "train",
                   "scipy": "train", "matplotlib": "train", "PIL": "train", "pycocotools": "train",
                   "grpc": "train", "onnxruntime": "edge", "tensorrt": "tensorrt", "cuda": "tensorrt"}


def install_hint(err: ModuleNotFoundError) -> str | None:
    """One line naming the extra that brings a missing module (a camera installs fedpose[edge] without torch)."""
    top = (err.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    what = {"train": "training, the federation and export", "edge": "inference with onnxruntime",
            "tensorrt": "TensorRT engines (NVIDIA hardware)"}[extra]
    return (f"this command needs {top!r}, which is not installed: it comes with fedpose's {extra} extra ({what}): "
            f"pip install 'fedpose[{extra}]' (docs/how-to/install.md)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every project error is one line on stderr and an exit code of ``ExitCode``."""
    from fedpose.shared.errors import ExitCode, PrivacyRefusal

    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(getattr(args, "verbose", False), getattr(args, "quiet", False))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"fedpose {args.command}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except (ValueError, OSError, ImportError, RuntimeError) as err:
        # The project's own errors (ValueError and its ConfigError, FileNotFoundError/FileExistsError and
        # other OSErrors naming a file, ImportError with an install hint): one line, no traceback (-v logs it).
        log.debug("command failed", exc_info=True)
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
        if isinstance(err, ModuleNotFoundError):
            message = install_hint(err) or message
        print(f"fedpose {args.command}: error: {message}", file=sys.stderr)
        if isinstance(err, PrivacyRefusal):
            return ExitCode.REFUSED
        return ExitCode.FAILED if isinstance(err, RuntimeError) else ExitCode.BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
