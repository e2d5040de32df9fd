"""Flower's SuperNode with its message polling at the site's interval: ``python -m cli.supernode_poll``.

Flower 1.41's SuperNode asks the SuperLink for a message and, when there is none, sleeps 3 s before it asks
again; once a ClientApp has started on a message, it looks for the reply every 0.5 s. Every round therefore
starts up to 3 s late at each site (1.5 s on average, and the round waits for its slowest site), and ends up
to 0.5 s late. Flower has no setting for either wait, so ``fedpose site start`` runs the same
``flower-supernode`` entry point through this module, which caps the waits of Flower's SuperNode loop
(``flwr.supernode.start_client_internal``) at ``--poll`` seconds. Nothing else changes: the same arguments,
the same code, the same messages; an idle site sends the SuperLink one small pull request per ``--poll``
seconds instead of one per 3 s.

When the installed Flower no longer has that loop (another version), the SuperNode runs unchanged and says
so on stderr: the site still works, with Flower's own waits.

    python -m cli.supernode_poll --poll 0.2 -- <flower-supernode arguments>
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

LOOP_MODULE = "flwr.supernode.start_client_internal"
FLOWER_IDLE_WAIT = 3.0  # seconds: Flower 1.41's wait between two pulls that found no message


class CappedTime:
    """The ``time`` module as one module sees it, with ``sleep(s)`` sleeping at most ``poll`` seconds.

    Every ``sleep`` in Flower's SuperNode loop is a wait before looking at a condition again (a new message,
    a reply, a stored object), so a shorter wait only looks more often.
    """

    def __init__(self, poll: float) -> None:
        if not 0 < poll <= FLOWER_IDLE_WAIT:
            raise ValueError(f"--poll: must be in (0, {FLOWER_IDLE_WAIT:g}] seconds, got {poll}")
        self.poll = poll

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.poll))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def cap_waits(module: ModuleType, poll: float) -> bool:
    """Make ``module``'s ``time.sleep`` waits at most ``poll`` s; False (and ``module`` untouched) when it
    does not wait through the ``time`` module (a Flower whose loop changed)."""
    if getattr(module, "time", None) is not time:
        return False
    module.time = CappedTime(poll)  # type: ignore[attr-defined]
    return True


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cli.supernode_poll", description=__doc__.splitlines()[0])
    parser.add_argument("--poll", type=float, default=0.2,
                        help=f"seconds between two looks for a message or a reply (Flower's own: "
                             f"{FLOWER_IDLE_WAIT:g} and 0.5; default 0.2)")
    parser.add_argument("supernode_args", nargs=argparse.REMAINDER, help="-- then the flower-supernode arguments")
    args = parser.parse_args(argv)
    rest = list(args.supernode_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    capped = CappedTime(args.poll)  # validates --poll before anything starts
    import importlib

    loop = importlib.import_module(LOOP_MODULE)
    if not cap_waits(loop, capped.poll):
        print(f"fedpose site start: this Flower's SuperNode loop ({LOOP_MODULE}) does not wait through the time "
              "module; its own polling intervals apply", file=sys.stderr, flush=True)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()


if __name__ == "__main__":
    main()
