"""LoRA through peft: which modules get an adapter, the merged weights worked
by hand, that a merged plain model computes what the adapted one does, the
adapter on disk in peft's own format, and the errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from sao.models.logprobs import sequence_logprobs
from sao.models.lora import (
    adapter_base,
    add_lora,
    engine_model,
    export_policy,
    has_lora,
    load_adapter,
    merged_copy,
    merged_from_state,
    merged_weights,
    plain_state,
    published_state,
    save_adapter,
)
from sao.models.value import ValueModel
from tests.models.conftest import make_arch_model


def _randomize_b(model: nn.Module, seed: int = 1, std: float = 0.2) -> None:
    """As if trained: B is 0 after add_lora (the model is unchanged)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (3, 10), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[2, 7:] = False
    return ids, mask


class Toy(nn.Module):
    """One 2x2 linear layer, nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_merged_weight_by_hand() -> None:
    toy = Toy()
    add_lora(toy, rank=1, alpha=2.0, targets=["proj"])  # scale alpha / r = 2
    layer = toy.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.tensor([[1.0, 2.0]]))  # A: 1 x 2
        layer.lora_B["default"].weight.copy_(torch.tensor([[0.5], [0.0]]))  # B: 2 x 1
    # B @ A = [[0.5, 1], [0, 0]]; W + 2 * B @ A = [[1 + 1, 0 + 2], [0, 1]] = [[2, 2], [0, 1]]
    merged = merged_weights(toy)
    assert list(merged) == ["proj.weight"]
    torch.testing.assert_close(merged["proj.weight"], torch.tensor([[2.0, 2.0], [0.0, 1.0]]))
    # the adapted forward: x = [1, 1] -> W x = [1, 1]; A x = 3; 2 * B * 3 = [3, 0] -> [4, 1]
    out = toy(torch.tensor([[1.0, 1.0]]))
    torch.testing.assert_close(out, torch.tensor([[4.0, 1.0]]))
    plain = merged_copy(toy)
    assert not has_lora(plain) and has_lora(toy)
    assert isinstance(plain.proj, nn.Linear)
    torch.testing.assert_close(plain(torch.tensor([[1.0, 1.0]])), out)


def test_targets_all_linear_leave_the_head_out(tiny_llama: PreTrainedModel) -> None:
    report = add_lora(tiny_llama, rank=2, alpha=4.0)
    leaves = {t.rsplit(".", 1)[-1] for t in report.targets}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    layers = tiny_llama.config.num_hidden_layers
    assert len(report.targets) == 7 * layers
    trained = [n for n, p in tiny_llama.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert (
        report.trainable_params
        == report.adapter_params
        == sum(p.numel() for n, p in tiny_llama.named_parameters() if p.requires_grad)
    )


def test_a_fresh_adapter_changes_nothing(tiny_llama: PreTrainedModel) -> None:
    ids, mask = _batch(tiny_llama.config.vocab_size)
    before = sequence_logprobs(tiny_llama, ids, mask)
    add_lora(tiny_llama, rank=4, alpha=8.0, targets=["q_proj", "v_proj"])
    assert torch.equal(sequence_logprobs(tiny_llama, ids, mask), before)  # B = 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2"])
def test_merged_plain_model_computes_what_the_adapted_one_does(arch: str) -> None:
    model = make_arch_model(arch)
    fresh = make_arch_model(arch)
    add_lora(model, rank=2, alpha=4.0)
    _randomize_b(model)
    ids, mask = _batch(model.config.vocab_size)
    adapted = sequence_logprobs(model, ids, mask)
    assert (adapted - sequence_logprobs(fresh, ids, mask)).abs().max() > 1e-2  # it moved
    # the engine's way: a plain model, updated in place with the merged subset only
    state = published_state(model)
    assert set(state) == {f"{t}.weight" for t in _targets(model)}
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and missing  # embeddings, norms: never sent, never changed
    assert (sequence_logprobs(fresh, ids, mask) - adapted).abs().max() < 1e-5
    assert (sequence_logprobs(engine_model(model), ids, mask) - adapted).abs().max() < 1e-5


def _targets(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if hasattr(m, "lora_A")]


def test_fused_publishing_completes_qkv_and_gate_up(tiny_llama: PreTrainedModel) -> None:
    add_lora(tiny_llama, rank=2, alpha=4.0, targets=["q_proj", "v_proj", "up_proj"])
    plain = published_state(tiny_llama)
    fused = published_state(tiny_llama, fused=True)
    p0 = "model.layers.0."
    assert {k for k in plain if k.startswith(p0)} == {
        p0 + "self_attn.q_proj.weight",
        p0 + "self_attn.v_proj.weight",
        p0 + "mlp.up_proj.weight",
    }
    assert {k for k in fused if k.startswith(p0)} == {
        p0 + "self_attn.q_proj.weight",
        p0 + "self_attn.k_proj.weight",
        p0 + "self_attn.v_proj.weight",
        p0 + "mlp.gate_proj.weight",
        p0 + "mlp.up_proj.weight",
    }
    # the unadapted sibling goes out as it is
    torch.testing.assert_close(
        fused[p0 + "self_attn.k_proj.weight"],
        tiny_llama.model.layers[0].self_attn.k_proj.weight,
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_from_a_gathered_state_the_same_weights_as_from_the_model(
    tmp_path: Path, arch: str
) -> None:
    """A sharded model's parameters are shards: the Ray trainer computes what an
    update sends, what ``final/`` holds and the checkpoint's adapter from the
    gathered state dict. Each is what the model's own functions give (GPT-2's
    Conv1D: weights stored transposed, ``fan_in_fan_out``)."""
    model = make_arch_model(arch)
    add_lora(model, rank=2, alpha=4.0)
    _randomize_b(model)
    gathered = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_weights(model)
    assert merged_from_state(model, gathered).keys() == merged.keys()
    for key, value in merged_from_state(model, gathered).items():
        torch.testing.assert_close(value, merged[key], rtol=0, atol=1e-6)
    for fused in (False, True):
        want, got = (
            published_state(model, fused=fused),
            published_state(model, fused=fused, state=gathered),
        )
        assert set(got) == set(want), fused
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6)
    plain = merged_copy(model).state_dict()
    whole = plain_state(model, gathered)
    assert whole.keys() == plain.keys()
    for key in plain:
        torch.testing.assert_close(whole[key], plain[key], rtol=0, atol=1e-6)
    save_adapter(model, tmp_path / "own")
    save_adapter(model, tmp_path / "gathered", state=gathered)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "own" / name).read_bytes() == (tmp_path / "gathered" / name).read_bytes()


def test_unknown_module_and_too_large_rank_are_errors_naming_what_exists(
    tiny_llama: PreTrainedModel,
) -> None:
    with pytest.raises(ValueError, match=r"unknown target module\(s\) \['qproj'\].*'q_proj'"):
        add_lora(tiny_llama, rank=2, alpha=4.0, targets=["qproj"])
    hidden = tiny_llama.config.hidden_size
    with pytest.raises(ValueError, match=rf"rank {hidden + 1} is larger than .*{hidden}"):
        add_lora(tiny_llama, rank=hidden + 1, alpha=4.0)
    assert not has_lora(tiny_llama)  # nothing half-injected
    with pytest.raises(ValueError, match="attention is frozen"):
        add_lora(tiny_llama, rank=2, alpha=4.0, targets=["q_proj"], skip_attention=True)


def test_adapter_saved_in_peft_format_loads_back_and_in_peft(
    tmp_path: Path, tiny_llama: PreTrainedModel
) -> None:
    from sao.models.loading import load_policy

    base = tmp_path / "base"
    tiny_llama.save_pretrained(base)
    model, reloaded = load_policy(base), load_policy(base)
    add_lora(model, rank=4, alpha=8.0, targets=["q_proj", "down_proj"], seed=0)
    _randomize_b(model)
    ids, mask = _batch(model.config.vocab_size)
    want = sequence_logprobs(model, ids, mask)
    save_adapter(model, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert adapter_base(tmp_path / "adapter") == str(base)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    add_lora(reloaded, rank=4, alpha=8.0, targets=["q_proj", "down_proj"], seed=7)
    load_adapter(reloaded, tmp_path / "adapter", base)
    assert torch.equal(sequence_logprobs(reloaded, ids, mask), want)

    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(load_policy(base), tmp_path / "adapter")
    assert torch.equal(sequence_logprobs(peft_model.base_model.model, ids, mask), want)

    other = load_policy(base)
    add_lora(other, rank=4, alpha=8.0, targets=["q_proj", "down_proj"])
    with pytest.raises(ValueError, match=r"trained on base model .*set model\.path"):
        load_adapter(other, tmp_path / "adapter", tmp_path / "elsewhere")
    wrong_rank = load_policy(base)
    add_lora(wrong_rank, rank=2, alpha=8.0, targets=["q_proj", "down_proj"])
    with pytest.raises(ValueError, match="r=4, the configured LoRA has 2"):
        load_adapter(wrong_rank, tmp_path / "adapter", base)


def test_export_writes_a_merged_model_and_the_adapter(
    tmp_path: Path, tiny_llama: PreTrainedModel
) -> None:
    from sao.models.loading import load_policy

    add_lora(tiny_llama, rank=2, alpha=4.0)
    _randomize_b(tiny_llama)
    export_policy(tiny_llama, tmp_path)
    assert (tmp_path / "config.json").is_file() and (tmp_path / "adapter").is_dir()
    loaded = load_policy(tmp_path)
    assert not has_lora(loaded)
    ids, mask = _batch(tiny_llama.config.vocab_size)
    want = sequence_logprobs(tiny_llama, ids, mask)
    assert (sequence_logprobs(loaded, ids, mask) - want).abs().max() < 1e-5


def test_lora_critic_skips_frozen_attention_and_trains_head_and_final_norm(
    tmp_path: Path, tiny_llama: PreTrainedModel
) -> None:
    base = tmp_path / "base"
    tiny_llama.save_pretrained(base)
    critic = ValueModel.from_policy(base, seed=0)
    report = add_lora(
        critic.backbone, rank=2, alpha=4.0, skip_attention=True, train_final_norm=True
    )
    assert {t.rsplit(".", 1)[-1] for t in report.targets} == {"gate_proj", "up_proj", "down_proj"}
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias", "backbone.norm.weight"} <= trained
    assert all(
        ".lora_" in n or n.startswith("value_head.") or n == "backbone.norm.weight" for n in trained
    )
    assert not any("self_attn" in n for n in trained)
    _randomize_b(critic)
    with torch.no_grad():
        critic.backbone.norm.weight.mul_(1.5)
        critic.value_head.weight.normal_()
    ids, mask = _batch(tiny_llama.config.vocab_size)
    want = critic(ids, mask)
    critic.save_pretrained(tmp_path / "critic")
    assert sorted(p.name for p in (tmp_path / "critic" / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "trained_base.safetensors",
    ]
    again = ValueModel.from_policy(base, seed=3)
    add_lora(again.backbone, rank=2, alpha=4.0, skip_attention=True, train_final_norm=True)
    again.load_lora(tmp_path / "critic", base)
    torch.testing.assert_close(again(ids, mask), want, rtol=0, atol=0)


def test_lora_critic_shares_the_lora_actors_frozen_base(tiny_llama: PreTrainedModel) -> None:
    from sao.models.lora import share_frozen_base

    critic = ValueModel.from_policy(tiny_llama, seed=0)
    add_lora(tiny_llama, rank=2, alpha=4.0)
    add_lora(critic.backbone, rank=2, alpha=4.0, skip_attention=True, train_final_norm=True)
    ids, mask = _batch(tiny_llama.config.vocab_size)
    values = critic(ids, mask)
    own_before = sum(p.numel() * p.element_size() for p in critic.backbone.parameters())
    saved = share_frozen_base(critic.backbone, tiny_llama)
    actor = {id(p) for p in tiny_llama.parameters()}
    shared = [n for n, p in critic.backbone.named_parameters() if id(p) in actor]
    own = [n for n, p in critic.backbone.named_parameters() if id(p) not in actor]
    # everything frozen is shared: embeddings, attention, MLP bases, layer norms
    assert all(".lora_" in n or n == "norm.weight" for n in own), own
    assert "embed_tokens.weight" in shared and "layers.0.self_attn.q_proj.weight" in shared
    assert "layers.0.mlp.up_proj.base_layer.weight" in shared
    assert saved == sum(
        p.numel() * p.element_size() for n, p in critic.backbone.named_parameters() if n in shared
    )
    assert saved > 0.9 * own_before
    assert torch.equal(critic(ids, mask), values)  # the same function
    # a critic step moves its own adapters, never the shared base
    base = {n: p.detach().clone() for n, p in tiny_llama.named_parameters()}
    opt = torch.optim.SGD([p for p in critic.parameters() if p.requires_grad], lr=0.1)
    critic(ids, mask).pow(2).mean().backward()
    opt.step()
    assert all(torch.equal(p, base[n]) for n, p in tiny_llama.named_parameters())
    assert not torch.equal(critic(ids, mask), values)
