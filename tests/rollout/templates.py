"""Chat templates of the main model families, and byte-level tokenizers for them.

Each template is written in Jinja after the family's published template,
keeping what makes it distinctive (string contents only; no ``tools=``):

- :data:`QWEN3`: ChatML tags; an assistant turn's ``<think>...</think>`` block
  is dropped when it comes before the last user query (earlier turns), and
  an empty one is inserted into the last turn after a tool response; tool
  results are ``<tool_response>`` blocks inside a ``user`` turn.
- :data:`LLAMA3`: ``<|begin_of_text|>``, a system block with the knowledge
  and today dates, ``<|start_header_id|>role<|end_header_id|>\\n\\n``,
  contents trimmed, ``<|eot_id|>``; tool results as ``ipython`` turns, their
  content written with ``tojson``.
- :data:`GEMMA`: no system role (its text opens the first user turn);
  ``<start_of_turn>user``/``model``, ``<end_of_turn>``; roles must alternate.
- :data:`MISTRAL`: ``<s>[INST] ...[/INST] reply</s>``; the system message is
  put into the *last* user turn (Mistral v0.3), so with a system message the
  template is not prefix-stable; a tool result needs a 9-character call id.
- :data:`DEEPSEEK`: the system text right after the BOS, ``<｜User｜>``,
  ``<｜Assistant｜>``, ``<｜end▁of▁sentence｜>``; the generation prompt opens a
  think block (``<｜Assistant｜><think>\\n``), earlier replies lose theirs;
  tool outputs in ``<｜tool▁outputs▁begin｜>`` blocks, after which the reply
  follows without an ``<｜Assistant｜>`` tag.

:func:`byte_tokenizer` builds a byte-level WordLevel tokenizer: special tokens
first (ids from 0, in order), then other added tokens (``<think>`` etc., not
special, as in the real tokenizers), then one id per byte. :meth:`Family.ids`
turns text into ids by table lookup (greedy longest match of the token
strings, every other byte its own id), independently of the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

QWEN3 = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string"
    " and not (message.content.startswith('<tool_response>')"
    " and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

LLAMA3 = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool') %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}"
    "{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

GEMMA = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{- message['content'] | trim }}"
    "{{- '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' }}{%- endif -%}"
)

MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set ns = namespace(index=0) %}"
    "{%- for message in loop_messages %}"
    "{%- if not (message.role == 'tool') %}"
    "{%- if (message['role'] == 'user') != (ns.index % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must "
    "alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- set ns.index = ns.index + 1 %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}"
    "{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- ' ' + message['content']|trim + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}"
    '{{- \'[TOOL_RESULTS] {"content": \' + message.content|string + \', "call_id": "\''
    " + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{%- else %}"
    "{{- raise_exception('Only user and assistant roles are supported, with the exception "
    "of an initial optional system message!') }}"
    "{%- endif %}"
    "{%- endfor %}"
)

DEEPSEEK = (
    "{%- if not add_generation_prompt is defined %}{%- set add_generation_prompt = false %}"
    "{%- endif %}"
    "{%- set ns = namespace(is_tool=false, is_output_first=true, system_prompt='',"
    " is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{%- set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{%- set ns.is_first_sp = false %}"
    "{%- else %}{%- set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{{- bos_token }}{{- ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- set ns.is_tool = false -%}{{- '<｜User｜>' + message['content'] }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- if ns.is_tool %}"
    "{{- '<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- set ns.is_tool = false -%}"
    "{%- else %}"
    "{%- set content = message['content'] %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}"
    "{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- set ns.is_tool = true -%}"
    "{%- if ns.is_output_first %}"
    "{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content']"
    " + '<｜tool▁output▁end｜>' }}"
    "{%- set ns.is_output_first = false %}"
    "{%- else %}"
    "{{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor -%}"
    "{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}"
    "{%- if add_generation_prompt and not ns.is_tool %}{{- '<｜Assistant｜><think>\\n' }}"
    "{%- endif %}"
)

CHATML_WITHOUT_TOOL = (
    "{%- for message in messages %}"
    "{%- if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML that silently renders nothing for a ``tool`` message (as some do)."""

