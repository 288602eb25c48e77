"""Importing a GGUF checkpoint (llama.cpp's single-file format) as a Hugging
Face model directory in the model cache.

GGUF files hold quantized weights (e.g. Q4_1), a tokenizer and a chat template
in one file. Training needs plain float weights, so :func:`import_gguf`
converts the file once into::

    $SAO_HOME/models/gguf/<hash>/   config.json, model.safetensors (float32),
                                    tokenizer.json, tokenizer_config.json,
                                    chat_template.jinja, generation_config.json,
                                    gguf.json (where it came from), recipe.json

keyed by the file's SHA-256 (the same bytes under another name reuse the
directory) and published atomically (:func:`sao.models.cache.build_cached`).

Recipe: transformers loads the file dequantized to float32
(``from_pretrained(dir, gguf_file=name)``, which needs the ``gguf`` package),
but the model it returns is marked GGUF-quantized and ``save_pretrained``
refuses it; so the model is rebuilt with ``from_config`` from the same config
without ``quantization_config`` and the dequantized state dict is loaded into
it. Tied embeddings stay one tensor. The tokenizer (with the chat template of
the file's metadata) comes from ``AutoTokenizer.from_pretrained(dir,
gguf_file=name)``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from sao.models.cache import build_cached
from sao.models.loading import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "GGUFImportError",
    "gguf_architecture",
    "import_gguf",
    "is_gguf_path",
    "sha256_file",
]

CONVERTER_VERSION = 1
"""Part of the cache key: bump it when the conversion changes what it writes."""
_MAGIC = b"GGUF"
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Byte sizes of GGUF's fixed-size metadata value types (uint8 .. float64)."""
_STRING, _ARRAY = 8, 9
_RENAMED = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}
"""llama.cpp architecture names that transformers spells differently."""
_EXTRA_HELP = "pip install 'sao[real]' (the gguf and accelerate packages)"


class GGUFImportError(ModelLoadError):
    """A GGUF file that cannot be imported, with the fix in the message."""


