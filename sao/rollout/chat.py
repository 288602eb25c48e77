"""Turning environment observations into token ids for the agent loop.

Token in, token out (ARCHITECTURE.md, contracts): the history is a list of
token ids that only ever grows. The first observation is tokenized once; each
later observation is tokenized once and appended; the policy's own tokens are
the sampled ids, never decoded and re-encoded.

With a chat template, a later observation is tokenized as the text the
template puts *after* the last assistant reply: render the conversation
``[history..., assistant: PLACEHOLDER, new observation messages...]`` with
``add_generation_prompt=True``, every earlier reply also written as the
placeholder, and keep the string after the last one. Placeholders (instead
of the real replies) keep templates that rewrite earlier turns (Qwen3 and
DeepSeek drop an earlier reply's reasoning, Llama and Mistral trim it) from
breaking the split, and make the split independent of what the model wrote.
For a template that renders every turn independently (ChatML) this is exactly
``render(history + new, add_generation_prompt=True)`` minus
``render(history)`` with the assistant's closing text in front. That suffix
starts with the assistant turn's closing text (``<|im_end|>\\n`` in ChatML,
``<|eot_id|>`` in Llama 3, ``</s>`` in Mistral):

- the reply ended with a stop token whose text opens the closing text (the
  engine sampled ``<|im_end|>``; also a special token that ends a reply cut
  by ``max_new_tokens``): that part is already in the history as an action
  token and is removed from the suffix, never duplicated;
- the reply was cut (``max_new_tokens``) or stopped on something else: the
  whole closing text is tokenized as part of the observation, so the history
  still reads as a well-formed conversation; those tokens are not actions.

The template must be *prefix-stable*: appending messages may not change the
text it wrote for the earlier ones (replies aside). Each later observation
checks that ``render(history)`` (placeholders for replies, no generation
prompt) is a prefix of the new rendering; a template that moves text
(Mistral v0.3 puts the system message into the *last* user turn) fails the
episode with the position and both texts. Every message of an observation
must leave its content in the rendering (as is, trimmed, or JSON-escaped): a
template that silently drops a role (e.g. ``tool``) is an error of the
observation, as is one that raises on it.

Without a chat template, observation text is tokenized as is (message
contents joined by newlines) and appended.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from sao.types import CompletionFinish, Message, Observation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "REPLY_PLACEHOLDER",
    "ObservationError",
    "after_reply",
    "cap_observation",
    "decode_reply",
    "encode_first_observation",
    "encode_next_observation",
    "excerpt",
    "first_difference",
    "has_chat_template",
    "observation_suffix",
    "render",
    "split_observation",
    "validate_observation",
]

REPLY_PLACEHOLDER = "SAOREPLYPLACEHOLDER7c1f"
"""Stands in for the last assistant reply when rendering the chat template."""


class ObservationError(ValueError):
    """An environment returned an observation the agent loop cannot use."""


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when ``tokenizer.chat_template`` is a non-empty template."""
    template = getattr(tokenizer, "chat_template", None)
    return bool(template)


def validate_observation(obs: object, *, vocab_size: int, where: str) -> Observation:
    """``obs`` as an :data:`~sao.types.Observation` (lists become tuples), or
    an :class:`ObservationError` naming ``where`` and what was wrong."""
    if isinstance(obs, str):
        return obs
    if isinstance(obs, (tuple, list)):
        items = tuple(obs)
        if all(isinstance(m, Message) for m in items):
            return items  # also the empty tuple: no new message
        if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            bad = [i for i in items if not 0 <= i < vocab_size]
            if bad:
                raise ObservationError(
                    f"{where} returned token ids outside the vocabulary [0, {vocab_size}): "
                    f"{bad[:5]}"
                )
            return items
        kinds = sorted({type(i).__name__ for i in items})
        raise ObservationError(
            f"{where} returned a sequence of {kinds}; an observation is text (str), a tuple "
            "of sao.types.Message, or a tuple of int token ids"
        )
    raise ObservationError(
        f"{where} returned {type(obs).__name__}; an observation is text (str), a tuple of "
        "sao.types.Message, or a tuple of int token ids"
    )


def split_observation(obs: Observation) -> tuple[list[int] | None, tuple[Message, ...]]:
    """``(ids, ())`` for token ids, else ``(None, messages)``: plain text is
    one ``user`` message; messages are kept as they are."""
    if isinstance(obs, str):
        return None, (Message("user", obs),)
    ids = [i for i in obs if isinstance(i, int)]
    if ids:
        return ids, ()
    return None, tuple(m for m in obs if isinstance(m, Message))


