"""A trainer step keeps every tensor on the policy's device.

Two audits watch a whole ``Trainer.step`` (forward, backward, optimizer):

- :class:`OneDevice` (a ``TorchDispatchMode``, so it sees every aten op,
  including autograd's and the optimizer's): no op may mix devices, apart from
  the explicit transfers (``.to``, ``copy_``) and 0-dim CPU scalars, which CUDA
  kernels accept. On a GPU this is the real check; on the CPU it only fires
  when something lands on another device (the meta device stands in for one).
- :class:`ImplicitDevice` (a ``TorchFunctionMode``): no tensor factory
  (``torch.zeros``, ``torch.tensor``, ...) called from our code during the step
  may leave its device implicit. On the CPU such a tensor lands on the right
  device by accident; on a GPU it would be on the CPU. ``sao/types.py``'s
  ``collate`` is exempt: it stages the batch on the CPU, and the trainer moves
  it with one ``Batch.to``.

The negative tests put the bugs back and check that each audit catches them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sao.algo.presets import PRESETS, AlgoPreset
from sao.config import ConfigError, validate
from sao.models.freeze import freeze_attention
from sao.models.loading import DeviceError, resolve_device, resolve_dtype
from sao.models.logprobs import sequence_logprobs
from sao.models.tiny import build_tiny_policy
from sao.models.value import ValueModel
from sao.train.estimators import Stats
from sao.train.trainer import OptimSettings, Trainer
from sao.types import Batch, Trajectory
from tests.train.test_presets_step import TOK, A, B, two_turn

aten = torch.ops.aten
TRANSFERS = {aten._to_copy, aten.copy_, aten._copy_from, aten._copy_from_and_resize}
FACTORIES = {
    torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.tensor,
    torch.as_tensor, torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye,
}  # fmt: skip
LIBRARIES = ("/torch/", "/transformers/")  # their factories are theirs to place
EXEMPT = (str(Path("sao") / "types.py"),)  # collate: CPU staging, then one Batch.to


class DeviceMismatch(AssertionError):
    """An op mixed devices (or a factory left its device implicit)."""


def _caller() -> str:
    """``file:line`` of the first frame outside torch that called the factory."""
    frame = sys._getframe(2)  # 0: here, 1: __torch_function__
    while frame is not None and "/torch/" in frame.f_code.co_filename:
        frame = frame.f_back  # type: ignore[assignment]
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class OneDevice(TorchDispatchMode):
    """Raise on any aten op whose tensors (inputs and outputs) are on more than
    one device; 0-dim CPU tensors and explicit transfers are allowed."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.devices: set[torch.device] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        self._check(func, tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        self._check(func, tree_leaves((args, kwargs, out)))
        return out

    def _check(self, func: Any, leaves: list[Any]) -> None:
        if func.overloadpacket in TRANSFERS:
            return
        devices = {
            t.device
            for t in leaves
            if isinstance(t, torch.Tensor) and not (t.ndim == 0 and t.device.type == "cpu")
        }
        self.ops += 1
        self.devices |= devices
        if len(devices) > 1:
            raise DeviceMismatch(f"{func} mixes devices {sorted(map(str, devices))}")


