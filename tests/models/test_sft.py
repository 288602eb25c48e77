"""Supervised fine-tuning: assistant-only loss mask, learning, determinism, errors."""

from __future__ import annotations

import math

import pytest
import torch

from sao.models import build_tiny_policy, encode_conversation, sequence_logprobs, sft
from sao.models.sft import _collate, _linear_schedule
from sao.types import Message

HI_YO = (Message("user", "hi"), Message("assistant", "yo"))


def toy_conversations(n=16):
    # The reply is always the sum of two digits: learnable and short.
    out = []
    for i in range(n):
        a, b = i % 5, (i * 3) % 4
        out.append((Message("user", f"{a}+{b}"), Message("assistant", str(a + b))))
    return out


def test_label_mask_on_a_hand_example(char_tok):
    # "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    # tokens: 0 <|im_start|>, 1-4 "user", 5 "\n", 6-7 "hi", 8 <|im_end|>, 9 "\n",
    # 10 <|im_start|>, 11-19 "assistant", 20 "\n", 21 "y", 22 "o", 23 <|im_end|>,
    # 24 "\n"  -> 25 tokens, loss on 21, 22, 23 only.
    enc = encode_conversation(char_tok, HI_YO, max_len=100)
    assert len(enc.token_ids) == 25
    assert [i for i, m in enumerate(enc.loss_mask) if m] == [21, 22, 23]
    assert char_tok.decode([enc.token_ids[i] for i in (21, 22, 23)]) == "yo<|im_end|>"
    # Truncation keeps the prefix: max_len 23 drops the closing eos and "\n".
    cut = encode_conversation(char_tok, HI_YO, max_len=23)
    assert cut.token_ids == enc.token_ids[:23]
    assert [i for i, m in enumerate(cut.loss_mask) if m] == [21, 22]


def test_position_zero_never_carries_loss(char_tok):
    enc = encode_conversation(char_tok, (Message("assistant", "a"),), max_len=100)
    # "<|im_start|>assistant\n" (11 tokens) then "a", <|im_end|>: loss on 11, 12.
    assert [i for i, m in enumerate(enc.loss_mask) if m] == [11, 12]
    assert enc.loss_mask[0] is False


def test_loss_is_the_token_mean_over_assistant_tokens(char_tok, tiny_llama):
    # One batch of two conversations: the SFT loss equals -mean(logp) over the
    # 3 + 2 assistant positions. Both render to 25 tokens: "hi"/"yo" as above, and
    # <|im_start|> user \n 0 + 0 <|im_end|> \n <|im_start|> assistant \n 0 <|im_end|> \n
    # = 1 + 4 + 1 + 3 + 1 + 1 + 1 + 9 + 1 + 1 + 1 + 1 = 25.
    encs = [encode_conversation(char_tok, c, max_len=100) for c in (HI_YO, toy_conversations(1)[0])]
    tokens_BT, attn_BT, loss_BT = _collate(encs, char_tok.pad_token_id, torch.device("cpu"))
    assert int(loss_BT.sum()) == 3 + 2  # "yo<|im_end|>" and "0<|im_end|>"
    with torch.no_grad():
        logp_BT = sequence_logprobs(tiny_llama, tokens_BT, attn_BT)
    expected = float(-(logp_BT[loss_BT]).mean())
    report = sft(
        tiny_llama,
        char_tok,
        [HI_YO, toy_conversations(1)[0]],
        epochs=1,
        lr=1e-9,
        batch_size=2,
        progress=False,
    )
    assert report.steps == 1 and report.loss_tokens == 5 and report.tokens == 25 + 25
    assert report.initial_loss == pytest.approx(expected, rel=1e-5)


def test_sft_reduces_loss_and_is_deterministic(char_tok):
    convos = toy_conversations(16)
    runs = []
    for _ in range(2):
        model = build_tiny_policy(char_tok, size="0.1m", seed=0)
        report = sft(
            model,
            char_tok,
            convos,
            epochs=4,
            lr=3e-3,
            batch_size=8,
            seed=1,
            schedule="constant",
            progress=False,
        )
        runs.append((model, report))
    (m1, r1), (m2, r2) = runs
    # Random init is near uniform: about log(101) = 4.6 nats per token.
    assert r1.initial_loss == pytest.approx(math.log(101), abs=0.5)
    assert r1.final_loss < 0.6 * r1.initial_loss
    assert list(r1.epoch_losses) == sorted(r1.epoch_losses, reverse=True)
    assert r1.steps == 4 * 2 and r1.examples == 16 and r1.skipped == 0
    assert r1.tokens_per_s > 0
    assert r1.epoch_losses == r2.epoch_losses
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_sft_skips_conversations_without_assistant(char_tok, tiny_llama):
    convos = [HI_YO, (Message("user", "no reply"),)]
    report = sft(tiny_llama, char_tok, convos, epochs=1, lr=1e-4, batch_size=4, progress=False)
    assert report.examples == 1 and report.skipped == 1
    with pytest.raises(ValueError, match="none of the 1 conversations has an assistant token"):
        sft(tiny_llama, char_tok, convos[1:], progress=False)


def test_sft_errors_name_the_input(char_tok, tiny_llama):
    bare = char_tok.__class__(tokenizer_object=char_tok.backend_tokenizer, pad_token="<|pad|>")
    with pytest.raises(ValueError, match=r"encode_conversation: the tokenizer .* no chat template"):
        sft(tiny_llama, bare, [HI_YO], progress=False)
    plain = char_tok.__class__(
        tokenizer_object=char_tok.backend_tokenizer,
        pad_token="<|pad|>",
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    with pytest.raises(ValueError, match=r"marks no assistant token.*generation"):
        sft(tiny_llama, plain, [HI_YO], progress=False)
    with pytest.raises(TypeError, match=r"sao\.types\.Message"):
        sft(tiny_llama, char_tok, [[{"role": "user", "content": "x"}]], progress=False)
    for kwargs, name in (
        ({"epochs": 0}, "epochs"),
        ({"lr": -1.0}, "lr"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_len": 0}, "max_len"),
        ({"warmup_frac": 1.0}, "warmup_frac"),
        ({"schedule": "cosine"}, "schedule"),
    ):
        with pytest.raises(ValueError, match=f"sft: {name} must be"):
            sft(tiny_llama, char_tok, [HI_YO], progress=False, **kwargs)


def test_linear_schedule_by_hand():
    # 10 steps, warm-up 20% = 2 steps: 1/2, 2/2, then (10 - s) / 8 down to 1/8.
    f = _linear_schedule(10, 0.2)
    assert [f(s) for s in range(10)] == [
        0.5,
        1.0,
        1.0,
        7 / 8,
        6 / 8,
        5 / 8,
        4 / 8,
        3 / 8,
        2 / 8,
        1 / 8,
    ]
    assert f(10) == 0.0
    assert _linear_schedule(3, 0.0)(0) == 1.0  # at least one warm-up step


def test_schedules_differ_and_are_deterministic(char_tok):
    def run(schedule):
        model = build_tiny_policy(char_tok, size="0.1m", seed=0)
        sft(model, char_tok, [HI_YO] * 8, epochs=2, batch_size=2, schedule=schedule, progress=False)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    linear, constant = run("linear"), run("constant")
    assert torch.equal(linear, run("linear"))
    assert not torch.allclose(linear, constant)
