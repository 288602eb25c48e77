"""Checkpoint manifests: the relative path, size and SHA-256 of every file a
checkpoint directory holds (``sharded/`` DCP files included), written last,
just before the directory is renamed into place.

The rename makes a checkpoint appear whole or not at all, but bytes can still
go bad afterwards: a copy that stopped half-way, a full or failing disk, a
machine that lost power before the page cache reached the disk, a file edited
by hand. :func:`manifest_problem` recognises all of them on resume (which then
falls back to the previous checkpoint) instead of a traceback deep inside
``torch.load`` or safetensors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"
"""The manifest's name inside a checkpoint directory."""
FORMAT = 1
"""Bumped when the manifest's layout changes."""


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path) -> Path:
    """Write ``directory/manifest.json`` listing every other file under it
    (``{"format": 1, "files": {relative/path: {"size": bytes, "sha256": hex}}}``)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST:
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    out = directory / MANIFEST
    out.write_text(json.dumps({"format": FORMAT, "files": files}, indent=1) + "\n")
    return out


def manifest_problem(directory: Path) -> str | None:
    """Why ``directory`` does not match its manifest (the first difference
    found), or None when every listed file is there with its size and hash.
    Files not listed are ignored. Call only when the manifest exists."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            return f"{MANIFEST} has an unknown format"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for rel, want in files.items():
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{rel} has {size} bytes, the manifest says {want['size']} (truncated?)"
        if sha256_file(path) != want["sha256"]:
            return f"{rel} does not match its SHA-256 in the manifest (corrupt)"
    return None
