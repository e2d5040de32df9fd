"""Evaluation at the site: how the global model does on the hospital's own held-out data.

The server can only evaluate on public data (server/prepare.py). A site whose policy names an
``eval_path`` (a held-out split in the MPII json layout, disjoint from ``data_path``) scores
every global model it receives on it, before training, and appends the result to
``<ledger folder>/evaluation.jsonl``. The numbers never leave the site: they are not in the
reply, nor in any refusal (P10; releasing them would need a DP mechanism of its own and budget).
``fedpose eval --checkpoint model.pt --data <eval_path>`` scores the federation's final model
the same way once the site has it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from fedpose.client.policy import SitePolicy
from fedpose.shared.data.records import PoseRecord
from fedpose.shared.private_files import open_private, private_dir

log = logging.getLogger(__name__)

_LOADED: dict[tuple[Any, ...], list[PoseRecord] | None] = {}


def evaluation_log(policy: SitePolicy) -> Path:
    return Path(policy.ledger_path).parent / "evaluation.jsonl"


def _eval_records(policy: SitePolicy, eval_path: str, private: list[PoseRecord]) -> list[PoseRecord] | None:
    """The held-out records (cached per file version); None, with the reason logged, when unusable."""
    from fedpose.client.data import load_split_dir
    from fedpose.client.fingerprint import data_version
    from fedpose.shared.data.split import check_disjoint

    key = (policy.eval_path, policy.data_path, data_version(policy))
    if key not in _LOADED:
        records: list[PoseRecord] | None = None
        try:
            records = load_split_dir(eval_path, "held-out evaluation data")
            check_disjoint(records, private)
            if any(r.headbox is None for r in records):
                raise ValueError("PCKh needs a head box for every record")
        except (OSError, ValueError) as err:
            log.error("site %s: eval_path %s is not usable, the global model is not evaluated here: %s",
                      policy.site, policy.eval_path, err)
            records = None
        _LOADED.clear()
        _LOADED[key] = records
    return _LOADED[key]


def evaluate_global(model: Any, policy: SitePolicy, private: list[PoseRecord], *, federation: str,
                    rnd: int) -> dict[str, Any] | None:
    """Score the received global model on the site's held-out data; the row stays in evaluation.jsonl."""
    if not policy.eval_path:
        return None
    records = _eval_records(policy, policy.eval_path, private)
    if records is None:
        return None
    from fedpose.shared.metrics.evaluation import evaluate

    t0 = time.perf_counter()
    report, _, _ = evaluate(model, records)
    row = {
        "federation": federation,
        "round": rnd,
        "model": "global model received for this round",
        "records": len(records),
        "pckh_mean": _r4(report["pckh"]["mean"]),
        "pckh@0.1_mean": _r4(report["pckh@0.1"]["mean"]),
        "pckh": {k: _r4(v) for k, v in report["pckh"].items()},
        "seconds": _r4(time.perf_counter() - t0),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = evaluation_log(policy)
    private_dir(path.parent)
    with open(path, "a", encoding="utf-8", opener=open_private) as fh:  # scores on private data: 0600
        fh.write(json.dumps(row) + "\n")
    log.info("site %s: the global model of round %d scores PCKh@0.5 %.2f on its %d held-out records (kept at the "
             "site, in %s)", policy.site, rnd, row["pckh_mean"], len(records), path)
    return row


def _r4(value: float) -> float:
    return round(float(value), 4)
