"""Warm-started policies built once per test session, before any test runs
(a pytest plugin, loaded by ``tests/conftest.py``).

A test that needs a tiny preset's cached warm start says so with
``@pytest.mark.warm_start("calc-tiny")``. After collection, and so only for
the selected tests (``pytest tests/algo`` builds nothing), each named preset's
policy is built if the cache lacks it, one line each with its time. That is
outside every per-test timeout: pytest-timeout times a test's setup, call and
teardown, and collection is none of them. During the tests, building a warm
start in the shared cache is an error: a test that would build one under its
own timeout fails at once, naming the marker it lacks.

Under pytest-xdist (``pytest -n N``, as ``make test`` runs) the controller
builds them, on its terminal, after the first worker has collected and before
any test is handed out; the workers wait.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sao.config import load_config
from sao.models.cache import Recipe, sao_home

MARKER = "warm_start"
FAILED = pytest.StashKey[dict[str, str]]()
"""Presets whose warm start failed to build before the tests, with the error."""


def preset_args(preset: str) -> tuple[str, dict[str, object], str, int]:
    """``ensure_policy``'s task, options, size and seed for a preset, resolved
    as :func:`sao.app.parts.policy_path` resolves them for ``sao train``."""
    cfg = load_config(preset)
    return cfg.task.name, {"seed": cfg.seed, **cfg.task.options}, cfg.model.tiny_size, cfg.seed


def needed(items: list[pytest.Item]) -> list[str]:
    """The presets the items' ``warm_start`` markers name, in first-use order."""
    presets: dict[str, None] = {}
    for item in items:
        for mark in item.iter_markers(MARKER):
            presets.update(dict.fromkeys(mark.args))
    return list(presets)


def build(preset: str, write: Callable[[str], None]) -> str | None:
    """Build ``preset``'s warm start if the cache lacks it, saying so on one
    line either way (``write`` adds no newline: the notice comes before the
    build, its seconds after it). Returns the error that stopped the build, if
    any; each test that needs the policy then fails with it."""
    from sao.app.warmstart import build_notice, ensure_policy, policy_dir

    task, options, size, seed = preset_args(preset)
    path = policy_dir(task, options, size=size, seed=seed)
    if path.is_dir():
        write(f"{preset}'s warm-started policy: cached in {path}\n")
        return None
    write(f"{preset}: {build_notice(task, size)} ")
    t0 = time.perf_counter()
    try:
        ensure_policy(task, options, size=size, seed=seed, progress=False, say=lambda _: None)
    except Exception as err:  # reported by each test that needs it
        write(f"failed after {time.perf_counter() - t0:.1f} s: {err!r}\n")
        return f"{type(err).__name__}: {err}"
    write(f"{time.perf_counter() - t0:.1f} s\n")
    return None


def build_all(config: pytest.Config, presets: list[str]) -> dict[str, str]:
    """Build ``presets`` on the terminal; the errors of those that failed."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")

    def write(text: str) -> None:
        if reporter is None:
            print(text, end="", flush=True)
        else:
            reporter.write(text, flush=True)

    failed = {}
    for preset in presets:
        if reporter is not None:
            reporter.ensure_newline()
        if (error := build(preset, write)) is not None:
            failed[preset] = error
    return failed


@pytest.hookimpl(tryfirst=True)  # (a worker's list is written before xdist reports it collected)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the warm starts the selected tests need, before the first test.
    Under pytest-xdist (``-n N``) a worker only says which it needs: the
    controller builds them on its terminal before it hands out a test
    (:func:`pytest_xdist_node_collection_finished`)."""
    config = session.config
    if config.option.collectonly:
        return
    presets = needed(session.items)
    if (exchange := _exchange(config)) is not None:  # an xdist worker
        worker = config.workerinput["workerid"]  # type: ignore[attr-defined]
        (exchange / f"{worker}.json").write_text(json.dumps(presets))
        return
    config.stash[FAILED] = build_all(config, presets)


# ------------------------------------------------------------------ pytest-xdist

EXCHANGE = pytest.StashKey[Path]()
"""The controller's folder for what its workers need and what failed to build."""
KEY = "sao_warm_starts"


def _exchange(config: pytest.Config) -> Path | None:
    """The exchange folder, in an xdist worker (None elsewhere)."""
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else Path(workerinput[KEY])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(xdist controller) Give each worker the exchange folder."""
    config = node.config
    if EXCHANGE not in config.stash:
        config.stash[EXCHANGE] = Path(tempfile.mkdtemp(prefix="sao-warm-starts-"))
    node.workerinput[KEY] = str(config.stash[EXCHANGE])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """(xdist controller) When the first worker has collected, build what it
    needs before any test is scheduled (workers collect the same tests), and
    leave the failures where the workers' tests look for them."""
    config = node.config
    if FAILED in config.stash or config.option.collectonly:
        return
    exchange = config.stash[EXCHANGE]
    wanted = exchange / f"{node.gateway.id}.json"  # (absent if its collection failed)
    presets = json.loads(wanted.read_text()) if wanted.is_file() else []
    failed = build_all(config, presets)
    (exchange / "failed.json").write_text(json.dumps(failed))
    config.stash[FAILED] = failed


def _failed(config: pytest.Config) -> dict[str, str]:
    """Presets whose warm start failed to build before the tests (in a worker:
    as the controller left them, read once)."""
    if FAILED not in config.stash:
        exchange = _exchange(config)
        path = None if exchange is None else exchange / "failed.json"
        config.stash[FAILED] = json.loads(path.read_text()) if path and path.is_file() else {}
    return config.stash[FAILED]


@pytest.fixture(autouse=True)
def _no_warm_start_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail a test whose marked warm start failed to build, and one that would
    build a warm start in the shared cache (under its own timeout). A test that
    points ``SAO_HOME`` at its own folder may build there."""
    import sao.app.warmstart as warmstart

    failed = _failed(request.config)
    for mark in request.node.iter_markers(MARKER):
        for preset in set(mark.args) & set(failed):
            pytest.fail(f"{preset}'s warm start failed to build before the tests: {failed[preset]}")
    shared, real = sao_home(), warmstart.build_cached

    def guarded(kind: str, recipe: Recipe, build: Callable[[Path], None]) -> Path:
        path = warmstart.cached_model_dir(kind, recipe)
        if sao_home() == shared and not path.is_dir():
            raise AssertionError(
                f"this test would build the {recipe.get('task')} task's warm-started policy "
                f"under its own timeout; mark it @pytest.mark.{MARKER}(PRESET) (the tiny "
                "preset whose policy it uses) so that it is built before the tests"
            )
        return real(kind, recipe, build)

    monkeypatch.setattr(warmstart, "build_cached", guarded)
