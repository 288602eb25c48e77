"""Tokenizers built in code (no download): a character-level tokenizer and a
byte-level BPE tokenizer trained on given texts, both with ChatML special
tokens and chat template.

The chat template wraps every assistant reply (content plus the closing
``<|im_end|>``) in ``{% generation %}...{% endgeneration %}``, so
``apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)``
marks exactly the tokens a policy must learn to produce. ``<|im_end|>`` is the
eos token: the engine stops on it. Rendered conversation::

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n
    <|im_start|>assistant\\n[...<|im_end|>]\\n       ([...] = assistant mask)
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_ALPHABET",
    "END_OF_TEXT",
    "IM_END",
    "IM_START",
    "PAD",
    "SPECIAL_TOKENS",
    "UNK",
    "build_char_tokenizer",
    "require_chat_template",
    "train_bpe_tokenizer",
]

PAD = "<|pad|>"
END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<|unk|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, END_OF_TEXT, IM_START, IM_END)
"""Special tokens of every built tokenizer, with ids 0..3 in this order."""

DEFAULT_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
"""Printable ASCII (space to ``~``) plus newline."""

MODEL_MAX_LENGTH = 2048

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown chat role ' ~ message['role'] ~ "
    "'; use system, user, assistant or tool') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML with system/user/assistant/tool roles and assistant generation marks."""


def _wrap(tok: Tokenizer, *, unk: str | None) -> PreTrainedTokenizerFast:
    """Wrap a ``tokenizers.Tokenizer`` with the special-token roles and template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=IM_END,
        unk_token=unk,
        additional_special_tokens=[END_OF_TEXT, IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
    )


def build_char_tokenizer(alphabet: str | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one id per character of ``alphabet``.

    Ids: the four :data:`SPECIAL_TOKENS` (0..3), ``<|unk|>`` (4) for any
    character outside the alphabet, then the alphabet's characters in order
    (duplicates ignored). Default alphabet: :data:`DEFAULT_ALPHABET`.
    """
    chars = DEFAULT_ALPHABET if alphabet is None else alphabet
    if not isinstance(chars, str) or not chars:
        raise ValueError(f"alphabet must be a non-empty string, got {alphabet!r}")
    specials = [*SPECIAL_TOKENS, UNK]
    vocab = {s: i for i, s in enumerate(specials)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Every character (newline included) is its own pre-token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return _wrap(tok, unk=UNK)


def train_bpe_tokenizer(texts: Iterable[str], *, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` (GPT-2 style bytes).

    Byte-level means any string encodes (no unknown token). The training
    corpus is ``texts`` plus the chat scaffolding (role names), so role
    headers merge into few tokens. ``vocab_size`` counts the 256 byte symbols
    and the special tokens; the result may be smaller when the corpus has
    fewer merges to offer.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size must be >= {min_size} (256 bytes + {len(SPECIAL_TOKENS)} special "
            f"tokens), got {vocab_size}"
        )
    if isinstance(texts, str):
        raise TypeError("texts must be an iterable of strings, not one string; wrap it: [text]")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    scaffold = [f"{role}\n" for role in ("system", "user", "assistant", "tool")]
    tok.train_from_iterator([*scaffold, *texts], trainer)
    return _wrap(tok, unk=None)


def require_chat_template(tokenizer: PreTrainedTokenizerBase, *, what: str) -> str:
    """Return ``tokenizer.chat_template`` or raise a ValueError naming ``what`` and the fix."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"{what}: the tokenizer ({type(tokenizer).__name__}, "
            f"name_or_path={getattr(tokenizer, 'name_or_path', '')!r}) has no chat template; "
            "set tokenizer.chat_template (e.g. sao.models.CHAT_TEMPLATE, which marks assistant "
            "turns with {% generation %}) or build the tokenizer with "
            "sao.models.build_char_tokenizer / train_bpe_tokenizer"
        )
    return template
