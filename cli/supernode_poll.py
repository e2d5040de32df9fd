"""Flower's SuperNode with its message polling at the site's interval: ``python -m fedpose.cli.supernode_poll``.

Flower 1.41's SuperNode asks the SuperLink for a message and, when there is none, sleeps 3 s before it asks
again; once a ClientApp has started on a message, it looks for the reply every 0.5 s. Every round therefore
starts up to 3 s late at each site (1.5 s on average, and the round waits for its slowest site), and ends up
to 0.5 s late. Flower has no setting for either wait, so ``fedpose site start`` runs the same
``flower-supernode`` entry point through this module, which caps the waits of Flower's SuperNode loop
(``flwr.supernode.start_client_internal``) at ``--poll`` seconds. Nothing else changes: the same arguments,
the same code, the same messages; an idle site sends the SuperLink one small pull request per ``--poll``
seconds instead of one per 3 s. The SuperNode's pulls of a message's objects retry after 0.05 s instead of
Flower's 1 s (``fedpose.shared.flower.waits``).

When the installed Flower no longer has that loop (another version), the SuperNode runs unchanged and says
so on stderr: the site still works, with Flower's own waits.

    python -m fedpose.cli.supernode_poll --poll 0.2 -- <flower-supernode arguments>
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from fedpose.shared.flower.waits import FLOWER_IDLE_WAIT, cap_waits, quick_pulls

LOOP_MODULE = "flwr.supernode.start_client_internal"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedpose.cli.supernode_poll", description=__doc__.splitlines()[0])
    parser.add_argument("--poll", type=float, default=0.2,
                        help=f"seconds between two looks for a message or a reply (Flower's own: "
                             f"{FLOWER_IDLE_WAIT:g} and 0.5; default 0.2)")
    parser.add_argument("supernode_args", nargs=argparse.REMAINDER, help="-- then the flower-supernode arguments")
    args = parser.parse_args(argv)
    rest = list(args.supernode_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    loop = importlib.import_module(LOOP_MODULE)
    if not cap_waits(loop, args.poll):  # refuses a --poll outside (0, 3] before anything starts
        print(f"fedpose site start: this Flower's SuperNode loop ({LOOP_MODULE}) does not wait through the time "
              "module; its own polling intervals apply", file=sys.stderr, flush=True)
    if not quick_pulls(loop, "pull_objects"):
        print(f"fedpose site start: this Flower's SuperNode loop ({LOOP_MODULE}) has no pull_objects to shorten; "
              "its own retry waits apply", file=sys.stderr, flush=True)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()


if __name__ == "__main__":
    main()
