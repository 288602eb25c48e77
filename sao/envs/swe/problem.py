"""A ``swe`` problem: a small repository, the issue to fix, how its tests
run and which must pass."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sao.envs.sandbox.jail import copy_tree

__all__ = ["SweProblem"]


@dataclass(frozen=True)
class SweProblem:
    """One problem. The repository is either in memory (``files``: path ->
    text, the synthetic problems) or a directory (``source_dir``, a user's
    snapshot); it is never written to: each episode works on a copy.

    ``test_files`` gives the content every test file has when the episode is
    graded (None: the file must not exist); it is what ``protect_tests``
    restores. For a SWE-bench instance these are the files its
    ``test_patch`` makes, which the policy never sees. ``test_cmd`` runs in
    the repository's root; its output is read for per-test results
    (:mod:`sao.envs.swe.grading`).
    """

    instance_id: str
    issue: str
    test_cmd: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    source_dir: str | None = None
    test_files: tuple[tuple[str, str | None], ...] = ()

    @property
    def text(self) -> str:
        """What decides the problem's split: its issue and its files."""
        files = "\n".join(f"{path}\n{body}" for path, body in self.files)
        return f"{self.instance_id}\n{self.issue}\n{files}"

    def test_contents(self) -> Mapping[str, str | None]:
        """``test_files`` as a mapping."""
        return dict(self.test_files)

    def materialize(self, dest: Path) -> None:
        """Write the repository into the existing, empty directory ``dest``."""
        if self.source_dir is not None:
            copy_tree(self.source_dir, str(dest))
        for rel, body in self.files:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(body)

    def original(self, rel: str) -> bytes | None:
        """The bytes of file ``rel`` in the original repository, or None."""
        for path, body in self.files:
            if path == rel:
                return body.encode()
        if self.source_dir is None:
            return None
        source = Path(self.source_dir) / rel
        if source.is_symlink() or not source.is_file():
            return None
        return source.read_bytes()

    def original_paths(self) -> list[str]:
        """Every regular file of the original repository (relative, sorted)."""
        paths = {p for p, _ in self.files}
        if self.source_dir is not None:
            for here, _, names in os.walk(self.source_dir):  # never through a link
                found = (Path(here, n) for n in names)
                paths.update(
                    str(p.relative_to(self.source_dir))
                    for p in found
                    if p.is_file() and not p.is_symlink()
                )
        return sorted(paths)
