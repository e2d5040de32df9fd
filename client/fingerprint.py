"""What the outcome of a site's checks is keyed by: a fingerprint of its policy and the version of its files.

Both are cheap and read no private record: the policy's canonical JSON, and the sizes and modification times
of the site's split files (``stat`` calls, never their content). A message compares them with the recorded
outcome (``fedpose.client.data.site_ready``), so a changed policy or changed files need the operator's
check again, and the server can observe only that they changed, never what changed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fedpose.client.policy import SitePolicy, policy_to_dict
from fedpose.shared.data.patients import PATIENT_SIDECARS


def policy_fingerprint(policy: SitePolicy) -> str:
    """sha256 of the policy's canonical JSON: a changed policy needs its checks run again."""
    return hashlib.sha256(json.dumps(policy_to_dict(policy), sort_keys=True).encode()).hexdigest()


def _split_version(path: str | None) -> list[list]:
    """(name, size, mtime_ns) of a split's metadata files and images folder: O(1) ``stat`` calls, no reading."""
    if not path:
        return []
    root = Path(path)
    out = []
    for name in ("annotations.json", "headboxes.json", "images", *PATIENT_SIDECARS):
        try:
            info = (root / name).stat()
        except FileNotFoundError:
            continue
        out.append([str(root / name), info.st_size if name != "images" else 0, info.st_mtime_ns])
    return out


def data_version(policy: SitePolicy) -> str:
    """Version of the site's files (private, public, eval) from their sizes and modification times.

    An image replaced in place under the same name is not seen here; re-run the check after such an edit.
    """
    parts = [_split_version(p) for p in (policy.data_path, policy.public_path, policy.eval_path)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()