CHATML_WITH_TURN_NUMBERS = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- if message['role'] == 'user' %}"
    "{{- ' (' + (messages|length - loop.index0) | string + ' to go)' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML that writes, in each user turn, how many messages follow it: every
later message changes the text of every earlier turn (not prefix-stable)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = dict.fromkeys(range(256), ""), 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@dataclass(frozen=True)
class Family:
    """One model family's chat template and the tokens it needs.

    Ids: ``specials`` from 0 in order, then ``added`` (not special), then
    byte ``b`` at ``byte_base + b``.
    """

    name: str
    template: str
    specials: tuple[str, ...]
    eos: str
    bos: str | None = None
    pad: str | None = None
    added: tuple[str, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)
    """Other special-token roles (e.g. ``unk_token``)."""

    @property
    def tokens(self) -> tuple[str, ...]:
        return self.specials + self.added

    @property
    def byte_base(self) -> int:
        return len(self.tokens)

    def id(self, token: str) -> int:
        return self.tokens.index(token)

    def ids(self, text: str) -> list[int]:
        """Ids of ``text`` by table lookup: token strings (longest first), else bytes."""
        out, i = [], 0
        by_length = sorted(self.tokens, key=len, reverse=True)
        while i < len(text):
            token = next((t for t in by_length if text.startswith(t, i)), None)
            if token is not None:
                out.append(self.id(token))
                i += len(token)
            else:
                out += [self.byte_base + b for b in text[i].encode()]
                i += 1
        return out

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        return byte_tokenizer(self)


def byte_tokenizer(family: Family) -> PreTrainedTokenizerFast:
    """A byte-level WordLevel tokenizer with ``family``'s tokens and template."""
    chars = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(family.tokens)}
    vocab |= {chars[b]: family.byte_base + b for b in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    # Bytes become printable characters, then every character is one word.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    roles = {"eos_token": family.eos, "bos_token": family.bos, "pad_token": family.pad}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=family.template,
        **{k: v for k, v in roles.items() if v is not None},
        **family.extra,
    )


QWEN3_FAMILY = Family(
    "qwen3",
    QWEN3,
    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    eos="<|im_end|>",
    pad="<|endoftext|>",
    added=(
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ),
)
LLAMA3_FAMILY = Family(
    "llama3",
    LLAMA3,
    specials=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
    ),
    eos="<|eot_id|>",
    bos="<|begin_of_text|>",
    pad="<|end_of_text|>",
    added=("<think>", "</think>"),
)
GEMMA_FAMILY = Family(
    "gemma",
    GEMMA,
    specials=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
    eos="<end_of_turn>",
    bos="<bos>",
    pad="<pad>",
    added=("<think>", "</think>"),
)
MISTRAL_FAMILY = Family(
    "mistral",
    MISTRAL,
    specials=(
        "<unk>",
        "<s>",
        "</s>",
        "[INST]",
        "[/INST]",
        "[TOOL_CALLS]",
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
    ),
    eos="</s>",
    bos="<s>",
    added=("<think>", "</think>"),
    extra={"unk_token": "<unk>"},
)
DEEPSEEK_FAMILY = Family(
    "deepseek",
    DEEPSEEK,
    specials=(
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<｜tool▁outputs▁begin｜>",
        "<｜tool▁outputs▁end｜>",
        "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
    ),
    eos="<｜end▁of▁sentence｜>",
    bos="<｜begin▁of▁sentence｜>",
    pad="<｜end▁of▁sentence｜>",
    added=("<think>", "</think>"),
)
FAMILIES = (QWEN3_FAMILY, LLAMA3_FAMILY, GEMMA_FAMILY, MISTRAL_FAMILY, DEEPSEEK_FAMILY)
