"""Register the sites' public keys with the SuperLink, safely again and again (``fedpose server register-sites``).

The server kit's ``register-sites.sh`` runs it. For each site it registers ``site-keys/<site>.pub`` with
``flwr supernode register ... --name <site>``; a key the SuperLink already holds is reported and skipped, a
missing, misplaced or refused key is reported and the next site is still registered; every line names the
site. Flower's ``flwr supernode list`` shows node ids without names, so the node id each site got is recorded
in ``site-nodes.tsv`` (site, node id, the key's SHA-256) and printed as a table. Exit 0 when every site is
registered, 1 otherwise.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
from pathlib import Path

HEADER = "site\tnode_id\tkey_sha256"


def key_fingerprint(text: str) -> str:
    """SHA-256 of an OpenSSH public key's type and key (its comment left out): what the SuperLink compares."""
    parts = text.split()
    if len(parts) < 2:
        raise ValueError("not an OpenSSH public key (expected 'ecdsa-sha2-nistp384 AAAA... comment')")
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except ValueError as err:
        raise ValueError(f"not an OpenSSH public key ({err})") from None
    return hashlib.sha256(parts[0].encode() + b" " + blob).hexdigest()


def read_record(path: Path) -> dict[str, tuple[str, str]]:
    """{site: (node id, key SHA-256)} from site-nodes.tsv (empty when there is none yet)."""
    rows = {}
    if path.is_file():
        for line in path.read_text().splitlines()[1:]:
            fields = line.split("\t")
            if len(fields) == 3:
                rows[fields[0]] = (fields[1], fields[2])
    return rows


def write_record(path: Path, rows: dict[str, tuple[str, str]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join([HEADER, *(f"{s}\t{n}\t{k}" for s, (n, k) in sorted(rows.items()))]) + "\n")
    tmp.replace(path)


def _register(key: Path, connection: str, site: str) -> tuple[str | None, str]:
    """(node id, "") when registered, else (None, Flower's message)."""
    exe = Path(sys.executable).with_name("flwr")
    done = subprocess.run([str(exe), "supernode", "register", str(key), connection, "--name", site, "--format",
                           "json"], capture_output=True, text=True, timeout=120)
    try:
        reply = json.loads(done.stdout)
    except ValueError:
        reply = {}
    if done.returncode == 0 and reply.get("success") is True and reply.get("node-id"):
        return str(reply["node-id"]), ""
    message = str(reply.get("error-message") or (done.stdout + done.stderr)).strip()
    return None, " ".join(message.split())[-400:] or f"flwr exited with {done.returncode}"


def register_sites(sites: list[str], keys: Path, record: Path, connection: str) -> int:
    """Register ``keys/<site>.pub`` of each site over ``connection``, record node ids in ``record`` and print
    every site's outcome as it comes (problems on stderr), then the table; returns the exit code (0: all registered)."""
    rows = read_record(record)
    problems = 0
    for site in sites:
        key = keys / f"{site}.pub"
        if not key.is_file():
            print(f"{site}: no key at {key}: ask {site} for the node.key.pub that fedpose site keygen wrote, and "
                  f"save it as {key.name}", file=sys.stderr)
            problems += 1
            continue
        text = key.read_text(errors="replace")
        comment = text.split()[2] if len(text.split()) > 2 else ""
        owner = next((s for s in sites if s != site and comment == f"fedpose-{s}"), None)
        if owner is not None:
            print(f"{site}: {key} is {owner}'s key (its comment says {comment}): not registered; ask {site} for "
                  "its own node.key.pub", file=sys.stderr)
            problems += 1
            continue
        try:
            fingerprint = key_fingerprint(text)
        except ValueError as err:
            print(f"{site}: {key} is {err}: not registered; ask {site} for the node.key.pub that fedpose site "
                  "keygen wrote", file=sys.stderr)
            problems += 1
            continue
        node, message = _register(key, connection, site)
        if node is not None:
            rows[site] = (node, fingerprint)
            write_record(record, rows)
            print(f"{site}: registered as node {node}")
        elif "already in use" in message:
            known = rows.get(site)
            if known and known[1] == fingerprint:
                print(f"{site}: already registered as node {known[0]}; skipped")
            else:
                other = next((s for s, (_, k) in rows.items() if k == fingerprint and s != site), None)
                if other is not None:
                    print(f"{site}: {key} is already registered as {other}'s key (node {rows[other][0]}): not "
                          f"registered; ask {site} for its own node.key.pub", file=sys.stderr)
                    problems += 1
                else:
                    print(f"{site}: its key is already registered, but not by this script (its node id is not in "
                          f"{record.name}: `flwr supernode list {connection}` lists every node); skipped")
        else:
            print(f"{site}: the SuperLink did not register {key}: {message}", file=sys.stderr)
            problems += 1
    print(f"\n{'site':<24} node id   (from {record})")
    for site in sites:
        node = rows[site][0] if site in rows else "-"
        print(f"{site:<24} {node}")
    return 1 if problems else 0
