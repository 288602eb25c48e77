"""The built-in test runner of the ``swe`` synthetic repositories: a plain,
standard-library-only script, copied into each repository as
``run_tests.py`` and run there as ``python -I run_tests.py``.

It imports every ``test_*.py`` of the working directory (sorted by name),
runs each of its functions named ``test_*`` in definition order, a test
passing when it returns without raising, and prints one line per test::

    PASS test_calc.py::test_add
    FAIL test_calc.py::test_sub: AssertionError

then ``N passed, M failed``. A test that runs longer than
``TEST_TIMEOUT_S`` fails with ``Timeout`` and the run goes on; a file that
cannot be imported fails as ``FILE::<import>``. ``-I`` leaves the
repository off ``sys.path`` until the runner's own modules are imported, so
a file in the repository cannot shadow them. The environment imports
:func:`report_lines` to predict this output in demonstrations.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from collections.abc import Callable, Sequence

TEST_TIMEOUT_S = 2


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _Timeout


def report_lines(results: Sequence[tuple[str, str | None]]) -> list[str]:
    """The runner's output for ``(test id, error name or None)`` pairs."""
    lines = [f"PASS {node}" if err is None else f"FAIL {node}: {err}" for node, err in results]
    failed = sum(err is not None for _, err in results)
    return [*lines, f"{len(results) - failed} passed, {failed} failed"]


def _run_one(test: Callable[[], object]) -> str | None:
    """Run one test under the per-test time limit; the error's name or None."""
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT_S)
    try:
        test()
    except _Timeout:
        return "Timeout"
    except BaseException as err:  # a test may raise anything, SystemExit included
        return type(err).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return None


def run_file(name: str) -> list[tuple[str, str | None]]:
    """``(test id, error name or None)`` for every test of the file ``name``."""
    try:
        spec = importlib.util.spec_from_file_location(name[:-3], name)
        if spec is None or spec.loader is None:
            raise ImportError(name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as err:
        return [(f"{name}::<import>", type(err).__name__)]
    tests = [(k, v) for k, v in vars(module).items() if k.startswith("test_") and callable(v)]
    return [(f"{name}::{key}", _run_one(test)) for key, test in tests]


def main() -> None:
    """Run every test file of the working directory and print the report."""
    signal.signal(signal.SIGALRM, _alarm)
    sys.path.append(os.getcwd())
    files = sorted(f for f in os.listdir(".") if f.startswith("test_") and f.endswith(".py"))
    results = [r for name in files for r in run_file(name)]
    print("\n".join(report_lines(results)), flush=True)


if __name__ == "__main__":
    main()
