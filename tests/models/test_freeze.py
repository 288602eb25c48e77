"""freeze_attention on every supported layout, and the critic's optimizer step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sao.models import FREEZE_GROUPS, ValueModel, classify_parameter, freeze_attention
from tests.models.conftest import ARCH_CONFIGS, make_arch_model

# Substrings that must be frozen / must stay trainable, per layout.
ATTENTION_NAMES = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "input_layernorm"],
    "qwen2": ["q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj", "input_layernorm"],
    "qwen3": ["q_proj", "q_norm", "k_norm", "input_layernorm"],
    "mistral": ["q_proj", "o_proj", "input_layernorm"],
    "gemma": ["q_proj", "o_proj", "input_layernorm"],
    "gemma2": ["q_proj", "input_layernorm", "post_attention_layernorm"],
    "gemma3": ["q_proj", "q_norm", "input_layernorm", "post_attention_layernorm"],
    "gpt2": ["attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj", "ln_1"],
    "gpt_neox": ["attention.query_key_value", "attention.dense", "input_layernorm"],
    "qwen3_moe": ["q_proj", "k_norm", "input_layernorm"],
}
TRAINABLE_NAMES = {
    "llama": ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"],
    "qwen2": ["mlp.down_proj", "post_attention_layernorm"],
    "qwen3": ["mlp.down_proj", "post_attention_layernorm"],
    "mistral": ["mlp.down_proj", "post_attention_layernorm"],
    "gemma": ["mlp.down_proj", "post_attention_layernorm"],
    "gemma2": ["mlp.down_proj", "pre_feedforward_layernorm", "post_feedforward_layernorm"],
    "gemma3": ["mlp.down_proj", "pre_feedforward_layernorm", "post_feedforward_layernorm"],
    "gpt2": ["mlp.c_fc", "mlp.c_proj", "ln_2", "ln_f", "wte", "wpe"],
    "gpt_neox": ["mlp.dense_h_to_4h", "post_attention_layernorm", "final_layer_norm"],
    "qwen3_moe": ["mlp.experts", "mlp.gate", "post_attention_layernorm"],
}


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_freeze_each_layout(arch):
    critic = ValueModel.from_policy(make_arch_model(arch))
    report = freeze_attention(critic)
    params = dict(critic.named_parameters())
    frozen = {n for n, p in params.items() if not p.requires_grad}
    assert frozen == set(report.frozen_names)
    for sub in ATTENTION_NAMES[arch]:
        hits = [n for n in params if sub in n]
        assert hits, f"{arch}: no parameter named like {sub}"
        assert all(n in frozen for n in hits), f"{arch}: {sub} not frozen"
    for sub in TRAINABLE_NAMES[arch]:
        hits = [n for n in params if sub in n]
        assert hits, f"{arch}: no parameter named like {sub}"
        assert not any(n in frozen for n in hits), f"{arch}: {sub} frozen"
    assert params["value_head.weight"].requires_grad
    # Counts: every element is accounted for exactly once; the groups that
    # must train did not lose any element.
    total = sum(p.numel() for p in params.values())
    assert report.num_frozen + report.num_trainable == total
    assert report.frozen["attention"] > 0 and report.frozen["attention_norm"] > 0
    for group in ("mlp", "embeddings", "final_norm", "head"):
        assert report.frozen[group] == 0 and report.trainable[group] > 0, group
    assert report.trainable["head"] == critic.value_head.weight.numel() + 1
    assert set(report.frozen) == set(FREEZE_GROUPS)


def test_freeze_is_idempotent_and_works_on_a_policy():
    model = make_arch_model("llama")
    first = freeze_attention(model)
    second = freeze_attention(model)
    assert first == second
    # The policy's tied/untied LM head counts as "head" and stays trainable.
    assert first.trainable["head"] == model.lm_head.weight.numel()


def test_frozen_params_bit_identical_after_optimizer_step():
    critic = ValueModel.from_policy(make_arch_model("qwen3"))
    freeze_attention(critic)  # before the optimizer is built
    opt = torch.optim.AdamW(
        [p for p in critic.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    tokens_BT = torch.randint(0, 64, (2, 6))
    mask_BT = torch.ones(2, 6, dtype=torch.bool)
    returns_BT = torch.ones(2, 6)
    for _ in range(2):  # K = 2 critic steps
        loss = ((critic(tokens_BT, mask_BT) - returns_BT) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    for n, p in critic.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p, before[n]), f"trainable {n} did not change"
        else:
            assert torch.equal(p, before[n]), f"frozen {n} changed"
            assert p.grad is None


class _MambaLikeLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = nn.Linear(4, 4)
        self.ffn = nn.Linear(4, 4)


class _MambaLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_MambaLikeLayer(), _MambaLikeLayer()])


def test_unknown_architecture_names_the_layout():
    model = _MambaLike()
    with pytest.raises(
        ValueError,
        match=r"first layer layers\.0 \(_MambaLikeLayer\) has children "
        r"\['mixer', 'ffn'\]",
    ):
        freeze_attention(model)
    assert all(p.requires_grad for p in model.parameters())  # nothing half-frozen


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("model.layers.0.self_attn.q_proj.weight", "attention"),
        ("model.layers.3.input_layernorm.weight", "attention_norm"),
        ("model.layers.3.post_attention_layernorm.weight", "mlp"),
        ("model.layers.0.mlp.experts.0.down_proj.weight", "mlp"),
        ("model.embed_tokens.weight", "embeddings"),
        ("model.norm.weight", "final_norm"),
        ("lm_head.weight", "head"),
        ("transformer.h.1.attn.c_proj.bias", "attention"),
        ("transformer.h.1.mlp.c_proj.bias", "mlp"),
        ("transformer.ln_f.weight", "final_norm"),
        ("model.layers.0.some_new_thing.weight", "other"),
    ],
)
def test_classify_parameter(name, group):
    assert classify_parameter(name) == group


def test_sandwich_norm_needs_the_marker_module():
    # Gemma 2/3 layers have pre_feedforward_layernorm: their post-attention norm
    # normalises the attention output and is frozen with attention.
    name = "model.layers.0.post_attention_layernorm.weight"
    marker = frozenset({"model.layers.0.pre_feedforward_layernorm"})
    assert classify_parameter(name, marker) == "attention_norm"
    assert classify_parameter(name, frozenset()) == "mlp"
