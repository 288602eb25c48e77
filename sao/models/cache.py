"""The on-disk model cache: where built models live, keyed by the recipe that
built them, and an atomic directory writer so a crash never leaves a
half-written model directory behind.

Layout::

    $SAO_HOME/models/<kind>/<hash of the recipe>/   (a complete model directory)
                                          recipe.json (the recipe, for humans)

A directory appears under its final name only once it is complete (it is built
under a temporary sibling name and renamed), so "the directory exists" means
"the model is ready".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

__all__ = ["atomic_dir", "build_cached", "cached_model_dir", "recipe_hash", "sao_home"]

Recipe = Mapping[str, object]
_KIND_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def sao_home() -> Path:
    """The cache root: ``$SAO_HOME`` if set, else ``~/.cache/sao``."""
    root = os.environ.get("SAO_HOME") or os.path.join("~", ".cache", "sao")
    return Path(root).expanduser()


def recipe_hash(recipe: Recipe) -> str:
    """A stable 16-hex-digit hash of a JSON-serialisable recipe.

    Keys are sorted and separators fixed, so two dicts that compare equal hash
    equally whatever their insertion order.
    """
    try:
        text = json.dumps(recipe, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"recipe must be JSON-serialisable (str, int, float, bool, None, lists, dicts "
            f"with str keys); got {recipe!r}: {err}"
        ) from err
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def cached_model_dir(kind: str, recipe: Recipe) -> Path:
    """Where the model built by ``recipe`` lives: ``sao_home()/models/kind/hash``.

    The directory may not exist yet; :func:`build_cached` creates it.
    """
    if not _KIND_RE.match(kind):
        raise ValueError(
            f"kind must be a simple name (letters, digits, '.', '_', '-'), got {kind!r}"
        )
    return sao_home() / "models" / kind / recipe_hash(recipe)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike[str], *, overwrite: bool = True) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success rename it to ``final``.

    On an exception the temporary directory is removed and ``final`` is left
    untouched. With ``overwrite`` an existing ``final`` is replaced (moved
    aside, then deleted after the rename); without it, an existing ``final``
    (e.g. built meanwhile by another process) is kept and the new one dropped.
    """
    final_path = Path(final)
    final_path.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = final_path.parent / f".{final_path.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old: Path | None = None
    if final_path.exists():
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = final_path.parent / f".{final_path.name}.old-{tag}"
        final_path.rename(old)
    try:
        tmp.rename(final_path)
    except OSError:
        # Another writer won the race; keep its (complete) directory.
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final_path.exists():
            old.rename(final_path)
            old = None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_cached(kind: str, recipe: Recipe, build: Callable[[Path], None]) -> Path:
    """Return the cached directory for ``recipe``, building it first if absent.

    ``build(tmp_dir)`` must write the whole model into ``tmp_dir``; the
    directory is published atomically with a ``recipe.json`` beside the model
    files. Rebuilding never happens once the directory exists.
    """
    final = cached_model_dir(kind, recipe)
    if final.is_dir():
        return final
    with atomic_dir(final, overwrite=False) as tmp:
        build(tmp)
        (tmp / "recipe.json").write_text(json.dumps(recipe, sort_keys=True, indent=2) + "\n")
    return final
