"""Shared fixtures: a char tokenizer, tiny models of each supported layout,
and a guard that fails any network access."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
import torch
import transformers as tf
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from sao.models import build_char_tokenizer, build_tiny_policy

V = 64  # vocabulary of the architecture fixtures
_SMALL = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2)
_HEADS = dict(num_attention_heads=2, num_key_value_heads=1)

ARCH_CONFIGS: dict[str, Callable[[], tf.PretrainedConfig]] = {
    "llama": lambda: tf.LlamaConfig(**_SMALL, **_HEADS),
    "qwen2": lambda: tf.Qwen2Config(**_SMALL, **_HEADS),
    "qwen3": lambda: tf.Qwen3Config(**_SMALL, **_HEADS, head_dim=8),
    "mistral": lambda: tf.MistralConfig(**_SMALL, **_HEADS),
    "gemma": lambda: tf.GemmaConfig(**_SMALL, **_HEADS, head_dim=8),
    "gemma2": lambda: tf.Gemma2Config(**_SMALL, **_HEADS, head_dim=8),
    "gemma3": lambda: tf.Gemma3TextConfig(**_SMALL, **_HEADS, head_dim=8),
    "gpt2": lambda: tf.GPT2Config(
        vocab_size=V,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**_SMALL, num_attention_heads=2),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(
        **_SMALL,
        **_HEADS,
        head_dim=8,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
    ),
}


def make_arch_model(arch: str, seed: int = 0) -> PreTrainedModel:
    """A random tiny model of ``arch`` in eval mode (dropout off)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(ARCH_CONFIGS[arch]())
    return model.eval()


@pytest.fixture(scope="session")
def char_tok() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


@pytest.fixture()
def tiny_llama(char_tok: PreTrainedTokenizerFast) -> PreTrainedModel:
    return build_tiny_policy(char_tok, arch="llama", size="0.1m", seed=0)


@pytest.fixture()
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any socket connection raises; the hub is told to stay offline."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