class ImplicitDevice(TorchFunctionMode):
    """Raise on a tensor factory without ``device=`` called from our code
    (anything but torch, transformers and :data:`EXEMPT`)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            data_is_tensor = func is torch.as_tensor and isinstance(args[0], torch.Tensor)
            where = _caller()
            ours = not any(s in where for s in LIBRARIES) and not any(e in where for e in EXEMPT)
            if ours and not data_is_tensor:
                raise DeviceMismatch(
                    f"torch.{func.__name__} without device= at {where}: it lands on the CPU "
                    "whatever the model's device"
                )
        return func(*args, **kwargs)


@contextmanager
def audited() -> Iterator[OneDevice]:
    with ImplicitDevice(), OneDevice() as mode:
        yield mode


# ------------------------------------------------------------------ fixtures


def small(name: str) -> AlgoPreset:
    algo = PRESETS[name]
    algo = algo.with_(group_size=2) if algo.group_size > 1 else algo
    if algo.advantage == "running_mean":
        algo = algo.with_(running_mean_per_prompt=False)
    return algo


def make_trainer(
    name: str, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Trainer, list[Trajectory]]:
    """A 0.1M-parameter policy (and critic) and a batch of two groups of two."""
    algo = small(name)
    policy = build_tiny_policy(TOK, size="0.1m", seed=0)
    batch = [
        two_turn(policy, A, 1.0, "g0"),
        two_turn(policy, B, 0.0, "g0"),
        two_turn(policy, A, 1.0, "g1"),
        two_turn(policy, B, 0.0, "g1"),
    ]
    policy = policy.to(device=device, dtype=dtype)
    critic = None
    if algo.use_critic:
        critic = ValueModel.from_policy(policy)
        if algo.freeze_critic_attention:
            freeze_attention(critic)  # as build_parts does, before the optimizer
    settings = OptimSettings(actor_lr=1e-2, critic_lr=1e-2, token_budget=16)  # 2+ micro-batches
    return Trainer(policy, critic, algo, settings), batch


def check_stats(stats: dict[str, torch.Tensor]) -> None:
    assert stats and all(v.device.type == "cpu" for v in stats.values())
    for k, v in stats.items():
        assert torch.isfinite(v).all() or k.endswith("explained_variance"), k


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_step_keeps_every_tensor_on_the_model_device(name: str) -> None:
    trainer, batch = make_trainer(name)
    with audited() as mode:
        for _ in range(2):
            stats = trainer.step(batch)
    check_stats(stats)
    assert mode.ops > 1000 and mode.devices == {torch.device("cpu")}


Patch = Callable[[pytest.MonkeyPatch], None]


def _values_buffer(mp: pytest.MonkeyPatch, buffer: Callable[[torch.Size], torch.Tensor]) -> None:
    """The values for GAE (from the first critic update's forward) are handed on
    through a buffer that ``buffer`` builds."""
    first = Trainer.first_critic_update

    def first_critic_update(self: Trainer, batch: Batch) -> tuple[torch.Tensor, Stats]:
        values_BT, stats = first(self, batch)
        out = buffer(values_BT.shape)
        out[:] = values_BT
        return out, stats

    mp.setattr(Trainer, "first_critic_update", first_critic_update)


def values_on_meta(mp: pytest.MonkeyPatch) -> None:
    """The values' buffer is built on another device (meta stands in for it)."""
    _values_buffer(mp, lambda shape: torch.zeros(shape, device="meta"))


def values_implicit_cpu(mp: pytest.MonkeyPatch) -> None:
    """The values' buffer is built without device= (CPU whatever the model's)."""
    _values_buffer(mp, lambda shape: torch.zeros(shape, dtype=torch.float32))


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (values_on_meta, "mixes devices"),
        (values_implicit_cpu, "torch.zeros without device= at .*test_device.py"),
    ],
    ids=["buffer-on-another-device", "buffer-device-implicit"],
)
def test_audits_catch_a_tensor_on_the_wrong_device(
    monkeypatch: pytest.MonkeyPatch, patch: Patch, message: str
) -> None:
    trainer, batch = make_trainer("sao")
    patch(monkeypatch)
    with pytest.raises(DeviceMismatch, match=message), audited():
        trainer.step(batch)


def test_step_trains_in_bfloat16_with_float32_masters() -> None:
    """A bf16 model (on the CPU here) trains: AdamW steps float32 masters, whose
    updates reach the bf16 weights; log-probs and values are float32."""
    trainer, batch = make_trainer("sao", dtype=torch.bfloat16)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    with audited():
        stats = trainer.step(batch)
    check_stats(stats)
    assert all(m.dtype == torch.float32 for m in trainer.actor_weights.params)
    assert all(p.dtype == torch.bfloat16 for p in trainer.policy.parameters())
    assert all(p.grad is None for p in trainer.policy.parameters())  # moved onto the masters
    assert any(
        not torch.equal(a, p) for a, p in zip(before, trainer.policy.parameters(), strict=True)
    )
    prepared = trainer.prepare(batch)
    assert trainer.values(prepared).dtype == torch.float32  # type: ignore[union-attr]
    logp = sequence_logprobs(trainer.policy, prepared.tokens_BT, prepared.attention_mask_BT)
    assert logp.dtype == torch.float32


def test_device_and_dtype_names_resolve_or_say_what_to_set() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_device("cpu") == cpu
    assert resolve_device("auto") == (cuda if torch.cuda.is_available() else cpu)
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(DeviceError, match="use auto, cpu, cuda or cuda:N"):
        resolve_device("meta")
    with pytest.raises(ConfigError, match=r"model\.device: .*'meta' is not a device"):
        validate({"model": {"device": "meta"}})
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match=r"no CUDA device is visible.*model\.device=cpu"):
            resolve_device("cuda:1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["sao", "grpo"])
def test_two_steps_on_cuda_in_bfloat16(name: str) -> None:
    trainer, batch = make_trainer(name, device="cuda", dtype=torch.bfloat16)
    with audited() as mode:
        for _ in range(2):
            stats = trainer.step(batch)
    check_stats(stats)
    # collate's staging ops ran on the CPU (alone), everything else on the GPU
    assert {d.type for d in mode.devices} == {"cpu", "cuda"}
    assert all(p.device.type == "cuda" for p in trainer.policy.parameters())
