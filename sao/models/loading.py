"""Loading causal language models and tokenizers from local directories.

Only local directories are read (``local_files_only=True``): the Hugging Face
hub is never contacted at run time. A model that is not on disk yet must be
downloaded beforehand, or built in code (:mod:`sao.models.tiny`).

Where models live: :func:`resolve_device` and :func:`resolve_dtype` turn the
``model.device`` / ``model.dtype`` names into torch objects. One place decides
the device and dtype of a run; everything else follows the policy's parameters
(``next(policy.parameters()).device``), so the same code runs on CPU (tests) and
on a GPU (bf16).

=========  ==============================================================
name       meaning
=========  ==============================================================
``auto``   ``cuda`` when a CUDA device is visible, else ``cpu``
``cpu``    the CPU
``cuda``   the current CUDA device; ``cuda:N`` the N-th visible one
=========  ==============================================================

dtype ``auto`` is bfloat16 on CUDA and float32 on CPU (bf16 matmuls on CPU are
slow and CPU tests compare log-probabilities at float32 precision).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = [
    "DTYPES",
    "DeviceError",
    "ModelLoadError",
    "load_config",
    "load_policy",
    "load_tokenizer",
    "policy_shell",
    "resolve_device",
    "resolve_dtype",
]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelLoadError(ValueError):
    """A model or tokenizer directory that cannot be used, with the fix in the message."""


def _local_dir(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a Path if it is an existing local directory, else a clear error."""
    p = Path(path).expanduser()
    if not p.is_dir():
        state = "is a file, not a directory" if p.exists() else "does not exist"
        raise ModelLoadError(
            f"{what}: path {str(path)!r} {state}. Models and tokenizers are loaded only from "
            "local directories (local_files_only=True; the Hugging Face hub is never used). "
            "Fix: download it first (e.g. `hf download ORG/NAME --local-dir DIR`) and pass "
            "DIR, or build a tiny model in code with sao.models.build_tiny_policy"
        )
    return p


def load_config(path: str | os.PathLike[str]) -> PretrainedConfig:
    """Read the ``config.json`` of a local model directory (no weights)."""
    p = _local_dir(path, "load_config")
    if not (p / "config.json").is_file():
        raise ModelLoadError(
            f"load_config: {str(p)!r} has no config.json, so it is not a Hugging Face model "
            "directory. Fix: pass the directory written by save_pretrained (the one holding "
            "config.json and *.safetensors)"
        )
    try:
        return AutoConfig.from_pretrained(p, local_files_only=True)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"load_config: cannot read {str(p / 'config.json')!r}: {err}") from err


def load_policy(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Load a causal LM (``AutoModelForCausalLM``) from a local directory.

    On the "meta" device it is :func:`policy_shell`: shapes, names and dtypes,
    no weights read. Raises :class:`ModelLoadError` when ``path`` is not a local
    directory, holds no ``config.json``, or holds a model that is not a causal LM.
    """
    config = load_config(path)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = getattr(config, "architectures", None) or []
        raise ModelLoadError(
            f"load_policy: {str(path)!r} holds a {config.model_type!r} model "
            f"(architectures={archs}), which is not a causal language model. Fix: pass a "
            "decoder-only checkpoint (e.g. Llama, Qwen2/3, Mistral, Gemma, GPT-2)"
        )
    if torch.device(device).type == "meta":
        return policy_shell(path, dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(
        Path(path).expanduser(), config=config, dtype=dtype, local_files_only=True
    )
    return model.to(device)  # type: ignore[arg-type]  # transformers' typing of .to


def policy_shell(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """The causal LM of ``path`` on the "meta" device: its config, parameter
    names, shapes and dtypes, and no weights (no memory)."""
    config = load_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load a tokenizer (``AutoTokenizer``) from a local directory."""
    p = _local_dir(path, "load_tokenizer")
    if not any((p / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"load_tokenizer: {str(p)!r} has none of the tokenizer files {list(_TOKENIZER_FILES)}. "
            "Fix: pass the directory written by tokenizer.save_pretrained, or build one with "
            "sao.models.build_char_tokenizer / train_bpe_tokenizer and save it there"
        )
    try:
        return AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        raise ModelLoadError(
            f"load_tokenizer: {str(p)!r} holds no loadable tokenizer ({err}). Fix: pass the "
            "directory written by tokenizer.save_pretrained (tokenizer.json, "
            "tokenizer_config.json)"
        ) from err


# ---------------------------------------------------------------- device and dtype

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes a run may train in, by config name."""


class DeviceError(ValueError):
    """A device or dtype the config asks for that this machine cannot give."""


def resolve_device(name: str) -> torch.device:
    """``"auto" | "cpu" | "cuda" | "cuda:N"`` -> a ``torch.device`` this machine has."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise DeviceError(
            f"model.device={name!r} is not a device sao trains on; use auto, cpu, cuda or cuda:N"
        )
    if device.type == "cpu":
        return torch.device("cpu")  # "cpu:0" and "cpu" are one device
    if not torch.cuda.is_available():
        raise DeviceError(
            f"model.device={name!r} but no CUDA device is visible (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}); set model.device=cpu"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceError(
            f"model.device={name!r} but only {count} CUDA device(s) are visible "
            f"(cuda:0..cuda:{count - 1}); pick one of them or check CUDA_VISIBLE_DEVICES"
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto" | "float32" | "bfloat16"`` -> a ``torch.dtype`` for ``device``."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise DeviceError(f"model.dtype={name!r} is not supported; use auto, float32 or bfloat16")
    dtype = DTYPES[name]
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError(
            f"model.dtype='bfloat16' but {torch.cuda.get_device_name(device)} has no bfloat16 "
            "support; set model.dtype=float32"
        )
    return dtype
