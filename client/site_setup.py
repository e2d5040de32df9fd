"""The site operator's own steps on the site's files, before its SuperNode starts: its key pair, the app bundles
it approves, its data and the public set named in its policy (``fedpose site keygen | approve | set-data |
approve-public``).

Each reports what it wrote through ``echo`` (the CLI prints it). The policy is edited in place, line by line,
so the operator's comments and order stay; the public sample rate q = B / n is derived here once, from the
data, and n itself is never written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def keygen(out: str | Path, *, name: str = "node.key", comment: str | None = None, force: bool = False,
           echo: Callable[[str], None] = print) -> tuple[Path, Path]:
    """The site's own SuperNode key pair in ``out``: the private key never leaves the site; the operator registers
    the .pub. Returns (private key, public key)."""
    from fedpose.shared.flower.node_keys import inside_git_tree, key_comment, node_key_pair, write_key_file

    out = Path(out).expanduser().resolve()
    repo = inside_git_tree(out)
    if repo is not None:
        raise ValueError(f"{out} is inside the git work tree {repo}: a private key must never be written there; "
                         "choose the site's own folder (e.g. /etc/fedpose)")
    key, pub = out / name, out / f"{name}.pub"
    existing = [p.name for p in (key, pub) if p.exists()]
    if existing and not force:
        raise ValueError(f"{out} already holds {', '.join(existing)}: a new key pair replaces the one the operator "
                         "registered (use --force, then send the new .pub and ask for the old one to be unregistered)")
    out.mkdir(parents=True, exist_ok=True)
    private, public = node_key_pair(comment or key_comment(out, name))
    write_key_file(key, private, private=True)
    write_key_file(pub, public, private=False)
    echo(f"wrote {key} (private, 0600: it stays here) and {pub}")
    echo(f"send {pub.name} to the federation operator; they register it with their kit's register-sites.sh "
         "(fedpose server register-sites)")
    return key, pub


def approve_bundle(bundle: str | Path, approved: str | Path, *, note: str | None = None,
                   echo: Callable[[str], None] = print) -> str:
    """Record the SHA-256 of a reviewed ``bundle`` (a ``.fab`` or the app directory) in the ``approved`` file,
    with ``note`` beside it (default: the bundle's name); returns the digest."""
    from fedpose.client.app_trust import fab_digest, parse_approved

    digest = fab_digest(bundle)
    path = Path(approved).expanduser()
    known = parse_approved(path.read_text(encoding="utf-8"), origin=str(path)) if path.is_file() else frozenset()
    if digest in known:
        echo(f"{digest} is already approved in {path}")
        return digest
    note = " ".join((note or Path(bundle).name).split())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(f"{digest}  # {note}\n")
    echo(f"approved {digest} ({note}) in {path}")
    return digest


def _edit_policy(path: Path, updates: dict[str, Any]) -> None:
    """Write ``updates`` into the policy YAML at ``path`` keeping its comments and order (line by line)."""
    import yaml

    lines = path.read_text(encoding="utf-8").splitlines()
    for key, value in updates.items():
        text = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000).strip()
        if text.startswith("{") and text.endswith("}"):
            text = text[1:-1]
        for i, line in enumerate(lines):
            if line.split("#", 1)[0].split(":", 1)[0].strip() == key and not line.startswith((" ", "\t")):
                comment = line.split("#", 1)[1] if "#" in line else ""
                lines[i] = (f"{text:<28}  # {comment.strip()}" if comment else text)  # YAML needs a space before #
                break
        else:
            lines.append(text)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)


def set_data(policy: str | Path, data: str | Path, *, echo: Callable[[str], None] = print) -> float:
    """Name the site's ``data`` in its ``policy`` and derive the public sample rate q = B / n from it, once;
    returns q."""
    import yaml

    from fedpose.client.data import load_split_dir
    from fedpose.shared.data.patients import group_by_patient

    path = Path(policy).expanduser().resolve()
    data = Path(data).expanduser().resolve()
    records = load_split_dir(data, "site data")
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    unit = raw.get("unit", "record")
    n = group_by_patient(records, cap=raw.get("max_records_per_patient"))[1].count if unit == "patient" else \
        len(records)
    batch = raw.get("expected_batch")
    if not isinstance(batch, (int, float)) or isinstance(batch, bool) or batch <= 0:
        raise ValueError(f"{path}: expected_batch must be set (the public batch size B the site declares) before "
                         "the sample rate can be derived from it")
    if batch > n:
        raise ValueError(f"{path}: expected_batch {batch:g} is more than the {n} {unit}s at {data}: lower it")
    q = round(batch / n, 4)
    _edit_policy(path, {"data_path": str(data), "sample_rate": q})
    echo(f"{path}: data_path {data}; sample_rate {q:g} (= expected batch {batch:g} / {n} {unit}s, computed once here)")
    echo(f"the server will see q = {q:g} and B = {batch:g}: together they tell the size of this data today "
         f"(about {n} {unit}s), not which {unit}s it holds")
    return q


def approve_public(policy: str | Path, public: str | Path, *, expected: str | None = None,
                   echo: Callable[[str], None] = print) -> str:
    """Show the ``public`` set, then write its path and digest into the ``policy``: what the site trusts as public.
    With ``expected`` (the digest the operator sent with the set), a copy whose images do not match is refused and
    the policy left as it was. Returns the digest."""
    from fedpose.client.data import load_split_dir
    from fedpose.shared.data.split import manifest_digest as public_digest

    path = Path(policy).expanduser().resolve()
    public = Path(public).expanduser().resolve()
    records = load_split_dir(public, "public set")
    images = len({r.image for r in records})
    digest = public_digest(records)
    echo(f"public set {public}: {len(records)} annotated people in {images} images")
    echo(f"digest {digest}")
    if expected is not None and digest != expected.strip().lower():
        raise ValueError(f"the public set {public} has digest {digest}, which does not match the digest the operator "
                         f"sent, {expected.strip()}: its images differ from the operator's (a damaged or altered "
                         "copy, or another set); nothing approved, the policy is unchanged")
    echo("approving it means: this set is public (no patient of this hospital is in it); the site computes its "
         "projection basis from it, and `fedpose site check` refuses to run if it ever changes")
    _edit_policy(path, {"public_path": str(public), "public_digest": digest})
    echo(f"{path}: public_path and public_digest written; now run: fedpose site check --policy {path}")
    return digest
