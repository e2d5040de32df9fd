"""Secrets at rest: folders 0700 and files 0600, whatever the umask the process was started with.

A site's ledger holds the noise seed of each charged round (with it, the noise can be taken out of the
update the server received); beside it are its stored replies, cached bases, round lock, the outcome of its
checks and its held-out scores. None of it is for another account on the same machine, whether or not a
systemd unit (``StateDirectoryMode=0700``) protects the folder.

- ``private_dir`` makes a folder and each missing folder above it 0700. A folder that already exists keeps
  its mode (the ledger's folder may be one the operator made, even /tmp), unless it is the site's own
  (``own=True``: replies/, basis-cache/) and belongs to this account: then it is set to 0700.
- ``open_private`` is an ``opener`` for ``open()``: a file it creates is 0600, and an existing file of this
  account is set to 0600 (one an older fedpose left 0644). Another account's file is left as it is.
- ``private_file`` makes sure a file exists 0600 (an empty file), for writers that open it themselves (SQLite).

SQLite on Unix creates a database's -wal and -shm files with the database file's own permissions (it sets
them with fchmod, past the umask), so a ledger made 0600 here has 0600 companions.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str | Path, *, own: bool = False) -> Path:
    """Make the folder ``path`` (and each missing folder above it) 0700; ``own``: an existing one of this
    account is set to 0700 too. Returns ``path``."""
    path = Path(path)
    missing: list[Path] = []
    level = path
    while not os.path.lexists(level):
        missing.append(level)
        level = level.parent
    for level in reversed(missing):
        try:
            os.mkdir(level, DIR_MODE)
        except FileExistsError:  # made meanwhile by another process (of this site: 0700 too)
            continue
        os.chmod(level, DIR_MODE)  # the umask may have taken bits away; exactly 0700
    if own and not missing:
        _narrow(path, DIR_MODE)
    return path


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open`` for ``open(path, mode, opener=open_private)``: created 0600; an existing file of this account
    is set to 0600 (another account's is left as it is)."""
    fd = os.open(path, flags, FILE_MODE)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_file(path: str | Path) -> Path:
    """Make sure ``path`` exists (empty when new) and is 0600 when it is this account's. Returns ``path``."""
    os.close(open_private(path, os.O_RDONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)))
    return Path(path)


def narrow_if_present(path: str | Path) -> None:
    """Set an existing file of this account to 0600 (a file left 0644 by an older fedpose); else nothing."""
    _narrow(Path(path), FILE_MODE)


def _narrow(path: Path, mode: int) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
