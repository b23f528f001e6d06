"""Load the target model: drafter_sdk.loading.causal_lm finds it (shared with the SDK's model drafter);
this adds the tensor-parallel shard load and a chat template given in place of the model's."""

from __future__ import annotations

from collections.abc import Callable

import jinja2
import torch
from transformers import DistributedConfig, PreTrainedModel, PreTrainedTokenizerBase

from drafter_sdk.loading.causal_lm import (  # noqa: F401 - re-exported: the verifier's one loading module
    DTYPES,
    EMBEDDED_NAME,
    EMBEDDED_PACKAGE,
    ModelLoadError,
    ModelSource,
    embedded_source,
    load_causal_lm,
    load_config,
    load_tokenizer,
    pick_device,
    pick_dtype,
    resolve_source,
)


class ChatTemplateError(ValueError):
    """The chat template given in place of the model's does not compile."""


def load(source: ModelSource, dtype: torch.dtype, device: torch.device, tensor_parallel_size: int = 1,
         chat_template: str | None = None, check_tokenizer: Callable[[PreTrainedTokenizerBase], object] | None = None
         ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and its tokenizer, which renders chats with `chat_template` where one is given; the
    template, and whatever `check_tokenizer` checks (raising), are checked before the weights load."""
    tokenizer = load_tokenizer(source)
    if chat_template is not None:
        use_chat_template(tokenizer, chat_template)
    if check_tokenizer is not None:
        check_tokenizer(tokenizer)
    return load_model(source, dtype, device, tensor_parallel_size), tokenizer


def use_chat_template(tokenizer: PreTrainedTokenizerBase, template: str) -> None:
    """Render chats with `template` instead of the model's own (vLLM's --chat-template). One that
    does not compile raises ChatTemplateError here, rather than fail every chat request later."""
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"--chat-template does not compile: {e.message} (line {e.lineno})") from None
    except jinja2.TemplateError:  # it compiled: refusing this one chat (raise_exception) is the template's right
        pass


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               tensor_parallel_size: int = 1) -> PreTrainedModel:
    """With tensor_parallel_size > 1, inside the joined process group: this rank's shard, cut by
    transformers' own tensor-parallel plan for the architecture, on this rank's device."""
    if tensor_parallel_size > 1:
        return load_causal_lm(source, dtype, None, distributed_config=DistributedConfig(
            tp_plan="auto", tp_size=tensor_parallel_size))
    return load_causal_lm(source, dtype, device)
