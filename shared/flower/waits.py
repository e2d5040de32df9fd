"""Flower 1.41's fixed waits, shortened where a process waits on another process of the same federation.

- The SuperNode's loop sleeps 3 s after a look for a message that found none, and 0.5 s between two looks
  for a finished reply (``cap_waits``; ``fedpose.client.supernode`` applies it to the SuperNode).
- Every pull of a message's objects (the weights, the basis, a reply) backs off 1 s, then 2 s, 4 s, ... up to
  10 s, while an object is not there yet. That is the usual case, not an error: Flower starts a ClientApp as
  soon as the SuperNode has the message, while the SuperNode is still fetching the message's objects from the
  SuperLink; a reply is listed before its objects have arrived. ``quick_pulls`` retries after 0.05 s,
  doubling up to 0.5 s, and keeps Flower's overall limit (``PULL_MAX_TIME``) instead of its count of tries.

Both wrap the names a Flower module calls, with the same arguments otherwise; each says whether the
installed Flower still has what it wraps, so a Flower whose loop changed runs unchanged.
"""

from __future__ import annotations

import functools
import inspect
import time
from types import ModuleType
from typing import Any

FLOWER_IDLE_WAIT = 3.0  # seconds: Flower 1.41's wait between two looks for a message that found none
FIRST_RETRY = 0.05  # seconds before the first retry of an object that is not there yet (Flower: 1)
LONGEST_RETRY = 0.5  # seconds between retries at most (Flower: 10)
_PULL_KEYWORDS = ("initial_backoff", "backoff_cap", "max_tries_per_object")


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


def cap_waits(module: ModuleType | Any, poll: float) -> bool:
    """Make ``module``'s ``time.sleep`` waits at most ``poll`` s; False (and ``module`` untouched) when it
    does not wait through the ``time`` module (a Flower whose loop changed)."""
    capped = CappedTime(poll)
    if getattr(module, "time", None) is not time:
        return False
    module.time = capped
    return True


def quick_pulls(module: ModuleType | Any, name: str) -> bool:
    """Make ``module.<name>`` (Flower's ``pull_objects`` or ``pull_and_inflate_object_from_tree``, as that
    module imported it) retry a missing object after ``FIRST_RETRY`` s, doubling up to ``LONGEST_RETRY`` s,
    within Flower's time limit. False (and ``module`` untouched) when it has no such function."""
    pull = getattr(module, name, None)
    if pull is None or isinstance(pull, functools.partial):
        return pull is not None  # absent, or wrapped already
    try:
        parameters = inspect.signature(pull).parameters
    except (TypeError, ValueError):
        return False
    if not all(key in parameters for key in _PULL_KEYWORDS):
        return False
    setattr(module, name, functools.partial(pull, initial_backoff=FIRST_RETRY, backoff_cap=LONGEST_RETRY,
                                            max_tries_per_object=None))
    return True
