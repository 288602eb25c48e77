"""``run_shell``: a shell command on a copy of a persistent working directory,
under ``run_python``'s limits; what it leaves is written back (directories
and regular files only), or nothing when it cannot be."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from sao.envs.sandbox import SandboxResult, run_shell


def shell(command: str, workdir: Path, **kwargs: object) -> SandboxResult:
    kwargs.setdefault("wall_s", 3.0)
    return asyncio.run(run_shell(command, workdir, **kwargs))  # type: ignore[arg-type]


def tree(root: Path) -> dict[str, bytes | str]:
    """Relative path -> bytes (files) or "link" / "dir"."""
    out: dict[str, bytes | str] = {}
    for here, dirs, names in os.walk(root):
        for name in dirs + names:
            p = Path(here, name)
            rel = str(p.relative_to(root))
            out[rel] = "link" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


@pytest.fixture
def work(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "a.txt").write_text("hello\n")
    (root / "pkg" / "run.sh").write_text("echo ran\n")
    (root / "pkg" / "run.sh").chmod(0o755)
    return root


def test_changes_persist_and_special_files_are_dropped(work: Path) -> None:
    result = shell(
        "cat a.txt; ./pkg/run.sh; echo new > b.txt; rm a.txt; mkdir -p d/e; echo x > d/e/f;"
        "ln -s /etc/passwd pw; mkfifo fifo; python -c 'print(2 + 2)'",
        work,
    )
    assert result.ok and result.stdout == "hello\nran\n4\n", result
    assert tree(work) == {
        "pkg": "dir",
        "pkg/run.sh": b"echo ran\n",
        "b.txt": b"new\n",
        "d": "dir",
        "d/e": "dir",
        "d/e/f": b"x\n",
    }
    assert os.access(work / "pkg" / "run.sh", os.X_OK)  # permission bits kept


def test_without_write_back_the_directory_is_untouched(work: Path) -> None:
    before = tree(work)
    assert shell("rm -rf * && echo gone", work, write_back=False).stdout == "gone\n"
    assert tree(work) == before


def test_a_timed_out_command_keeps_what_it_wrote(work: Path) -> None:
    result = shell("echo partial > p.txt; sleep 30", work, wall_s=0.5)
    assert result.killed_reason == "timeout"
    assert (work / "p.txt").read_text() == "partial\n"


def test_too_many_files_are_not_written_back(work: Path) -> None:
    before = tree(work)
    result = shell("rm a.txt; for i in $(seq 60); do : > f$i; done", work, max_files=20)
    assert result.export_error is not None or "No space left" in result.stderr
    if result.export_error is not None:
        assert tree(work) == before
    else:  # the tmpfs refused the files: what fits is kept
        assert len(tree(work)) <= 20


def test_a_workdir_that_does_not_fit_is_refused(work: Path, tmp_path: Path) -> None:
    (work / "big.bin").write_bytes(b"0" * (2 << 20))
    with pytest.raises(ValueError, match="disk_mb=1"):
        shell("true", work, disk_mb=1)
    with pytest.raises(ValueError, match="max_files"):
        shell("true", work, max_files=2)
    with pytest.raises(ValueError, match="not a directory"):
        shell("true", tmp_path / "missing")
