"""sao.models: causal-LM policies and tokenizers from local directories, exact
per-token log-probabilities, the value model with frozen attention, tiny
models and tokenizers built in code, supervised warm-starting, and the model
cache. It imports only the types and :mod:`sao.algo`'s tensor checks."""

from sao.models.cache import atomic_dir, build_cached, cached_model_dir, recipe_hash, sao_home
from sao.models.freeze import (
    FREEZE_GROUPS,
    FreezeReport,
    classify_parameter,
    freeze_attention,
    freeze_below,
)
from sao.models.loading import ModelLoadError, load_config, load_policy, load_tokenizer
from sao.models.logprobs import (
    backbone_hidden_states,
    position_ids_from_mask,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from sao.models.sft import EncodedConversation, SFTReport, encode_conversation, sft
from sao.models.tiny import TINY_ARCHS, TINY_SIZES, TinyShape, build_tiny_policy, tiny_config
from sao.models.tokenization import (
    CHAT_TEMPLATE,
    END_OF_TEXT,
    IM_END,
    IM_START,
    PAD,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    require_chat_template,
    train_bpe_tokenizer,
)
from sao.models.value import ValueModel

__all__ = [
    "CHAT_TEMPLATE",
    "END_OF_TEXT",
    "FREEZE_GROUPS",
    "IM_END",
    "IM_START",
    "PAD",
    "SPECIAL_TOKENS",
    "TINY_ARCHS",
    "TINY_SIZES",
    "EncodedConversation",
    "FreezeReport",
    "ModelLoadError",
    "SFTReport",
    "TinyShape",
    "ValueModel",
    "atomic_dir",
    "backbone_hidden_states",
    "build_cached",
    "build_char_tokenizer",
    "build_tiny_policy",
    "cached_model_dir",
    "classify_parameter",
    "encode_conversation",
    "freeze_attention",
    "freeze_below",
    "load_config",
    "load_policy",
    "load_tokenizer",
    "position_ids_from_mask",
    "recipe_hash",
    "require_chat_template",
    "sao_home",
    "sequence_logprobs",
    "sequence_logprobs_and_entropy",
    "sft",
    "tiny_config",
    "train_bpe_tokenizer",
]
