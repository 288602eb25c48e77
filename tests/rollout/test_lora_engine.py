"""A LoRA policy and the embedded engine agree token for token: the engine
holds a merged plain copy, and each update sends only the adapted modules'
merged weights (``published_state``), applied in place between decode steps."""

from __future__ import annotations

import asyncio

import pytest
import torch

from sao.models.lora import add_lora, engine_model, published_state
from sao.rollout import check_logprobs
from sao.rollout.check import LOGPROB_BUDGETS
from sao.types import SamplingParams
from tests.rollout.test_check import LIMITS, envs, tiny_llama

FLOAT32 = LOGPROB_BUDGETS["float32"][0]


def _train_a_little(model: torch.nn.Module, seed: int) -> None:
    """Move every adapter as a few optimizer steps would (B starts at 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


def test_lora_policy_matches_the_engine_before_and_after_updates(chatml_tok):
    torch_engine = pytest.importorskip("sao.rollout.embedded.engine")
    model = tiny_llama(len(chatml_tok))
    add_lora(model, rank=4, alpha=8.0)
    sampling = SamplingParams(temperature=0.9, max_new_tokens=6)
    adapted = sum(p.numel() for n, p in model.named_parameters() if n.endswith("base_layer.weight"))

    async def check(engine: object, version: int) -> float:
        report = await check_logprobs(
            engine, model, chatml_tok, envs(), sampling, LIMITS, model_version=version
        )
        assert report.num_tokens > 0 and report.notes == ()
        report.check(FLOAT32)
        return report.max_abs_delta

    with torch_engine.TorchEngine(
        engine_model(model), max_batch_size=4, max_seq_len=96, tokenizer=chatml_tok
    ) as engine:
        asyncio.run(check(engine, 0))
        before = {k: v.clone() for k, v in engine._model.state_dict().items()}
        for version in (1, 2):
            _train_a_little(model, seed=version)
            sent = published_state(model)
            engine.load_weights(sent, version)
            assert engine.version == version
            asyncio.run(check(engine, version))
        after = engine._model.state_dict()
        moved = {k for k in after if not torch.equal(after[k], before[k])}
        assert moved == set(sent)  # only the adapted modules changed in the engine
        assert sum(t.numel() for t in sent.values()) == adapted  # no embedding, no norm


def test_an_update_merges_each_adapted_module_once(chatml_tok, monkeypatch):
    """The engine checks the lazy mapping's shapes without reading its tensors,
    so each merged module is computed once per update (it was twice: the shape
    check, then the copy)."""
    torch_engine = pytest.importorskip("sao.rollout.embedded.engine")
    from sao.models.lora import MergedWeights

    model = tiny_llama(len(chatml_tok))
    add_lora(model, rank=4, alpha=8.0)
    _train_a_little(model, seed=1)
    reads: list[str] = []
    merged = MergedWeights.__getitem__
    monkeypatch.setattr(
        MergedWeights, "__getitem__", lambda self, key: reads.append(key) or merged(self, key)
    )
    sent = published_state(model)
    with torch_engine.TorchEngine(
        engine_model(model), max_batch_size=4, max_seq_len=96, tokenizer=chatml_tok
    ) as engine:
        engine.load_weights(sent, 1)
        held = engine._model.state_dict()
    assert sorted(reads) == sorted(sent)  # every module once
    for key in sent:
        assert torch.equal(held[key], merged(sent, key))
    wrong = MergedWeights(model)
    wrong.shapes = {k: (1, 1) for k in wrong.shapes}
    with (
        torch_engine.TorchEngine(
            engine_model(model), max_batch_size=4, max_seq_len=96, tokenizer=chatml_tok
        ) as engine,
        pytest.raises(ValueError, match=r"has shape \(1, 1\)"),
    ):
        engine.load_weights(wrong, 1)


def test_engine_merges_adapters_itself_bitwise_as_the_trainer_does(chatml_tok):
    """``load_adapter`` (what ``sao serve`` does with an adapter directory): the
    engine keeps the adapted modules' base weights and merges the factors it is
    sent; its weights equal the trainer's merged ones bit for bit (float32)."""
    torch_engine = pytest.importorskip("sao.rollout.embedded.engine")
    from sao.models.lora import adapter_update, merged_weights

    model = tiny_llama(len(chatml_tok))
    add_lora(model, rank=4, alpha=8.0, targets=["q_proj", "v_proj", "down_proj"])
    sampling = SamplingParams(temperature=0.9, max_new_tokens=6)
    with torch_engine.TorchEngine(
        engine_model(model), max_batch_size=4, max_seq_len=96, tokenizer=chatml_tok
    ) as engine:
        for version in (1, 2):
            _train_a_little(model, seed=version)
            tensors, adapter = adapter_update(model)
            assert set(tensors) == {f"{m}.lora_{x}" for m in adapter["scaling"] for x in "AB"}
            engine.load_adapter(tensors, adapter, version)
            held = engine._model.state_dict()
            for name, want in merged_weights(model).items():
                assert torch.equal(held[name], want), name
            report = asyncio.run(
                check_logprobs(
                    engine, model, chatml_tok, envs(), sampling, LIMITS, model_version=version
                )
            )
            report.check(FLOAT32)
        # a full update replaces a base weight: the next adapter update has no base for it
        fresh = tiny_llama(len(chatml_tok))
        name = "model.layers.0.mlp.gate_proj.weight"  # not adapted: fine
        engine.load_weights({name: fresh.state_dict()[name]}, 3)
        engine.load_adapter(tensors, adapter, 4)
        q = "model.layers.0.self_attn.q_proj"
        engine2 = torch_engine.TorchEngine(
            engine_model(model), max_batch_size=1, max_seq_len=32, tokenizer=chatml_tok
        )
        with engine2:
            engine2.load_weights({f"{q}.weight": fresh.state_dict()[f"{q}.weight"]}, 1)
            with pytest.raises(ValueError, match=f"{q}'s weight was replaced"):
                engine2.load_adapter(tensors, adapter, 2)
