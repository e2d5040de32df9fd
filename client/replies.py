"""Replies kept at the site, so that a repeated (federation, round) gets its stored reply back and is
never trained twice.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from fedpose.client.policy import SitePolicy
from fedpose.shared.flower.messages import ARRAYS, METRICS, Refusal, RefusalCode, weights_record
from fedpose.shared.private_files import open_private, private_dir

log = logging.getLogger(__name__)

# Federation ids are 1-64 of [A-Za-z0-9_.-] (client.request); the round is the last -r<digits>.
_REPLY_NAME = re.compile(r"(?P<federation>[A-Za-z0-9_.-]{1,64})-r(?P<round>[0-9]+)\.pt")


def _reply_path(policy: SitePolicy, federation: str, round: int) -> Path:
    return Path(policy.ledger_path).parent / "replies" / f"{federation}-r{int(round)}.pt"


def store_reply(policy: SitePolicy, federation: str, round: int, weights: dict[str, torch.Tensor],
                metrics: dict[str, float | int]) -> None:
    """Keep the latest reply of a federation (atomic), so that a repeated round gets it back unchanged.

    It is DP output already released (post-processing); only the latest round of each federation is kept.
    """
    path = _reply_path(policy, federation, round)
    private_dir(path.parent, own=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb", opener=open_private) as fh:  # 0600 whatever the umask: the site's own account only
        torch.save({"weights": {k: v.detach().cpu() for k, v in weights.items()}, "metrics": dict(metrics)}, fh)
    tmp.replace(path)
    for old in path.parent.glob("*.pt"):  # this federation's older replies: its exact id, never a prefix of another
        if old != path and (of := _reply_of(old.name)) is not None and of[0] == federation:
            old.unlink(missing_ok=True)


def drop_reply(policy: SitePolicy, federation: str, round: int) -> None:
    """Forget the stored reply of a round whose answer never left (it was interrupted before it did, P16)."""
    _reply_path(policy, federation, round).unlink(missing_ok=True)


def _reply_of(name: str) -> tuple[str, int] | None:
    """(federation, round) of a stored reply's file name ``<federation>-r<round>.pt``, else None."""
    match = _REPLY_NAME.fullmatch(name)
    return (match["federation"], int(match["round"])) if match else None


def stored_reply(policy: SitePolicy, federation: str, round: int) -> Any:
    """The reply this site sent for (federation, round), or None when it is not kept."""
    from flwr.app import MetricRecord, RecordDict

    path = _reply_path(policy, federation, round)
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        weights, metrics = saved["weights"], saved["metrics"]
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        log.error("site %s: stored reply %s is unreadable (%s): answering 'already spent'", policy.site, path, err)
        return None
    return RecordDict({ARRAYS: weights_record(weights), METRICS: MetricRecord(metrics)})


def repeated_round(policy: SitePolicy, federation: str, round: int) -> Any:
    """The stored reply of a (federation, round) already spent, or an ALREADY_SPENT refusal: never a second spend."""
    reply = stored_reply(policy, federation, round)
    if reply is not None:
        log.info("site %s: round %d of federation %s was already spent: resending its stored reply", policy.site,
                 round, federation)
        return reply
    raise Refusal(RefusalCode.ALREADY_SPENT, f"round {round} of federation {federation} was already trained and "
                                             "spent here; it is never trained twice")
