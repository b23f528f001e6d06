"""Write a tiny model (Llama, Qwen2 or Qwen3) and the tiny tokenizer as a GGUF file, as llama.cpp's
converter lays one out: llama.cpp's tensor names, a Llama's q/k rows permuted for its rotary layout,
a chosen storage type per tensor, and a gpt2 (byte-level BPE) vocabulary with its merges."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from tiny_model import tiny_model, tiny_tokenizer
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

Q = gguf.GGMLQuantizationType
# HF module -> llama.cpp name, per layer; written out so the loaders' own name tables are checked.
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",  # Qwen3's
}
QWEN = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    name, _, kind = hf_name.rpartition(".")  # weight or bias
    _, _, layer, module = name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def tiny_qwen(architecture: str) -> PreTrainedModel:
    """The tiny Llama's shape as a Qwen2 (q/k/v biases) or Qwen3 (q/k norms), random weights."""
    config_class, model_class = QWEN[architecture]
    llama = tiny_model().config
    torch.manual_seed(0)
    config = config_class(vocab_size=llama.vocab_size, hidden_size=llama.hidden_size,
                          intermediate_size=llama.intermediate_size, num_hidden_layers=llama.num_hidden_layers,
                          num_attention_heads=llama.num_attention_heads, num_key_value_heads=llama.num_key_value_heads,
                          max_position_embeddings=llama.max_position_embeddings, tie_word_embeddings=True,
                          eos_token_id=llama.eos_token_id, bos_token_id=None, pad_token_id=None)
    model = model_class(config).eval()
    with torch.no_grad():  # biases and norms away from their init (zeros, ones), so a swap would show
        for name, tensor in model.named_parameters():
            if name.endswith("bias") or "_norm" in name:
                tensor.normal_(1.0, 0.2)
    return model


def _permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's rotary halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_gguf(path: Path, matrix_type: Q = Q.F32, architecture: str = "llama") -> PreTrainedModel:
    """Write the tiny model of `architecture` (llama, qwen2, qwen3; another name: the tiny Llama under
    that name) to `path`: 2-D weights stored as `matrix_type`, norms and biases as F32. Returns the
    model written."""
    model = tiny_qwen(architecture) if architecture in QWEN else tiny_model()
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
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")  # the tiny tokenizer's own splitting, whatever the architecture
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
        if architecture not in QWEN and hf_name.endswith("q_proj.weight"):
            weight = _permuted(weight, config.num_attention_heads)
        elif architecture not in QWEN and hf_name.endswith("k_proj.weight"):
            weight = _permuted(weight, config.num_key_value_heads)
        storage = matrix_type if weight.ndim == 2 else Q.F32
        writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(weight, storage), raw_dtype=storage)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
