"""Weight sources: how a new policy version reaches the rollout engines.

Every source carries its ``version``; an engine applies it and tags every
token sampled afterwards with that version.

- :class:`TensorWeights`: in-process tensors (the embedded engine in the
  trainer's process). Nothing is copied until the engine copies them in.
- :class:`DiskWeights`: a directory of safetensors files in Hugging Face
  layout, written atomically by the trainer (:func:`write_weights`), that any
  server (``sao serve``, vLLM, SGLang) on any machine sharing the filesystem
  reloads from.
- :class:`BroadcastWeights`: tensors broadcast by the trainer over a
  weight-transfer process group the servers joined
  (:class:`~sao.rollout.remote.collective.WeightGroup`: NCCL on GPU, gloo on CPU),
  for ``sao serve`` and SGLang; no filesystem involved.

The directory layout of :func:`write_weights` is ``ROOT/v00000012/`` holding
``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards with a
``model.safetensors.index.json``), ``config.json`` when a config is given, and
``sao_weights.json`` (``{"version": 12, "names": [...]}``). It is written to a
temporary sibling and renamed, so a reader never sees a half-written version.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "BroadcastWeights",
    "DiskWeights",
    "TensorWeights",
    "WeightSource",
    "merge_adapter",
    "prune_versions",
    "read_weights",
    "version_dir",
    "write_weights",
]

MAX_SHARD_BYTES = 4 * 1024**3
"""Largest safetensors shard :func:`write_weights` writes (Hugging Face uses 5 GB)."""
META_FILE = "sao_weights.json"


@dataclass(frozen=True)
class TensorWeights:
    """In-process tensors, keyed by the model's ``state_dict`` names."""

    state_dict: Mapping[str, torch.Tensor]
    version: int


@dataclass(frozen=True)
class DiskWeights:
    """A complete weight directory written by :func:`write_weights`, or with
    ``peft`` a LoRA adapter in peft's format for the served base model
    (:func:`sao.models.lora.write_adapter`: vLLM loads it through its LoRA routes)."""

    path: Path
    version: int
    peft: bool = False


@dataclass(frozen=True)
class BroadcastWeights:
    """Tensors the trainer broadcasts over ``group`` (a joined
    :class:`~sao.rollout.remote.collective.WeightGroup`) as version ``version``.
    ``send``: this process is the trainer's end and sends while the engines
    receive; False when another process sends (a Ray trainer rank): then
    ``state_dict`` only describes the tensors (names, dtypes, shapes; meta
    tensors will do). ``adapter``: the tensors are LoRA factors, merged by the
    receiving server (as :func:`write_weights`' ``adapter``)."""

    state_dict: Mapping[str, torch.Tensor]
    version: int
    group: object
    send: bool = True
    adapter: Mapping[str, object] | None = None


WeightSource = TensorWeights | DiskWeights | BroadcastWeights


def _unique(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Drop aliases (tied weights share storage; safetensors refuses to write
    them twice). Returns the tensors to write and the names left out."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    out: dict[str, torch.Tensor] = {}
    aliases: list[str] = []
    for name, tensor in state_dict.items():
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
        if t.numel() and key in seen:
            aliases.append(name)
            continue
        seen[key] = name
        out[name] = t.to("cpu").contiguous()
    return out, aliases


def write_weights(
    state_dict: Mapping[str, torch.Tensor],
    root: str | os.PathLike[str],
    version: int,
    *,
    config: object | None = None,
    keep: int = 2,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    adapter: Mapping[str, object] | None = None,
) -> DiskWeights:
    """Write ``state_dict`` as version ``version`` under ``root`` atomically.

    ``config`` (a ``PretrainedConfig``) is saved beside the weights, so the
    directory is a loadable model. Older versions beyond the newest ``keep``
    are deleted (a server may still be reading the previous one).
    ``adapter``: the tensors are LoRA factors, not weights
    (:func:`sao.models.lora.adapter_update`: ``<module>.lora_A`` and
    ``<module>.lora_B``); this describes how to merge them (``scaling`` by module,
    ``fan_in_fan_out``) and goes in ``sao_weights.json`` under ``"adapter"``.
    """
    if keep < 1:
        raise ValueError(f"write_weights: keep must be >= 1, got {keep}")
    root_p = Path(root)
    root_p.mkdir(parents=True, exist_ok=True)
    final = version_dir(root_p, version)
    tmp = root_p / f".v{version:08d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors, aliases = _unique(state_dict)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map |= {name: fname for name in shard}
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": weight_map,
        }
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    if config is not None:
        config.save_pretrained(tmp)  # type: ignore[attr-defined]
    meta: dict[str, object] = {"version": version, "names": list(tensors), "aliases": aliases}
    if adapter is not None:
        meta["adapter"] = dict(adapter)
    (tmp / META_FILE).write_text(json.dumps(meta))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    prune_versions(root_p, keep)
    return DiskWeights(final, version)