TRUNCATION_MARKER = "\n[observation truncated: {n:,} characters not shown]"
"""Appended to an observation's text where it was cut."""
_CHARS_PER_TOKEN = 32
"""A token rarely spans more characters: text is cut to ``32 x cap`` characters
before it is tokenized, so a huge observation is never tokenized whole."""


def cap_observation(
    tokenizer: PreTrainedTokenizerBase, obs: Observation, max_tokens: int
) -> tuple[Observation, int]:
    """``obs`` with at most ``max_tokens`` tokens of content, and how many
    messages (or token-id observations) were cut.

    Text is cut at a token boundary and :data:`TRUNCATION_MARKER` says how
    much is missing; message contents share the budget in order. Token ids
    are cut as they are (an environment that returns ids owns them).
    """
    ids, messages = split_observation(obs)
    if ids is not None:
        return (tuple(ids[:max_tokens]), 1) if len(ids) > max_tokens else (obs, 0)
    left, cut, out = max_tokens, 0, []
    for m in messages:
        text = m.content
        head = text[: left * _CHARS_PER_TOKEN]
        tokens = _encode(tokenizer, head, special=False) if head else []
        if len(head) == len(text) and len(tokens) <= left:
            out.append(m)
            left -= len(tokens)
            continue
        kept = decode_reply(tokenizer, tokens[:left], skip_special_tokens=False) if left else ""
        if not text.startswith(kept):  # a token boundary inside a character: cut the text
            kept = text[: len(kept)]
        out.append(replace(m, content=kept + TRUNCATION_MARKER.format(n=len(text) - len(kept))))
        left, cut = 0, cut + 1
    if not cut:
        return obs, 0
    return (out[0].content if isinstance(obs, str) else tuple(out)), cut


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    where: str,
    generation_prompt: bool = True,
) -> str:
    """The chat template applied to ``messages`` (as text); a template that
    rejects them raises an :class:`ObservationError` naming ``where`` and the roles."""
    try:
        text = tokenizer.apply_chat_template(
            [m.as_dict() for m in messages],
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )
    except Exception as err:  # the template rejects the env's messages (e.g. a role)
        roles = ", ".join(m.role for m in messages)
        raise ObservationError(
            f"{where}: the chat template rejected the messages (roles: {roles}): "
            f"{type(err).__name__}: {err}. Fix: send roles the model's template renders "
            "(e.g. a tool result as Message('user', ...)), or use a template that renders them"
        ) from err
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
    return text


def _shows(text: str, messages: Sequence[Message], *, where: str) -> None:
    """Raise an :class:`ObservationError` when the rendered ``text`` holds no
    trace of a message's content: the template silently dropped it."""
    for m in messages:
        content = m.content.strip()
        if not content or content in text or json.dumps(content, ensure_ascii=False)[1:-1] in text:
            continue
        raise ObservationError(
            f"{where}: the chat template rendered nothing of the {m.role!r} message "
            f"{m.content!r:.80}: it does not render that role. Fix: send it as a role the "
            "template renders (e.g. Message('user', ...)), or use a template that renders it"
        )


def excerpt(text: str, at: int, width: int = 24) -> str:
    """``text`` around character ``at``: ``'before' ▸ 'after'``."""
    return f"{text[max(0, at - width) : at]!r} ▸ {text[at : at + width]!r}"


def first_difference(a: Sequence[object], b: Sequence[object]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length if one
    is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, *, special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special))


def decode_reply(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], *, skip_special_tokens: bool = True
) -> str:
    """The text of sampled ids ``[N]`` (special tokens dropped by default);
    used only to show a reply to the environment, never to re-encode it."""
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
    if not isinstance(text, str):
        raise TypeError(f"tokenizer.decode returned {type(text).__name__}, expected str")
    return text


