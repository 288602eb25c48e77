"""Writing small GGUF files for the import tests, the way llama.cpp's
``convert_hf_to_gguf.py`` writes a Llama: llama.cpp's tensor names, the query
and key rows permuted into its rotary layout, the tokenizer as
``tokenizer.ggml.*`` metadata (byte-level BPE: model ``gpt2``), and the chat
template under ``tokenizer.chat_template``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

gguf = pytest.importorskip("gguf")  # the `real` extra; a test module importing this skips without

_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def tiny_llama(tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> LlamaForCausalLM:
    """A random 2-layer Llama with grouped-query attention (4 query heads
    sharing 2 key/value heads, as SmolLM2's 9 share 3) and tied embeddings."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout of query/key rows (its ``LlamaModel.permute``)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_tokenizer(w: gguf.GGUFWriter, tok: PreTrainedTokenizerBase) -> None:
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tok.all_special_tokens)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.convert_tokens_to_ids("<|im_start|>"))
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)


def write_llama_gguf(
    path: Path,
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    *,
    quantized: Mapping[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """Write ``model`` and ``tokenizer`` as a GGUF file at ``path``: float32
    tensors, except the GGUF tensor names in ``quantized`` (stored quantized)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    _write_tokenizer(w, tokenizer)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"]}
    for i in range(c.num_hidden_layers):
        for hf, name in _LAYER_TENSORS.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if name == "attn_q":
                t = _permute(t, c.num_attention_heads)
            elif name == "attn_k":
                t = _permute(t, c.num_key_value_heads)
            tensors[f"blk.{i}.{name}.weight"] = np.ascontiguousarray(t)
    tensors["output_norm.weight"] = sd["model.norm.weight"]  # no output.weight: tied
    for name, t in tensors.items():
        qtype = (quantized or {}).get(name)
        if qtype is None:
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_header_only(path: Path, arch: str) -> Path:
    """A GGUF file of architecture ``arch`` with one tiny float32 tensor."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((2, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
