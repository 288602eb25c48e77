"""Tiny policies and the value model: sizes, determinism, save/reload offline."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sao.models import (
    TINY_SIZES,
    ValueModel,
    build_tiny_policy,
    load_policy,
    sequence_logprobs,
    tiny_config,
)
from sao.models.value import HEAD_FILE
from tests.models.conftest import make_arch_model

NOMINAL = {"0.1m": 0.1e6, "0.5m": 0.5e6, "1m": 1e6, "2m": 2e6, "5m": 5e6}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("size", sorted(TINY_SIZES))
def test_tiny_config_sizes(arch, size):
    # Built on the meta device: shapes only, no memory or init cost.
    config = tiny_config(arch, size, vocab_size=101)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n_total = sum(p.numel() for p in model.parameters())  # tied head counted once
    n_embed = 101 * config.hidden_size
    assert n_total - n_embed == TINY_SIZES[size].non_embedding_params(arch)
    # Within 25% of the nominal size (e.g. 1m: 4 * (4*128^2 + 3*128*512 + 256) + 128
    # = 1,049,728 non-embedding parameters).
    assert 0.75 * NOMINAL[size] <= n_total <= 1.25 * NOMINAL[size]
    assert config.tie_word_embeddings and config.max_position_embeddings == 2048


def test_tiny_config_bad_arguments():
    with pytest.raises(ValueError, match="arch must be one of"):
        tiny_config("gpt5", "1m", vocab_size=10)
    with pytest.raises(ValueError, match="size must be one of"):
        tiny_config("llama", "3m", vocab_size=10)
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_config("llama", "1m", vocab_size=0)


def test_build_tiny_policy_is_deterministic_and_keeps_global_rng(char_tok):
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_policy(char_tok, arch="qwen3", size="0.1m", seed=7)
    assert torch.equal(torch.rand(1), expected_next)  # caller's RNG untouched
    b = build_tiny_policy(char_tok, arch="qwen3", size="0.1m", seed=7)
    c = build_tiny_policy(char_tok, arch="qwen3", size="0.1m", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.config.vocab_size == len(char_tok) and a.config.eos_token_id == 3
    assert a.generation_config.eos_token_id == 3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_policy_save_reload_offline(arch, char_tok, tmp_path, no_network):
    model = build_tiny_policy(char_tok, arch=arch, size="0.1m", seed=0)
    model.save_pretrained(tmp_path)
    for again in (load_policy(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path)):
        assert type(again) is type(model)
        ids_BT = torch.tensor([char_tok("abc def")["input_ids"]])
        mask_BT = torch.ones_like(ids_BT, dtype=torch.bool)
        with torch.no_grad():
            torch.testing.assert_close(
                sequence_logprobs(again, ids_BT, mask_BT), sequence_logprobs(model, ids_BT, mask_BT)
            )
        assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()


def test_load_policy_dtype(char_tok, tmp_path):
    build_tiny_policy(char_tok, size="0.1m").save_pretrained(tmp_path)
    assert load_policy(tmp_path, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_value_model_from_policy_copies_and_inits_head(tiny_llama):
    critic = ValueModel.from_policy(tiny_llama, seed=3)
    # A copy of the backbone, not a view of the policy's weights.
    pw = tiny_llama.model.embed_tokens.weight
    cw = critic.backbone.embed_tokens.weight
    assert torch.equal(pw, cw) and pw.data_ptr() != cw.data_ptr()
    # Head: N(0, (1/(64+1))^2) weights -> std ~0.0154, zero bias; same seed, same head.
    assert critic.value_head.bias.item() == 0.0
    assert 0.005 < critic.value_head.weight.std().item() < 0.03
    again = ValueModel.from_policy(tiny_llama, seed=3)
    assert torch.equal(again.value_head.weight, critic.value_head.weight)


def test_value_forward_reads_the_hidden_state_before_each_token(tiny_llama):
    # With head weight 0 and bias 0.5 every real position after a row's first
    # token is 0.5; the first token (no state before it) and padding are 0.
    critic = ValueModel.from_policy(tiny_llama)
    with torch.no_grad():
        critic.value_head.weight.zero_()
        critic.value_head.bias.fill_(0.5)
    tokens_BT = torch.randint(5, 90, (2, 4))
    mask_BT = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    values_BT = critic(tokens_BT, mask_BT)
    assert values_BT.dtype == torch.float32
    expected = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.5, 0.5]])
    torch.testing.assert_close(values_BT, expected)


def test_value_at_t_is_the_head_on_the_hidden_state_at_t_minus_1(tiny_llama):
    # V[t] = head(h[t-1]): the state in which token t was chosen.
    critic = ValueModel.from_policy(tiny_llama)
    tokens_BT = torch.randint(5, 90, (1, 5))
    mask_BT = torch.ones(1, 5, dtype=torch.bool)
    with torch.no_grad():
        hidden = critic.backbone(input_ids=tokens_BT).last_hidden_state
        after = critic.value_head(hidden.float()).squeeze(-1)
        values_BT = critic(tokens_BT, mask_BT)
    torch.testing.assert_close(values_BT[0, 1:], after[0, :-1], rtol=1e-5, atol=1e-6)
    assert values_BT[0, 0] == 0


def test_value_left_right_padding_agree(tiny_llama):
    critic = ValueModel.from_policy(tiny_llama)
    seq = torch.randint(5, 90, (3,))
    right = critic(
        torch.cat([seq, torch.zeros(2, dtype=torch.long)])[None],
        torch.tensor([[1, 1, 1, 0, 0]], dtype=torch.bool),
    )
    left = critic(
        torch.cat([torch.zeros(2, dtype=torch.long), seq])[None],
        torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.bool),
    )
    torch.testing.assert_close(right[0, :3], left[0, 2:], atol=1e-5, rtol=1e-5)


def test_value_model_save_reload_offline(tiny_llama, tmp_path, no_network):
    critic = ValueModel.from_policy(tiny_llama)
    out = critic.save_pretrained(tmp_path / "critic")
    assert (out / HEAD_FILE).is_file() and (out / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
    again = ValueModel.from_pretrained(out)
    tokens_BT = torch.randint(5, 90, (2, 5))
    mask_BT = torch.ones(2, 5, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens_BT, mask_BT), critic(tokens_BT, mask_BT))
    # Saving again over the same directory replaces it.
    with torch.no_grad():
        critic.value_head.bias.fill_(2.0)
    critic.save_pretrained(out)
    assert ValueModel.from_pretrained(out).value_head.bias.item() == 2.0


def test_value_model_from_policy_directory(char_tok, tmp_path, no_network):
    policy = build_tiny_policy(char_tok, arch="qwen3", size="0.1m")
    policy.save_pretrained(tmp_path)
    critic = ValueModel.from_policy(tmp_path)
    assert torch.equal(critic.backbone.norm.weight, policy.model.norm.weight)


def test_value_model_errors(tmp_path, char_tok):
    with pytest.raises(TypeError, match="policy must be"):
        ValueModel.from_policy(42)
    build_tiny_policy(char_tok, size="0.1m").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no value_head\.safetensors"):
        ValueModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="value_head must be Linear"):
        ValueModel(make_arch_model("llama").model, torch.nn.Linear(3, 1))