def encode_first_observation(
    tokenizer: PreTrainedTokenizerBase, obs: Observation
) -> tuple[list[int], list[Message]]:
    """Prompt ids ``[P]`` for the first observation and the chat history it starts.

    Token ids are kept verbatim. With a chat template, messages are rendered
    with ``add_generation_prompt=True`` and the text is tokenized once without
    extra special tokens (the template writes them). Without one, the text
    (message contents joined by newlines) is tokenized with the tokenizer's
    own special tokens (e.g. a BOS).
    """
    ids, messages = split_observation(obs)
    if ids is not None:
        return ids, []
    if not messages:
        raise ObservationError("Env.reset returned an empty observation; the prompt needs text")
    if has_chat_template(tokenizer):
        text = render(tokenizer, messages, where="Env.reset")
        _shows(text, messages, where="Env.reset")
        return _encode(tokenizer, text, special=False), list(messages)
    text = "\n".join(m.content for m in messages)
    return _encode(tokenizer, text, special=True), list(messages)


def _with_placeholders(messages: Sequence[Message]) -> list[Message]:
    return [
        Message("assistant", REPLY_PLACEHOLDER) if m.role == "assistant" else m for m in messages
    ]


def observation_suffix(
    tokenizer: PreTrainedTokenizerBase, history: Sequence[Message], new: Sequence[Message]
) -> str:
    """The text the chat template writes after the last reply for the ``new``
    messages: the closing text of the reply, the messages, the generation
    prompt (see the module docstring). ``history`` is the chat before the reply.

    Raises ValueError when the template does not render each reply (as a
    placeholder) exactly once, or is not prefix-stable; an ObservationError
    when it rejects or drops one of the ``new`` messages.
    """
    shown = _with_placeholders(history)
    rendered = render(
        tokenizer, [*shown, Message("assistant", REPLY_PLACEHOLDER), *new], where="Env.step"
    )
    replies = 1 + sum(m.role == "assistant" for m in shown)
    if rendered.count(REPLY_PLACEHOLDER) != replies:
        raise ValueError(
            "the tokenizer's chat template must render every assistant reply verbatim "
            f"exactly once; rendering {replies} as {REPLY_PLACEHOLDER!r} produced it "
            f"{rendered.count(REPLY_PLACEHOLDER)} times. Fix: use a template that keeps "
            "assistant content, or have the environment return token ids"
        )
    before = render(tokenizer, shown, where="Env.step", generation_prompt=False)
    if not rendered.startswith(before):
        at = first_difference(before, rendered)
        raise ValueError(
            "the chat template is not prefix-stable: adding the reply and the new observation "
            f"changed the text it writes for the messages before them at character {at}: it "
            f"wrote {excerpt(before, at)}, now {excerpt(rendered, at)} (each reply is written "
            f"as {REPLY_PLACEHOLDER}). The token history cannot be the conversation the "
            "template renders. Fix: use a template "
            "that renders each turn independently (e.g. one that puts the system message "
            "first), or have the environment return token ids"
        )
    suffix = rendered[rendered.rindex(REPLY_PLACEHOLDER) + len(REPLY_PLACEHOLDER) :]
    _shows(suffix, new, where="Env.step")
    return suffix


def _is_special(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bool:
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token_id)
    return bool(getattr(added, "special", False)) or token_id in tokenizer.all_special_ids


def after_reply(
    tokenizer: PreTrainedTokenizerBase,
    suffix: str,
    reply_ids: Sequence[int],
    reply_finish: CompletionFinish,
) -> str:
    """``suffix`` without the closing text the reply already sampled: its last
    token's text, when the reply stopped on it (or it is a special token) and
    it opens the suffix."""
    if not reply_ids or not (reply_finish == "stop" or _is_special(tokenizer, reply_ids[-1])):
        return suffix
    stop_text = decode_reply(tokenizer, reply_ids[-1:], skip_special_tokens=False)
    if stop_text and suffix.startswith(stop_text):
        return suffix[len(stop_text) :]
    return suffix


def encode_next_observation(
    tokenizer: PreTrainedTokenizerBase,
    history: Sequence[Message],
    reply_ids: Sequence[int],
    reply_finish: CompletionFinish,
    obs: Observation,
) -> list[int]:
    """Ids ``[O]`` to append after an assistant reply (see the module docstring).

    ``history`` is the chat so far, without the reply; ``reply_ids`` are the
    reply's sampled ids and ``reply_finish`` why its generation ended. Token
    ids are appended verbatim (the environment owns them exactly).
    """
    ids, messages = split_observation(obs)
    if ids is not None:
        return ids
    if not has_chat_template(tokenizer):
        text = "\n".join(m.content for m in messages)
        return _encode(tokenizer, text, special=False)
    suffix = observation_suffix(tokenizer, history, messages)
    return _encode(
        tokenizer, after_reply(tokenizer, suffix, reply_ids, reply_finish), special=False
    )