def version_dir(root: str | os.PathLike[str], version: int) -> Path:
    """Where version ``version`` lives under a weights directory ``root``."""
    return Path(root) / f"v{version:08d}"


def prune_versions(root: str | os.PathLike[str], keep: int) -> None:
    """Delete all but the newest ``keep`` version directories under ``root``
    (a server may still be reading the previous one)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    versions = sorted(p for p in Path(root).glob("v[0-9]*") if p.is_dir())
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def read_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a weight directory (one file or shards), on the CPU."""
    p = Path(path)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"weight directory {str(p)!r} holds no *.safetensors file; pass a directory "
            "written by sao.rollout.weights.write_weights or save_pretrained"
        )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out |= load_file(str(f))
    return out


def merge_adapter(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool
) -> torch.Tensor:
    """``W + scaling * B @ A`` (transposed for a GPT-2 ``Conv1D`` weight), in
    ``base``'s dtype: what peft's ``get_delta_weight`` adds, in its order of
    operations, so a float32 engine holds bitwise the trainer's merged weight."""
    delta = (b.to(base.device) @ a.to(base.device)) * scaling
    if fan_in_fan_out:
        delta = delta.T
    return base + delta.to(base.dtype)


class MergedAdapter(Mapping[str, torch.Tensor]):
    """``{"<module>.weight": merge_adapter(bases[module], A, B, ...)}`` for every
    module of ``scaling``, each merged when it is read (one module at a time
    in memory). ``tensors``: ``<module>.lora_A`` and ``<module>.lora_B``."""

    def __init__(
        self,
        bases: Mapping[str, torch.Tensor],
        tensors: Mapping[str, torch.Tensor],
        scaling: Mapping[str, float],
        fan_in_fan_out: bool,
    ) -> None:
        self._bases, self._tensors, self._flip = bases, tensors, fan_in_fan_out
        self._scaling = dict(scaling)

    def __getitem__(self, key: str) -> torch.Tensor:
        m = key.removesuffix(".weight")
        a, b = self._tensors[f"{m}.lora_A"], self._tensors[f"{m}.lora_B"]
        return merge_adapter(self._bases[m], a, b, self._scaling[m], self._flip)

    def __iter__(self) -> Iterator[str]:
        return (f"{m}.weight" for m in self._scaling)

    def __len__(self) -> int:
        return len(self._scaling)


def weights_adapter(path: str | os.PathLike[str]) -> dict[str, object] | None:
    """How to merge the LoRA factors a directory holds (:func:`write_weights`'s
    ``adapter``); None for a directory of weights."""
    meta = Path(path) / META_FILE
    if not meta.is_file():
        return None
    found = json.loads(meta.read_text()).get("adapter")
    return dict(found) if isinstance(found, dict) else None


def weights_version(path: str | os.PathLike[str]) -> int | None:
    """The version recorded in a directory written by :func:`write_weights`."""
    meta = Path(path) / META_FILE
    if not meta.is_file():
        return None
    return int(json.loads(meta.read_text())["version"])
