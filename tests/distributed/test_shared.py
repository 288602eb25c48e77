"""A weight update as arrays in Ray's object store (sao.distributed.shared): the
same bytes back in every dtype, and mapped read-only from the store rather than
copied into the worker."""

from __future__ import annotations

import pytest
import torch

from sao.distributed.shared import SharedState, from_shared, to_shared


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "half": torch.randn(7, generator=g).to(torch.float16),
        "ids": torch.arange(-3, 9, dtype=torch.int64).reshape(2, 6),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(5, 3, generator=g).t(),  # not contiguous
        "grad": torch.randn(2, 2, generator=g, requires_grad=True),
    }


def test_every_dtype_comes_back_bit_for_bit() -> None:
    state = _state()
    back = from_shared(to_shared(state))
    assert list(back) == list(state)
    for name, t in state.items():
        got = back[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t.detach()), name


def test_a_contiguous_tensor_is_not_copied_on_the_way_out() -> None:
    """Ray copies the arrays once, into the store; packing them copies nothing."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    packed = to_shared({"t": t})
    assert packed.arrays["t"].nbytes == 48 and packed.arrays["t"].dtype.itemsize == 1
    t[0, 0] = 99.0
    assert from_shared(packed)["t"][0, 0] == 99.0


def test_a_state_dict_of_tensors_passes_through() -> None:
    state = {"w": torch.ones(2)}
    assert from_shared(state) is state


@pytest.mark.timeout(120)
def test_through_the_object_store_a_worker_maps_the_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Resolved from the store, the arrays are read-only views of its shared memory
    (Ray's zero-copy path for numpy), not a private unpickled copy; an engine
    copies from them as from any tensor."""
    import ray

    # as sao starts its clusters: without it, Ray turns on token authentication and
    # writes ~/.ray/auth_token, which a cluster another test starts meanwhile then reads
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")

    from sao.rollout.embedded.engine import TorchEngine
    from tests.rollout.embedded.test_engine import build

    new = build("llama", seed=1)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        got = ray.get(ray.put(to_shared(new.state_dict())))
        assert isinstance(got, SharedState)
        assert not any(a.flags.writeable for a in got.arrays.values())
        with TorchEngine(build("llama", seed=0), max_seq_len=16) as engine:
            engine.load_weights(from_shared(got), 1)
            weights = dict(engine._model.state_dict())
        for name, t in new.state_dict().items():
            assert torch.equal(weights[name], t), name
    finally:
        ray.shutdown()
