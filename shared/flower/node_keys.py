"""Key material of Flower's node authentication, and where any key file may be written.

A SuperNode's key pair (ECDSA P-384 in OpenSSH format, as Flower's node auth reads) is made where it is used:
a site makes its own (``fedpose site keygen``) and sends only the public key; the operator's test pilots make
node pairs with the CA (``fedpose.server.kits.certs``). Every key file is written to a new inode (O_EXCL, then
renamed), private keys at 0600, and never inside a git work tree (a key there is one ``git add`` away from
being published). cryptography is imported inside the functions.
"""

from __future__ import annotations

import os
from pathlib import Path


def inside_git_tree(path: Path) -> Path | None:
    """The root of the git work tree holding ``path`` (or the nearest existing parent), or None."""
    for parent in [path, *path.parents]:
        if (parent / ".git").exists():
            return parent
    return None


def write_key_file(path: Path, data: bytes, *, private: bool) -> Path:
    """Write ``data`` to ``path`` atomically: a new file created O_EXCL at 0600 (private) or 0644, then renamed.

    Rewriting in place would keep an existing file's mode (a key once left at 0644 would stay readable);
    the rename gives the path a new inode with exactly this mode.
    """
    mode = 0o600 if private else 0o644
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)  # the umask may have narrowed it; never widened
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def node_key_pair(comment: str) -> tuple[bytes, bytes]:
    """(private key, public key) of a SuperNode: ECDSA P-384 in OpenSSH format, as Flower's node auth reads."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public + f" {comment}\n".encode()


def key_comment(folder: Path, name: str) -> str:
    """The comment of a site's public key: ``fedpose-<site>`` in a site's kit folder (its kit.json names the site),
    so the operator can tell whose key a file is; else ``fedpose-<name>``."""
    import json

    try:
        site = json.loads((folder / "kit.json").read_text())["site"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"fedpose-{name}"
    return f"fedpose-{site}" if isinstance(site, str) and site and " " not in site else f"fedpose-{name}"
