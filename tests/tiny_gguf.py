"""Write the tiny Llama and its tokenizer as a GGUF file, as llama.cpp's converter lays one out:
llama.cpp's tensor names, q/k rows permuted for its rotary layout, a chosen storage type per
tensor, and a gpt2 (byte-level BPE) vocabulary with its merges."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from tiny_model import tiny_model, tiny_tokenizer
from transformers import LlamaForCausalLM

Q = gguf.GGMLQuantizationType
# HF module -> llama.cpp name, per layer; written out so the loaders' own name tables are checked.
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, module = hf_name.removesuffix(".weight").split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[module]}.weight"


def _permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's rotary halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_gguf(path: Path, matrix_type: Q = Q.F32, model: LlamaForCausalLM | None = None,
                    architecture: str = "llama") -> LlamaForCausalLM:
    """Write `model` (default: the tiny model) to `path`: 2-D weights stored as `matrix_type`,
    norms as F32. Returns the model written."""
    model = model or tiny_model()
    config = model.config
    tokenizer = tiny_tokenizer()
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in special else 1 for token, _ in vocab])  # 3: control
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weight = tensor.float().numpy()
        if hf_name.endswith("q_proj.weight"):
            weight = _permuted(weight, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            weight = _permuted(weight, config.num_key_value_heads)
        storage = matrix_type if weight.ndim == 2 else Q.F32
        writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(weight, storage), raw_dtype=storage)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
