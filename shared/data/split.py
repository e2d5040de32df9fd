"""Public/private disjointness by image content (privacy invariant P2).

The public set S_pub feeds the server's gradient basis V without any noise,
so an image that is also in a site's private data would leak through V.
Names are not enough (a copy can be renamed), hence the content hash.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path

from fedpose.shared.data.records import PoseRecord, content_hash

log = logging.getLogger(__name__)


def _hashes(records: Iterable[PoseRecord]) -> dict[str, Path]:
    """content hash -> first file with that content (each file hashed once)."""
    seen: dict[str, Path] = {}
    for path in dict.fromkeys(r.image for r in records):
        seen.setdefault(content_hash(path), path)
    return seen


def check_disjoint(public_records: Iterable[PoseRecord], private_records: Iterable[PoseRecord]) -> None:
    """Raise ValueError if any image content occurs on both sides (P2).

    Several people in one image are fine on one side; the same image bytes on
    both sides are not, whatever the file names.
    """
    public = _hashes(public_records)
    private = _hashes(private_records)
    shared = sorted(set(public) & set(private))
    if shared:
        first = shared[0]
        raise ValueError(
            f"public and private data share {len(shared)} image(s) by content (invariant P2), e.g. "
            f"public {public[first]} == private {private[first]}; remove them from the public set"
        )
    log.info("P2 check: %d public and %d private images are disjoint by content", len(public), len(private))


def check_no_duplicates(records: Iterable[PoseRecord], *, what: str) -> None:
    """Raise ValueError if two different image files of ``records`` hold the same pixels.

    A record-level DP claim counts each person once: an image present twice in
    the private data (two files, same pixels, e.g. one split listed twice or a
    copy under another name) would be trained on as two records. Several people
    in one image file are fine (one file, several records).
    """
    seen: dict[str, Path] = {}
    for path in dict.fromkeys(r.image for r in records):
        digest = content_hash(path)
        if digest in seen:
            raise ValueError(
                f"{what} holds the same image twice (same pixels): {seen[digest]} and {path}; "
                "each image may occur once, or the per-record privacy claim would not hold"
            )
        seen[digest] = path


def manifest_digest(records: Iterable[PoseRecord]) -> str:
    """Digest of a set of images: sha256 over the sorted content hashes of its distinct images.

    A site approves its public set by this value (``public_digest`` in its
    policy); a set swapped for another, say one holding a patient's image,
    no longer matches.
    """
    return hashlib.sha256("\n".join(sorted(_hashes(records))).encode()).hexdigest()
