"""When a site's round runs and when its answer leaves: one round at a time per site, across processes
(``site_lock``), and a charged round's answer held to the policy's ``round_seconds`` (``hold_reply``, P13), so that
its departure does not tell when training happened to end.
"""

from __future__ import annotations

import fcntl
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedpose.client.policy import SitePolicy

log = logging.getLogger(__name__)


@contextmanager
def site_lock(policy: SitePolicy) -> Iterator[None]:
    """One round at a time per site, across processes (Flower starts one per message); released on death."""
    from fedpose.shared.private_files import open_private, private_dir

    path = Path(policy.ledger_path).with_suffix(".lock")
    private_dir(path.parent)  # made 0700, the lock 0600, whatever the umask (secrets at rest)
    with open(path, "a+", opener=open_private) as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def hold_reply(arrived: float, period: float | None) -> None:
    """Hold a charged round's answer until the first multiple of ``period`` (the policy's ``round_seconds``) after
    its request ``arrived`` (time.monotonic()) that has not passed yet.

    A round that ran past its deadline then leaves at the next multiple, never when training happened to end, so
    the departure time moves with the private data only when a round crosses a multiple (pinned resources and the
    pinned public batch keep rounds inside one); the site's operator is told each time it happens.
    """
    if period is None:
        return
    elapsed = time.monotonic() - arrived
    periods = max(1, math.ceil(elapsed / period))
    if periods > 1:
        log.warning("a round took %.1f s, more than round_seconds=%g: its answer leaves at %g s; raise round_seconds "
                    "so that every round fits", elapsed, period, periods * period)
    left = arrived + periods * period - time.monotonic()
    if left > 0:
        time.sleep(left)
