"""Load the target model: drafter_sdk.hf_loading finds it (shared with the SDK's model drafter);
this adds the tensor-parallel shard load."""

from __future__ import annotations

import torch
from transformers import DistributedConfig, PreTrainedModel, PreTrainedTokenizerBase

from drafter_sdk.hf_loading import (  # noqa: F401 - re-exported: the verifier's one loading module
    DTYPES,
    EMBEDDED_NAME,
    EMBEDDED_PACKAGE,
    ModelSource,
    embedded_source,
    load_config,
    load_tokenizer,
    pick_device,
    pick_dtype,
    resolve_source,
)
from drafter_sdk.hf_loading import load_causal_lm


def load(source: ModelSource, dtype: torch.dtype, device: torch.device, tensor_parallel_size: int = 1
         ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = load_tokenizer(source)
    return load_model(source, dtype, device, tensor_parallel_size), tokenizer


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               tensor_parallel_size: int = 1) -> PreTrainedModel:
    """With tensor_parallel_size > 1, inside the joined process group: this rank's shard, cut by
    transformers' own tensor-parallel plan for the architecture, on this rank's device."""
    if tensor_parallel_size > 1:
        return load_causal_lm(source, dtype, None, distributed_config=DistributedConfig(
            tp_plan="auto", tp_size=tensor_parallel_size))
    return load_causal_lm(source, dtype, device)
