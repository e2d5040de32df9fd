"""Generate the CLI and configuration reference pages, and the kit files the guides show, from the code.

    python tools/docs_reference.py            # write docs/reference/cli.md and docs/reference/config.md
    python tools/docs_reference.py --check    # exit 1 when the committed pages differ (CI runs this as a test)

The pages are never edited by hand: a flag, a default or a config field that changes shows up here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from importlib import metadata
from pathlib import Path
from typing import Any, get_args, get_origin

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import fedpose  # noqa: E402 - this tree's root package

# fedpose's packages are this tree's top-level folders, linked from fedpose/: document this tree's code even
# when fedpose is installed from another checkout (a git worktree).
fedpose.__path__.insert(0, str(REPO / "fedpose"))

CLI_PAGE = REPO / "docs" / "reference" / "cli.md"
CONFIG_PAGE = REPO / "docs" / "reference" / "config.md"


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    out = []
    for action in parser._actions:  # noqa: SLF001 - argparse exposes no public walk of its tree
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            helps = {a.dest: a.help for a in action._choices_actions}  # noqa: SLF001
            for name, sub in action.choices.items():
                out.append((name, sub, helps.get(name) or ""))
    return out


def _options(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):  # noqa: SLF001
            continue
        if action.help == argparse.SUPPRESS:  # hidden from --help: hidden here too
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
        if action.nargs == argparse.REMAINDER:
            names = f"`-- {action.dest.upper()}...`"
        kind = ""
        if action.choices and not isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            kind = " one of " + ", ".join(f"`{c}`" for c in action.choices) + "."
        default = ""
        if action.required:
            default = " Required."
        elif (action.default not in (None, False, argparse.SUPPRESS)
              and not isinstance(action, argparse._StoreTrueAction)):  # noqa: SLF001
            default = f" Default `{action.default}`."
        help_text = (action.help or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {names} | {help_text}{kind}{default} |")
    return rows


def cli_page() -> str:
    from fedpose.cli.main import build_parser

    parser = build_parser()
    lines = ["# Command-line reference", "",
             "Generated from the parser by `tools/docs_reference.py`; every command takes `-h` for the same text.",
             "Exit codes are listed in [errors and exit codes](errors.md).", ""]

    def walk(prefix: str, parser: argparse.ArgumentParser, help_text: str, depth: int) -> None:
        subs = _subparsers(parser)
        if depth:
            lines.extend([f"{'#' * min(depth + 1, 4)} `{prefix}`", "", help_text + ("." if help_text and
                                                                                   not help_text.endswith(".") else ""),
                          ""])
            options = _options(parser)
            if options and not subs:
                lines.extend(["| option | meaning |", "|---|---|", *options, ""])
        for name, sub, sub_help in subs:
            walk(f"{prefix} {name}".strip(), sub, sub_help, depth + 1)

    walk("fedpose", parser, "", 0)
    return "\n".join(lines).rstrip() + "\n"


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(tp))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_name(args[0])}"
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _field_docs(cls: Any) -> dict[str, str]:
    """The comment above or beside each field in the dataclass source (what the YAML means)."""
    import inspect

    lines = inspect.getsource(cls).splitlines()
    docs: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# ").strip())
            continue
        name = stripped.split(":", 1)[0]
        if ":" in stripped and name.isidentifier() and not stripped.startswith(("def ", "class ", "if ", "return")):
            comment = stripped.split("#", 1)[1].strip() if "#" in stripped else ""
            docs[name] = " ".join([*pending, comment]).strip()
        pending = []
    return docs


def config_page() -> str:
    from fedpose.shared.configuration.schema import Config

    lines = ["# Configuration reference", "",
             "Generated from the config dataclasses (`shared/configuration/schema.py`) by `tools/docs_reference.py`. A "
             "YAML file",
             "sets any of these keys; unknown keys and wrong types are refused naming the key. "
             "`fedpose config show` prints the resolved values of a file, and `--set key=value` overrides one "
             "on any command that takes a config.", ""]

    def section(prefix: str, cls: Any) -> None:
        hints = typing.get_type_hints(cls)
        docs = _field_docs(cls)
        rows, nested = [], []
        instance = cls()
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((f"{prefix}.{f.name}".lstrip("."), type(value)))
                continue
            default = list(value) if isinstance(value, tuple) else value
            text = docs.get(f.name, "").replace("|", "\\|")
            rows.append(f"| `{f.name}` | {_type_name(hints[f.name])} | `{default}` | {text} |")
        if rows:
            doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
            lines.extend([f"## `{prefix}`", "", doc, "", "| key | type | default | meaning |", "|---|---|---|---|",
                          *rows, ""])
        for name, sub in nested:
            section(name, sub)

    section("", Config)
    return "\n".join(lines).rstrip() + "\n"


# Blocks of the how-to pages that show a kit's files: <!-- kit:NAME --> ... <!-- /kit:NAME -->, filled from the
# templates fedpose provision uses (server/kits/templates.py), for an example site, so the guide and a kit never differ.
KIT_PAGES = (REPO / "docs" / "how-to" / "site-install.md", REPO / "docs" / "how-to" / "server.md")
EXAMPLE = {"site": "hospital-a", "address": "fedpose.example.org:8000", "port": 8000, "control_port": 9093,
           "listen": "0.0.0.0",
           "api_port": 9094, "health_port": 9095,
           "sites": "hospital-a hospital-b", "wheel": f"fedpose-{metadata.version('fedpose')}-py3-none-any.whl"}


def kit_blocks() -> dict[str, str]:
    """The kit's files for the example site, as fedpose provision writes them (defaults of the CPU config)."""
    from fedpose.server.front import body_limit_mib
    from fedpose.server.kits import templates as kit
    from fedpose.shared.configuration.schema import load_config, replace

    cfg = replace(load_config("default"), **{"train.method": "proj"})  # as the operator's guide provisions
    paths = {"install": kit.INSTALL, "venv": kit.VENV, "state": kit.STATE, "user": kit.USER}
    values = {**EXAMPLE, **paths, "epsilon": cfg.privacy.epsilon, "delta": cfg.privacy.delta,
              "lifetime_rounds": cfg.federation.rounds, "rounds": cfg.federation.rounds,
              "batch_size": cfg.train.batch_size, "local_steps": cfg.federation.local_steps,
              "clip_norm": cfg.privacy.clip_norm, "psi": cfg.privacy.psi, "psi_min": cfg.privacy.psi_param,
              "augment": str(cfg.data.augment).lower(), "public_batch_size": cfg.train.public_batch_size,
              "augment_multiplicity": cfg.privacy.augment_multiplicity, "accountant": cfg.privacy.accountant,
              "method_note": kit.method_note(cfg.train.method), "max_body_mib": body_limit_mib(cfg)}
    names = ("POLICY", "START_SCRIPT", "SYSTEMD_UNIT", "SITE_STEPS", "SERVER_STEPS", "SUPERLINK_SCRIPT",
             "REGISTER_SCRIPT")
    return {name: getattr(kit, name).format(**values) for name in names}


def fill_kit_blocks(text: str, blocks: dict[str, str]) -> str:
    import re

    def replace(match: "re.Match[str]") -> str:
        name = match.group(1)
        if name not in blocks:
            raise KeyError(f"unknown kit block {name!r}")
        fence = "ini" if name == "SYSTEMD_UNIT" else "yaml" if name == "POLICY" else \
            "sh" if name.endswith("SCRIPT") else "text"
        return f"<!-- kit:{name} -->\n```{fence}\n{blocks[name].rstrip()}\n```\n<!-- /kit:{name} -->"

    return re.sub(r"<!-- kit:([A-Z_]+) -->.*?<!-- /kit:\1 -->", replace, text, flags=re.S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed page is not current")
    args = parser.parse_args(argv)
    pages = {CLI_PAGE: cli_page(), CONFIG_PAGE: config_page()}
    blocks = kit_blocks()
    for page in KIT_PAGES:
        if page.is_file():
            pages[page] = fill_kit_blocks(page.read_text(), blocks)
    stale = [path for path, text in pages.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(REPO)} is not current: run python tools/docs_reference.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in pages.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
