"""Which app bundles (FABs) a site runs: a gate checked by the site, outside the bundle's own code.

Threat (issue #8, finding 8.9): on the deployment engine the SuperNode runs
whatever FAB the operator submits with ``flwr run``; a hostile operator can
ship a ClientApp that ignores the site's policy and ledger. Flower 1.41's own
mechanism (``flower-supernode --trusted-entities``) verifies Ed25519
signatures that only reach the SuperNode for apps fetched from Flower Hub
(the SuperLink marks them ``valid_license``); a bundle submitted from disk
carries no verification and is always refused, so an offline hospital
federation cannot approve its own reviewed build with it.

So the site pins the SHA-256 digests of the bundles it approved (the FAB
hash Flower itself computes: ``flwr build`` prints it in the file name,
``fab_digest`` recomputes it) in a file only the site can write, and this
module enforces the pin in the ClientApp process *before* the bundle is
installed or imported:

    flower-supernode (subprocess isolation)
      -> flower-superexec -> ``flwr-clientapp`` (found on PATH)
           = the site's shim (``fedpose site start`` puts it first on PATH)
           -> ``python -m fedpose.client.app_trust --approved FILE -- <flwr-clientapp args>``
              -> Flower's run_clientapp: the pulled FAB is checked, and an unapproved
              one is refused in place of ``install_from_fab``

The code that checks is the site's installed fedpose, not the submitted
bundle: the bundle is only unpacked and imported after ``check_fab`` passed.
A refused bundle gets Flower's generic error reply (CLIENT_APP_RAISED_EXCEPTION,
naming the refused digest), nothing is trained and the site ledger is not touched.

Flower then loads the app from a directory named by the SuperLink's ``fab_id`` and
``fab_version`` and reuses an existing install directory without looking at it. So the
gate also refuses a run whose id or version differ from the approved bundle's own
metadata or could leave the apps folder (a separator, ``..``), and every gated ClientApp
process installs into a fresh, private FLWR_HOME of its own: only the checked bytes are
ever imported.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import re
import shutil
import stat
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SAFE_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")
SHIM_NAME = "flwr-clientapp"


class UnapprovedAppError(RuntimeError):
    """The submitted app bundle is not one the site approved: it is not installed, imported or run."""


def fab_digest(source: bytes | str | Path) -> str:
    """SHA-256 hex digest of a FAB: its bytes, a ``.fab`` file, or an app directory built as ``flwr run`` does.

    For a directory this is exactly the hash ``flwr run DIR`` submits (Flower's
    FAB build is deterministic: fixed zip timestamps, sorted manifest).
    """
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest()
    path = Path(source).expanduser()
    if path.is_dir():
        from flwr.cli.build import build_fab_from_disk

        return hashlib.sha256(build_fab_from_disk(path)).hexdigest()
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    raise FileNotFoundError(f"no app bundle at {path}: give a .fab file or an app directory")


def parse_approved(text: str, *, origin: str = "approved apps") -> frozenset[str]:
    """Digests from the approval file: one SHA-256 hex per line; ``#`` starts a comment; blank lines ignored."""
    digests = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip().lower()
        if not line:
            continue
        if not _HEX64.match(line):
            raise ValueError(f"{origin} line {number}: {raw.strip()!r} is not a SHA-256 hex digest (64 hex digits)")
        digests.add(line)
    return frozenset(digests)


