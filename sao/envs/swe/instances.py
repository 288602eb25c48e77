"""Problems from local files in the SWE-bench instance layout.

A file is a JSON list of instances or JSON Lines (one instance a line).
Each instance::

    {"instance_id": "tiny__calc-1",
     "snapshot": "repos/calc",            # the repository at its base commit
     "problem_statement": "add() subtracts",
     "test_cmd": "python -m pytest -rA -p no:cacheprovider",
     "FAIL_TO_PASS": "[\\"tests/test_calc.py::test_add\\"]",
     "PASS_TO_PASS": ["tests/test_calc.py::test_sub"],
     "test_patch": "diff --git a/tests/test_calc.py ..."}

``snapshot`` (or ``repo_dir``, or ``repo`` when it names a directory) is
relative to the file's folder. ``FAIL_TO_PASS``/``PASS_TO_PASS`` are lists
or JSON-encoded lists, as in SWE-bench. ``test_cmd`` defaults to the task's
``test_cmd``. The test files are what ``test_patch`` makes (applied, at load
time, to copies of the files it touches with ``git apply`` or ``patch``,
whichever is installed) or ``test_files``: a list of the snapshot's paths,
or an object path -> content (null: must not exist). The policy works on the
snapshot without them; grading writes them in.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from sao.envs.swe.problem import SweProblem

__all__ = ["load_instances"]

_PATCH_PATH = re.compile(r"^(?:---|\+\+\+) (?:[ab]/)?(\S+)", re.MULTILINE)


def _fail(where: str, what: str) -> ValueError:
    return ValueError(f"swe instances {where}: {what}")


def _rows(path: Path) -> list[dict[str, object]]:
    if not path.is_file():
        raise _fail(str(path), "no such file; give a JSON or JSONL file of instances")
    text = path.read_text()
    try:
        data = json.loads(text) if text.lstrip().startswith("[") else None
        if data is None:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as err:
        raise _fail(str(path), f"not JSON or JSON Lines ({err})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise _fail(str(path), "expected a list of objects (or one object a line)")
    return data


def _tests(row: dict[str, object], key: str, where: str) -> tuple[str, ...]:
    value = row.get(key, [])
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _fail(where, f"{key} is a string that is not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise _fail(where, f"{key} must be a list of test ids")
    return tuple(value)


def _text(row: dict[str, object], key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value:
        raise _fail(where, f"needs {key!r} (a non-empty string)")
    return value


def _snapshot(row: dict[str, object], base: Path, where: str) -> Path:
    for key in ("snapshot", "repo_dir", "repo"):
        value = row.get(key)
        if isinstance(value, str) and (base / value).is_dir():
            return (base / value).resolve()
    raise _fail(where, "needs 'snapshot' (or 'repo_dir'/'repo'): a directory, relative to the file")


def _inside(rel: str, where: str) -> str:
    if not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise _fail(where, f"test file {rel!r:.60} is not a path inside the repository")
    return rel


def apply_patch(snapshot: Path, patch: str, where: str) -> dict[str, str | None]:
    """Path -> content (None: deleted) of every file ``patch`` touches,
    applied to copies of those files of ``snapshot``."""
    touched = sorted({_inside(p, where) for p in _PATCH_PATH.findall(patch) if p != "/dev/null"})
    tool = ["git", "apply", "--whitespace=nowarn"] if shutil.which("git") else None
    if tool is None and shutil.which("patch"):
        tool = ["patch", "-p1", "-s", "-f", "-i"]
    if tool is None:
        raise _fail(where, "has a test_patch, but neither `git` nor `patch` is installed; "
                    "install one, or give the patched files as test_files")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sao-swe-patch-") as tmp:
        work = Path(tmp) / "repo"
        work.mkdir()
        for rel in touched:
            src = snapshot / rel
            if src.is_file() and not src.is_symlink():
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, work / rel)
        (Path(tmp) / "test.patch").write_text(patch)
        done = subprocess.run(
            [*tool, str(Path(tmp) / "test.patch")], cwd=work, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise _fail(
                where, f"test_patch does not apply: {(done.stderr or done.stdout).strip()[:300]}"
            )
        return {
            rel: (work / rel).read_text() if (work / rel).is_file() else None for rel in touched
        }


def _test_files(row: dict[str, object], snapshot: Path, where: str) -> dict[str, str | None]:
    files: dict[str, str | None] = {}
    patch = row.get("test_patch")
    if isinstance(patch, str) and patch.strip():
        files.update(apply_patch(snapshot, patch, where))
    given = row.get("test_files", {})
    if isinstance(given, list):
        given = {str(p): (snapshot / _inside(str(p), where)).read_text() for p in given}
    if not isinstance(given, dict):
        raise _fail(where, "test_files must be a list of paths or an object path -> content")
    for rel, body in given.items():
        if body is not None and not isinstance(body, str):
            raise _fail(where, f"test_files[{rel!r}] must be text or null")
        files[_inside(str(rel), where)] = body
    return files


def load_instances(path: str | Path, *, default_test_cmd: str) -> list[SweProblem]:
    """The instances of the file ``path`` (module docstring)."""
    path = Path(path)
    problems = []
    for i, row in enumerate(_rows(path)):
        where = f"{path.name}[{i}]"
        iid = _text(row, "instance_id", where)
        where = f"{path.name}[{i}] ({iid})"
        snapshot = _snapshot(row, path.parent, where)
        f2p = _tests(row, "FAIL_TO_PASS", where)
        if not f2p:
            raise _fail(where, "FAIL_TO_PASS is empty: nothing would show the fix")
        cmd = row.get("test_cmd", default_test_cmd)
        problems.append(
            SweProblem(
                instance_id=iid,
                issue=_text(row, "problem_statement", where),
                test_cmd=cmd if isinstance(cmd, str) and cmd else default_test_cmd,
                fail_to_pass=f2p,
                pass_to_pass=_tests(row, "PASS_TO_PASS", where),
                source_dir=str(snapshot),
                test_files=tuple(sorted(_test_files(row, snapshot, where).items())),
            )
        )
    if not problems:
        raise _fail(str(path), "holds no instance")
    return problems