def is_gguf_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a GGUF file (by its ``.gguf`` suffix)."""
    return str(path).lower().endswith(".gguf")


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The SHA-256 hex digest of a file's bytes, remembered per (path, size,
    mtime) so that asking again in the same process costs nothing."""
    p = Path(path).resolve()
    st = p.stat()
    return _sha256(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFImportError(f"{str(path)!r} ends inside its GGUF header: the file is truncated")
    return data


def _skip_value(f: BinaryIO, kind: int, path: Path) -> None:
    """Read past one metadata value of type ``kind``."""
    if kind in _FIXED:
        _read(f, _FIXED[kind], path)
    elif kind == _STRING:
        (n,) = struct.unpack("<Q", _read(f, 8, path))
        f.seek(n, os.SEEK_CUR)
    elif kind == _ARRAY:
        item, count = struct.unpack("<IQ", _read(f, 12, path))
        if item in _FIXED:
            f.seek(_FIXED[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, item, path)
    else:
        raise GGUFImportError(f"{str(path)!r}: unknown GGUF metadata value type {kind}")


def gguf_architecture(path: str | os.PathLike[str]) -> str:
    """``general.architecture`` from a GGUF file's header (e.g. ``"llama"``).

    Reads only the metadata keys up to that one (it is the first key in files
    written by llama.cpp), not the tensors: milliseconds, where the ``gguf``
    package's reader parses the whole file.
    """
    p = Path(path)
    with open(p, "rb") as f:
        if f.read(4) != _MAGIC:
            raise GGUFImportError(
                f"{str(p)!r} is not a GGUF file (it does not start with the bytes 'GGUF'). "
                "Fix: pass a llama.cpp .gguf checkpoint, or a Hugging Face model directory"
            )
        _version, _tensors, num_keys = struct.unpack("<IQQ", _read(f, 20, p))
        for _ in range(num_keys):
            (n,) = struct.unpack("<Q", _read(f, 8, p))
            key = _read(f, n, p).decode("utf-8", errors="replace")
            (kind,) = struct.unpack("<I", _read(f, 4, p))
            if key == "general.architecture" and kind == _STRING:
                (n,) = struct.unpack("<Q", _read(f, 8, p))
                return _read(f, n, p).decode("utf-8", errors="replace")
            _skip_value(f, kind, p)
    raise GGUFImportError(f"{str(p)!r} has no general.architecture in its GGUF metadata")


def _require_packages() -> None:
    """A clear error when the packages transformers' GGUF loader needs are missing."""
    import importlib.util

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise GGUFImportError(
            f"importing a GGUF checkpoint needs the {' and '.join(missing)} package(s), "
            f"which are not installed. Fix: {_EXTRA_HELP}"
        )


def _check_architecture(path: Path, arch: str) -> None:
    """Fail before any loading when transformers cannot dequantize ``arch``
    into a causal language model."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = _RENAMED.get(arch, arch)
    causal = sorted(
        a for a in GGUF_SUPPORTED_ARCHITECTURES if a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    if name not in causal:
        why = (
            "is not a causal language model"
            if name in GGUF_SUPPORTED_ARCHITECTURES
            else "is one transformers cannot read from GGUF"
        )
        raise GGUFImportError(
            f"{str(path)!r} holds a {arch!r} model (general.architecture), which {why}, so it "
            f"cannot be dequantized into a trainable policy. Architectures that can: "
            f"{', '.join(causal)}. Fix: use a GGUF of one of those, or the model's Hugging Face "
            "checkpoint directory"
        )


def import_gguf(path: str | os.PathLike[str]) -> Path:
    """The Hugging Face directory of the GGUF file ``path``, converting it
    into the cache first if it is not there yet (see the module docstring).

    Raises :class:`GGUFImportError` when the file is missing, is not GGUF,
    holds an architecture transformers cannot dequantize into a causal LM, or
    the ``gguf`` / ``accelerate`` packages are missing.
    """
    src = Path(path).expanduser().resolve()
    if not src.is_file():
        state = "is a directory" if src.exists() else "does not exist"
        raise GGUFImportError(
            f"GGUF import: {str(path)!r} {state}. Fix: pass the path of a .gguf file "
            "(`sao models fetch smollm2-135m` installs one)"
        )
    arch = gguf_architecture(src)
    _require_packages()
    _check_architecture(src, arch)
    digest = sha256_file(src)
    recipe = {"gguf_sha256": digest, "converter": CONVERTER_VERSION, "dtype": "float32"}

    def build(tmp: Path) -> None:
        convert_gguf(src, tmp)
        info = {"source": str(src), "sha256": digest, "architecture": arch}
        (tmp / "gguf.json").write_text(json.dumps(info, indent=2) + "\n")

    return build_cached("gguf", recipe, build)


def convert_gguf(src: Path, out: Path) -> None:
    """Write the float32 Hugging Face model and tokenizer of GGUF file ``src``
    into the directory ``out`` (no caching; :func:`import_gguf` caches)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {"gguf_file": src.name, "local_files_only": True}
    try:
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, dtype=torch.float32, **where)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, **where)
    except (ValueError, NotImplementedError, KeyError) as err:
        raise GGUFImportError(
            f"transformers cannot dequantize {str(src)!r}: {type(err).__name__}: {err}. Fix: "
            "use a GGUF of a supported architecture and quantization type, or the model's "
            "Hugging Face checkpoint directory"
        ) from err
    model = _unquantized(loaded)
    del loaded
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _unquantized(loaded: PreTrainedModel) -> PreTrainedModel:
    """A plain float32 copy of a model transformers marked GGUF-quantized:
    the same class and config less ``quantization_config``, the same tensors
    (``save_pretrained`` refuses the marked one)."""
    from transformers import AutoModelForCausalLM

    values = loaded.config.to_dict()
    values.pop("quantization_config", None)
    config = type(loaded.config).from_dict(values)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    if getattr(config, "tie_word_embeddings", False):
        head, emb = model.get_output_embeddings(), model.get_input_embeddings()
        if head is None or head.weight is not emb.weight:
            raise GGUFImportError(
                f"the {config.model_type!r} model of this GGUF declares tied embeddings but "
                "its rebuilt head is a separate tensor; this converter cannot save it faithfully"
            )
    return model.eval()
