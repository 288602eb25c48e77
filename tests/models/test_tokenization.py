"""Built tokenizers: ids, chat template, assistant mask, save/reload offline."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sao.models import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

CONVO = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "ok"},
]


def assistant_text(tok, convo):
    out = tok.apply_chat_template(
        convo, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    return tok.decode(ids)


def test_char_tokenizer_ids_and_roundtrip(char_tok):
    # Specials take ids 0..3, <|unk|> is 4, then ' ' (chr 32) is 5, '!' is 6, ...
    assert [char_tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert char_tok.pad_token_id == 0 and char_tok.eos_token == "<|im_end|>"
    assert char_tok.eos_token_id == 3
    assert char_tok("! ")["input_ids"] == [6, 5]
    # 95 printable characters + newline + 5 specials = 101 entries.
    assert len(char_tok) == 101
    text = "Hello, world!\n  x = 3*4 ~ {ok}"
    assert char_tok.decode(char_tok(text)["input_ids"]) == text
    assert char_tok("é")["input_ids"] == [4]  # outside the alphabet -> <|unk|>
    # Special tokens inside text are single ids.
    assert char_tok("<|im_end|>a")["input_ids"] == [3, char_tok.convert_tokens_to_ids("a")]


def test_char_tokenizer_custom_alphabet():
    tok = build_char_tokenizer("abca")  # duplicates ignored: a=5, b=6, c=7
    assert tok("cab")["input_ids"] == [7, 5, 6]
    assert len(tok) == 8
    with pytest.raises(ValueError, match="alphabet"):
        build_char_tokenizer("")


def test_chat_template_render_and_assistant_mask(char_tok):
    text = char_tok.apply_chat_template(CONVO, tokenize=False)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n"
    )
    # Only the replies and their closing eos are marked.
    assert assistant_text(char_tok, CONVO) == "yo<|im_end|>ok<|im_end|>"
    prompt = char_tok.apply_chat_template(CONVO[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_role_is_an_error(char_tok):
    with pytest.raises(Exception, match="unknown chat role narrator"):
        char_tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_bpe_tokenizer_trains_merges_and_roundtrips():
    texts = ["the cat sat on the mat", "what is 2 + 3? it is 5"] * 30
    tok = train_bpe_tokenizer(texts, vocab_size=300)
    assert 260 < len(tok) <= 300
    assert [tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert len(tok("the cat")["input_ids"]) < len("the cat")  # merges happened
    text = "naïve ünïcode 🙂\n<|im_end|>"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte level: nothing is unknown
    assert assistant_text(tok, CONVO) == "yo<|im_end|>ok<|im_end|>"


def test_bpe_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        train_bpe_tokenizer(["a"], vocab_size=100)
    with pytest.raises(TypeError, match="not one string"):
        train_bpe_tokenizer("abc", vocab_size=300)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_save_reload_offline(kind, tmp_path, no_network):
    tok = (
        build_char_tokenizer()
        if kind == "char"
        else train_bpe_tokenizer(["hello there"] * 5, vocab_size=280)
    )
    tok.save_pretrained(tmp_path)
    for again in (load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)):
        assert again.chat_template == CHAT_TEMPLATE
        assert again.eos_token == "<|im_end|>" and again.pad_token == "<|pad|>"
        assert again.apply_chat_template(CONVO) == tok.apply_chat_template(CONVO)
        assert assistant_text(again, CONVO) == "yo<|im_end|>ok<|im_end|>"
