"""A tiny reasoning model: the tiny random Llama and tokenizer with `<think>` and `</think>` added as
single tokens, and a chat template that renders the thinking as DeepSeek-R1's and Qwen3's do.

The random model has no reason to close its thinking, so `</think>`'s output row is a slightly
larger copy of one frequent token's (ENDS_LIKE): greedy decoding writes `</think>` wherever it
would have written that token, a dozen tokens or so into the output. Nothing else changes: the
other rows, and so every choice before the first `</think>`, are the tiny model's."""

from __future__ import annotations

import copy
import functools

import torch
from tiny_model import tiny_model, tiny_tokenizer
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

# The assistant's turn opens the thinking (DeepSeek-R1; `open_thinking` false leaves the prompt without
# a marker, as Qwen3's hybrid template does), or closes it at once with enable_thinking false (Qwen3).
# An assistant message's earlier thinking (`reasoning_content`) is rendered before its content.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['reasoning_content'] is defined and m['reasoning_content'] %}<think>{{ m['reasoning_content'] }}"
    "</think>{% endif %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_thinking is not defined or open_thinking %}<think>\n{% endif %}{% endif %}")
ENDS_LIKE = 33  # "A": greedy, the model closes its thinking 9 tokens into THINKING_CHAT
THINKING_CHAT = [{"role": "user", "content": "Name three primes."}]


@functools.cache
def thinking_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def thinking_model(seed: int = 0) -> LlamaForCausalLM:
    tokenizer = thinking_tokenizer()
    base = tiny_model(seed=seed)
    config = copy.deepcopy(base.config)
    config.vocab_size = len(tokenizer)
    model = LlamaForCausalLM(config).eval()
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    with torch.no_grad():
        for name, weight in model.state_dict().items():
            source = base.state_dict()[name]
            weight[:source.shape[0]].copy_(source)
        model.model.embed_tokens.weight[start:].copy_(base.model.embed_tokens.weight[ENDS_LIKE])
        model.lm_head.weight[start] = 0.0  # a logit of 0: below the top one, so never written by the model itself
        model.lm_head.weight[end] = 1.05 * base.lm_head.weight[ENDS_LIKE]
    model.generation_config.eos_token_id = config.eos_token_id
    return model
