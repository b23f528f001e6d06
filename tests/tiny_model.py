"""A tiny randomly initialised Llama and a small byte-level BPE tokenizer, built in-process."""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "for i in range(10):\n    print(i * i)\n",
    "Héllo wörld — naïve café, 東京, emoji 🙂 bytes.",
]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@functools.cache
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(seed: int = 0, layers: int = 2, init_std: float = 0.2, max_positions: int = 512,
               width: int = 64) -> LlamaForCausalLM:
    """Random weights with a wide init so next-token logits are far from ties. `width`: the hidden size
    (the MLP's is twice it)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tiny_tokenizer()), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, initializer_range=init_std,
                         eos_token_id=tiny_tokenizer().eos_token_id, bos_token_id=None, pad_token_id=None,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def tiny_draft_pair(seed: int = 0, second_layer_scale: float = 0.3) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(draft, target) sharing the tiny vocabulary: a 2-layer target whose second layer writes
    `second_layer_scale` of its output, and a 1-layer draft that is the target without it. The draft's
    greedy choice agrees with the target's on roughly 60% of tokens: drafts are partly accepted."""
    target = tiny_model(seed=seed, layers=2)
    with torch.no_grad():
        target.model.layers[1].self_attn.o_proj.weight.mul_(second_layer_scale)
        target.model.layers[1].mlp.down_proj.weight.mul_(second_layer_scale)
    draft = tiny_model(seed=seed, layers=1)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if ".layers.1." not in k})
    return draft, target