def load_approved(path: str | Path) -> frozenset[str]:
    """The site's approved digests; an empty or missing file is an error (it would refuse every run anyway)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"approved-apps file {path} does not exist")
    digests = parse_approved(path.read_text(encoding="utf-8"), origin=str(path))
    if not digests:
        raise ValueError(f"approved-apps file {path} lists no digest: approve a bundle with `fedpose site approve`")
    return digests


def check_fab(fab_hash: str, content: bytes, approved: frozenset[str]) -> str:
    """Return the digest of ``content`` if the site approved it, else raise ``UnapprovedAppError``.

    The digest is recomputed from the bytes: the hash the SuperLink declares
    is not trusted (it names the directory the bundle is loaded from, so it
    must match the content too).
    """
    digest = hashlib.sha256(content).hexdigest()
    if not hmac.compare_digest(digest, str(fab_hash).lower()):
        raise UnapprovedAppError(f"app bundle content (sha256 {digest[:12]}...) does not match its declared hash "
                                 f"{str(fab_hash)[:12]}...: refused")
    if digest not in approved:
        raise UnapprovedAppError(f"app bundle sha256 {digest} is not approved by this site: refused, nothing run")
    return digest


def bundle_metadata(content: bytes) -> tuple[str, str]:
    """(fab_id, version) a bundle declares in its own pyproject.toml: ``publisher/name`` and ``version``."""
    try:
        with zipfile.ZipFile(io.BytesIO(content)) as fab:
            config = tomllib.loads(fab.read("pyproject.toml").decode("utf-8"))
        publisher = config["tool"]["flwr"]["app"]["publisher"]
        name, version = config["project"]["name"], config["project"]["version"]
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError, tomllib.TOMLDecodeError, TypeError) as err:
        raise UnapprovedAppError(f"app bundle has no readable pyproject.toml metadata: refused ({err})") from err
    for part in (publisher, name, version):
        if not isinstance(part, str) or not _SAFE_PART.match(part) or ".." in part:
            raise UnapprovedAppError(f"app bundle metadata {part!r} is not a plain name: refused")
    return f"{publisher}/{name}", version


def check_run(run: Any, content: bytes) -> None:
    """Refuse a run whose ``fab_id`` / ``fab_version`` (chosen by the SuperLink) differ from the bundle's own.

    Flower loads the ClientApp from a directory built from these two strings: a version such as
    ``0.1.0/../../elsewhere`` would load code that was never checked.
    """
    fab_id, version = bundle_metadata(content)
    if getattr(run, "fab_id", None) != fab_id or getattr(run, "fab_version", None) != version:
        raise UnapprovedAppError(f"run names app {getattr(run, 'fab_id', None)!r} version "
                                 f"{getattr(run, 'fab_version', None)!r}, but the approved bundle is {fab_id!r} "
                                 f"version {version!r}: refused, nothing run")


def private_flower_home() -> Path:
    """A fresh FLWR_HOME for this ClientApp process (removed at exit): Flower installs the checked bundle
    there, so an install directory left by anything else is never reused."""
    import atexit

    home = Path(tempfile.mkdtemp(prefix="fedpose-clientapp-"))
    os.environ["FLWR_HOME"] = str(home)
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    return home


def install_gate(runtime: Any, approved: frozenset[str]) -> None:
    """Gate Flower's ClientApp runner (module ``flwr.supernode.runtime.run_clientapp``) in this process.

    ``run_clientapp`` pulls the task input (message, context, run, FAB), then
    calls ``install_from_fab`` and only then imports the ClientApp. The check
    runs on the pulled FAB and the refusal is raised from ``install_from_fab``:
    by then Flower holds the message and context, so it sends its generic error
    reply (the server learns at once that this site refused) and the bundle is
    never unpacked or imported. Raising earlier would leave Flower without a
    message to reply to, and the server would wait for its timeout.
    """
    pull, install = runtime.pull_task_input, runtime.install_from_fab
    verdict: dict[str, Any] = {}

    def pull_checked(client: Any) -> tuple[Any, Any, Any, Any]:
        message, context, run, fab = pull(client)
        verdict.clear()
        try:
            verdict["digest"] = check_fab(fab.hash_str, fab.content, approved)
            check_run(run, fab.content)
        except UnapprovedAppError as err:
            verdict["refused"] = err
        return message, context, run, fab

    def install_checked(content: bytes, *args: Any, **kwargs: Any) -> Any:
        if "refused" in verdict:
            raise verdict["refused"]
        if hashlib.sha256(content).hexdigest() != verdict.get("digest"):
            raise UnapprovedAppError("app bundle to install is not the one checked against the approved list: refused")
        # The round binds its charge to the bundle that runs it (P16: client.request.running_bundle).
        os.environ["FEDPOSE_APP_DIGEST"] = verdict["digest"]
        return install(content, *args, **kwargs)

    runtime.pull_task_input = pull_checked
    runtime.install_from_fab = install_checked


def run_gate(argv: Sequence[str]) -> None:
    """``python -m fedpose.client.app_trust --approved FILE -- <flwr-clientapp arguments>``: Flower's ClientApp
    process, gated.

    The approved digests are read here, before Flower connects to the
    SuperNode; an unreadable file stops the process (the task then fails, and
    nothing is run). Flower's ``run_clientapp`` catches the refusal and sends
    its generic error reply.
    """
    args = list(argv)
    if len(args) < 2 or args[0] != "--approved":
        raise ValueError("usage: python -m fedpose.client.app_trust --approved FILE -- <flwr-clientapp arguments>")
    approved = load_approved(args[1])
    rest = args[2:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    import flwr.supernode.runtime.run_clientapp as runtime
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    install_gate(runtime, approved)
    # Flower starts this process while the SuperNode still fetches the message's objects: look again after
    # 0.05 s, not after Flower's 1 s.
    from fedpose.shared.flower.waits import quick_pulls

    quick_pulls(runtime, "pull_and_inflate_object_from_tree")
    private_flower_home()  # installed fresh from the checked bytes; nothing on disk is reused
    # The approved bundle must be loaded from its own directory, not from the site's installed package
    # this gate was imported from: forget the site's ``fedpose`` root and its ``client`` and ``shared`` modules
    # (the closures above keep what they use). A bundle that holds no fedpose/ folder (built by ``flwr build`` in
    # a checkout) is then served by the site's own install.
    for name in [m for m in sys.modules if m == "fedpose" or m.split(".")[:2] in (["fedpose", "client"],
                                                                                     ["fedpose", "shared"])]:
        del sys.modules[name]
    sys.argv = [SHIM_NAME, *rest]
    flwr_clientapp()


def write_shim(directory: str | Path, *, approved: str | Path, python: str | None = None,
               warm_socket: str | Path | None = None) -> Path:
    """Write the ``flwr-clientapp`` executable that runs Flower's ClientApp through the gate.

    Put ``directory`` first on the SuperNode's PATH (``fedpose site start`` does):
    Flower's SuperExec starts ``flwr-clientapp`` by name. With ``warm_socket``, the shim first asks the
    site's warm-start server (``fedpose.client.warm``) to fork the gated ClientApp from its already imported
    libraries; when that server is not there it runs the gate itself, as it does without one.
    """
    approved_path = Path(approved).expanduser().resolve()
    load_approved(approved_path)  # fail now, not at the first task
    directory = Path(directory).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    python = python or sys.executable
    repo = Path(__file__).resolve().parents[1]
    shim = directory / SHIM_NAME
    shim.write_text(
        f"#!{python} -IS\n"
        "# fedpose site gate: only app bundles whose SHA-256 is in the approved file run here.\n"
        "import os, signal, socket, sys\n"
        f"REPO, PYTHON, APPROVED, WARM = {str(repo)!r}, {python!r}, {str(approved_path)!r}, "
        f"{str(warm_socket) if warm_socket else None!r}\n"
        "def cold():\n"
        "    env = dict(os.environ)\n"
        "    env['PYTHONPATH'] = REPO + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')\n"
        "    os.execve(PYTHON, [PYTHON, '-m', 'fedpose.client.app_trust', '--approved', APPROVED, '--',\n"
        "                       *sys.argv[1:]], env)\n"
        "sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "try:\n"
        "    if WARM is None: raise OSError\n"
        "    sock.connect(WARM)\n"
        "except OSError:\n"
        "    cold()\n"
        # -S: no site-packages, so no fedpose root to import through; the folder holding client/ is put on the
        # path and warm.py (standard library only at import) is imported by its folder's name
        "sys.path.insert(0, REPO)\n"
        "from client.warm import recv_frame, send_frame\n"
        "send_frame(sock, {'argv': sys.argv[1:], 'env': dict(os.environ), 'cwd': os.getcwd()}, [0, 1, 2])\n"
        "try:\n"
        "    pid = recv_frame(sock)[0]['pid']\n"
        "    for sig in (signal.SIGTERM, signal.SIGINT):\n"
        "        signal.signal(sig, lambda n, _f: os.kill(pid, n))\n"
        "    sys.exit(recv_frame(sock)[0]['exit'])\n"
        "except (OSError, ValueError, KeyError):\n"
        "    sys.exit(1)\n",
        encoding="utf-8",
    )
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return shim


def gated_env(shim_dir: str | Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The SuperNode's environment with the shim directory first on PATH, then this Python's own scripts (the
    SuperNode starts Flower's ``flower-superexec`` by name, also when fedpose runs from a venv not activated)."""
    out = dict(os.environ if env is None else env)
    out["PATH"] = os.pathsep.join([str(Path(shim_dir).resolve()), str(Path(sys.executable).parent),
                                   *filter(None, [out.get("PATH")])])
    return out


if __name__ == "__main__":  # pragma: no cover - exercised by the deployment test in a real ClientApp process
    run_gate(sys.argv[1:])
