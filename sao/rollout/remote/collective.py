"""Weight transfer by collective broadcast: the trainer is rank 0 of a process
group whose other ranks are the inference servers' workers; every new
version is broadcast tensor by tensor (NCCL between GPUs, gloo on CPU),
without touching a filesystem.

The group is built the way SGLang builds its weight-update group (torch's
TCP rendezvous at ``master_address:master_port``, a ``PrefixStore`` named
after the group, ``_new_process_group_helper``), so the trainer's end joins
an SGLang server's ``/init_weights_update_group`` as well as a ``sao serve``
server's ``/init_weight_transfer_engine``. It lives beside any default
process group (FSDP's), never replacing it.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "WeightGroup",
    "describe",
    "init_weight_group",
    "meta_state",
    "receive_tensors",
    "send_tensors",
]

_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.bfloat16, torch.float16)}
_names = itertools.count()


def init_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join (or, as rank 0, host) the weight-transfer group; blocks until all
    ``world_size`` ranks have joined."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    init = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(init, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,  # type: ignore[arg-type]  # a str, as SGLang passes it
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _from_trainer() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


def send_tensors(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Broadcast ``tensors`` in order from rank 0 (the trainer)."""
    for t in tensors:
        group.broadcast([t.contiguous()], _from_trainer()).wait()


def receive_tensors(
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group: dist.ProcessGroup,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Receive the tensors rank 0 broadcasts, in order (a server's end)."""
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in zip(names, dtype_names, shapes, strict=True):
        if dtype not in _DTYPES:
            raise ValueError(f"weight {name!r}: unsupported dtype {dtype!r}")
        t = torch.empty(tuple(shape), dtype=_DTYPES[dtype], device=device)
        group.broadcast([t], _from_trainer()).wait()
        out[name] = t
    return out


@dataclass
class WeightGroup:
    """The trainer's end of a weight-transfer group with ``world_size - 1``
    server ranks. ``backend``: ``nccl`` (GPU) or ``gloo`` (CPU; tensors are
    sent from host memory)."""

    master_address: str
    master_port: int
    world_size: int
    backend: str = "gloo"
    group_name: str = field(default_factory=lambda: f"sao_weights_{next(_names)}")
    timeout_s: float = 600.0
    pg: dist.ProcessGroup | None = None

    def open(self) -> None:
        """Host the group as rank 0 (blocks until every server rank joined)."""
        self.pg = init_weight_group(
            self.backend,
            self.master_address,
            self.master_port,
            self.world_size,
            0,
            self.group_name,
            self.timeout_s,
        )

    def tensors(self, state_dict: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The tensors to send, on the device the backend sends from."""
        device = "cpu" if self.backend == "gloo" else None
        return [t.detach().to(device) if device else t.detach() for t in state_dict.values()]

    def send(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        if self.pg is None:
            raise RuntimeError("WeightGroup.send before open(): the servers have not joined")
        send_tensors(self.tensors(state_dict), self.pg)


def meta_state(info: Mapping[str, Sequence[object]]) -> dict[str, torch.Tensor]:
    """Meta tensors with :func:`describe`'s names, dtypes and shapes: what a
    receiving end needs of a state dict another process sends."""
    return {
        str(name): torch.empty(tuple(shape), dtype=_DTYPES[str(dtype)], device="meta")  # type: ignore[arg-type]
        for name, dtype, shape in zip(
            info["names"], info["dtype_names"], info["shapes"], strict=True
        )
    }


def describe(state_dict: Mapping[str, torch.Tensor]) -> dict[str, list[object]]:
    """Names, dtype names and shapes, as the servers' update routes take them."""
    return {
        "names": list(state_dict),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in state_dict.values()],
        "shapes": [list(t.shape) for t in state_dict.values()],
    }
