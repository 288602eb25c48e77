"""The episode's working copy of a ``swe`` repository and the file tools
that act on it (``ls``, ``read``, ``replace``, ``edit``).

The copy is a fresh temporary directory (``sao-swe-*``), made when the
episode starts and removed when it is graded, closed or garbage collected
(a ``weakref.finalize``, which also runs at interpreter exit); the original
repository is only ever read. Every path a tool names is relative to the
copy's root: absolute paths, ``..`` and paths whose real location (after
following symbolic links) lies outside the copy are refused.
"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path

from sao.envs._state import read
from sao.envs.swe.problem import SweProblem

__all__ = ["ToolError", "Workspace"]

MAX_FILE_BYTES = 1 << 20
"""Largest file ``replace`` and ``edit`` write."""
MAX_SHOWN_LINES = 6
"""Lines of an edit's result shown after it."""


class ToolError(ValueError):
    """A tool call the working copy refuses; the message is the observation."""


class Workspace:
    """A working copy of one problem's repository (see the module docstring)."""

    def __init__(self, problem: SweProblem) -> None:
        self.problem = problem
        self.root: Path | None = None
        self._cleanup: weakref.finalize | None = None

    def create(self) -> Path:
        """Make a fresh copy of the original repository (removing any earlier one)."""
        self.remove()
        root = Path(tempfile.mkdtemp(prefix="sao-swe-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, root, ignore_errors=True)
        self.root = root
        self.problem.materialize(root)
        return root

    def remove(self) -> None:
        """Delete the working copy (nothing happens when there is none)."""
        if self._cleanup is not None:
            self._cleanup()
        self.root, self._cleanup = None, None

    def _root(self) -> Path:
        if self.root is None:
            raise ToolError("error: the episode is not running")
        return self.root

    def resolve(self, rel: str, *, kind: str = "file") -> Path:
        """The real path of ``rel`` inside the copy; ``kind`` ``file`` or
        ``dir`` must exist as that. Raises :class:`ToolError` for anything else."""
        root = self._root()
        if not rel or "\x00" in rel:
            raise ToolError("error: a path is needed")
        if os.path.isabs(rel) or rel.startswith("~"):
            raise ToolError(f"refused: {rel[:60]} is absolute; use a path inside the repository")
        if ".." in Path(rel).parts:
            raise ToolError(f"refused: {rel[:60]} leaves the repository ('..')")
        real = Path(os.path.realpath(root / rel))
        real_root = Path(os.path.realpath(root))
        if real != real_root and real_root not in real.parents:
            raise ToolError(f"refused: {rel[:60]} leads outside the repository (a link)")
        if kind == "dir" and not real.is_dir():
            raise ToolError(f"error: no directory {rel[:60]}")
        if kind == "file" and not real.is_file():
            what = "is a directory" if real.is_dir() else "does not exist (ls lists the files)"
            raise ToolError(f"error: {rel[:60]} {what}")
        return real

    def ls(self, rel: str = "") -> str:
        """The files under ``rel`` (default: all), one relative path a line."""
        root = self._root()
        top = self.resolve(rel, kind="dir") if rel and rel != "." else Path(os.path.realpath(root))
        real_root = Path(os.path.realpath(root))
        found = sorted(str(p.relative_to(real_root)) for p in _files(top, links=True))
        return "\n".join(found) if found else "(no files)"

    def read(self, rel: str, start: int | None = None, end: int | None = None) -> str:
        """Lines ``start..end`` (1-based, inclusive; default all) of ``rel``, numbered."""
        lines = _lines(self.resolve(rel))
        first = 1 if start is None else start
        last = len(lines) if end is None else min(end, len(lines))
        if first < 1 or (end is not None and end < first):
            raise ToolError("error: need 1 <= START <= END; format: read PATH [START [END]]")
        if first > max(len(lines), 1):
            raise ToolError(f"error: {rel[:60]} has {len(lines)} lines")
        return _numbered(lines, first, last) if lines else "(empty file)"

    def replace(self, rel: str, old: str, new: str) -> str:
        """Replace the single occurrence of ``old`` in ``rel`` by ``new``."""
        path = self.resolve(rel)
        text = _text(path)
        if not old:
            raise ToolError("error: the old text is empty; format: replace PATH OLD => NEW")
        count = text.count(old)
        if count != 1:
            where = "not found" if count == 0 else f"found {count} times (make it unique)"
            raise ToolError(f"error: old text {where} in {rel[:60]}")
        at = text.index(old)
        self._write(path, text[:at] + new + text[at + len(old) :])
        first = text[:at].count("\n") + 1
        return self._shown(rel, path, first, first + new.count("\n"))

    def edit(self, rel: str, start: int, end: int, new_text: str) -> str:
        """Replace lines ``start..end`` of ``rel`` by ``new_text`` (deleting
        them when it is empty; ``end = start - 1`` inserts before ``start``)."""
        path = self.resolve(rel)
        lines = _lines(path)
        if not (1 <= start <= len(lines) + 1 and start - 1 <= end <= len(lines)):
            raise ToolError(
                f"error: {rel[:60]} has {len(lines)} lines; need 1 <= START <= END + 1, "
                "END <= lines; format: edit PATH START END, then the new lines"
            )
        added = new_text.split("\n") if new_text else []
        self._write(path, "".join(ln + "\n" for ln in lines[: start - 1] + added + lines[end:]))
        if not added:
            return f"edited {rel[:60]}: lines {start}-{end} deleted"
        return self._shown(rel, path, start, start + len(added) - 1)

    def _write(self, path: Path, text: str) -> None:
        data = text.encode()
        if len(data) > MAX_FILE_BYTES:
            raise ToolError(f"error: the file would exceed {MAX_FILE_BYTES} bytes")
        path.write_bytes(data)

    def _shown(self, rel: str, path: Path, first: int, last: int) -> str:
        """``edited PATH:`` and the changed lines, numbered (at most a few)."""
        lines = _lines(path)
        last = min(last, first + MAX_SHOWN_LINES - 1, len(lines))
        return f"edited {rel[:60]}:\n" + _numbered(lines, first, last)

    # ------------------------------------------------------------- state

    def changes(self) -> dict[str, object]:
        """The copy's differences from the original (JSON data): files added
        or changed (``text``, or ``b64`` for bytes that are not UTF-8) and
        original files deleted. Empty directories and links are not kept."""
        root = self._root()
        text: dict[str, str] = {}
        b64: dict[str, str] = {}
        present = set()
        for p in _files(root, links=False):
            rel = str(p.relative_to(root))
            present.add(rel)
            data = p.read_bytes()
            if data == self.problem.original(rel):
                continue
            try:
                text[rel] = data.decode()
            except UnicodeDecodeError:
                b64[rel] = base64.b64encode(data).decode()
        deleted = [p for p in self.problem.original_paths() if p not in present]
        return {"text": text, "b64": b64, "deleted": deleted}

    def apply(self, changes: Mapping[str, object]) -> None:
        """Make a fresh copy and apply :meth:`changes` to it."""
        root = self.create()
        text = read(changes, "text", dict)
        b64 = read(changes, "b64", dict)
        files = [(k, str(v).encode()) for k, v in text.items()]
        files += [(k, base64.b64decode(str(v))) for k, v in b64.items()]
        for rel in read(changes, "deleted", list):
            (root / str(rel)).unlink(missing_ok=True)
        for rel, data in files:
            if os.path.isabs(rel) or ".." in Path(rel).parts:
                raise ValueError(f"env state 'changes': path {rel!r:.60} is outside the repository")
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)


def _files(top: Path, *, links: bool) -> list[Path]:
    """The regular files under ``top`` and, with ``links``, the links too
    (shown, never followed: the walk does not descend through them)."""
    found = []
    for here, dirs, names in os.walk(top):
        entries = [Path(here, n) for n in names + (dirs if links else [])]
        found += [p for p in entries if (links and p.is_symlink()) or _regular(p)]
    return sorted(found)


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _lines(path: Path) -> list[str]:
    return _text(path).splitlines()


def _numbered(lines: list[str], first: int, last: int) -> str:
    return "\n".join(f"{n} {lines[n - 1]}" for n in range(first, last + 1))
