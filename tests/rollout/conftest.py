"""Fixtures for the agent-loop tests: a tiny character-level tokenizer with a
ChatML chat template, whose ids are known by hand.

Ids: ``<|pad|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2 (eos), ``<|unk|>`` 3,
then the characters of :data:`CHARS` from 4 in order. :func:`c` maps text to
ids by dictionary lookup, independently of the tokenizer under test.
"""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, IM_START, IM_END, UNK = 0, 1, 2, 3
SPECIALS = ("<|pad|>", "<|im_start|>", "<|im_end|>", "<|unk|>")
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,!?:"
VOCAB = {s: i for i, s in enumerate(SPECIALS)} | {ch: 4 + i for i, ch in enumerate(CHARS)}

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def c(text: str) -> list[int]:
    """Ids of plain characters (no special tokens), by table lookup."""
    return [VOCAB[ch] for ch in text]


def _build(chat_template: str | None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=chat_template,
    )


@pytest.fixture(scope="session")
def chatml_tok() -> PreTrainedTokenizerFast:
    """The character tokenizer with a ChatML chat template."""
    return _build(CHATML)


@pytest.fixture(scope="session")
def plain_tok() -> PreTrainedTokenizerFast:
    """The same tokenizer without a chat template."""
    return _build(None)
