"""Load a GGUF model in one pass: config, tokenizer and weights from one read of the file's header.

transformers' own GGUF load parses the file's metadata once for the config, again for the
tokenizer and twice for the weights, and rebuilds gguf-py's tensor-name table once per module:
about 35 s for the embedded 135M SmolLM2 on a 2-core CPU, of which dequantising is 2 s. Here the
header is read once (string arrays are skipped: the config needs only the vocabulary's length),
names are mapped with one table, and the rest is transformers' and gguf-py's own: the metadata-to-
config table, the tokenizer conversion, the tensor processor that undoes llama.cpp's q/k
permutation, and gguf-py's dequantiser. So the model is the one transformers' GGUF load gives, bit
for bit; the tests compare the two on GGUFs in each storage type met here.

Only llama, qwen2 and qwen3 files are read this way: the embedded model and most GGUFs in use,
which transformers loads with its tables alone, no special case. Any other architecture goes
through transformers' own load (`one_pass_header` says which).
"""

from __future__ import annotations

import logging
import math
import os
import struct
import time
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING, TENSOR_PROCESSORS, TensorProcessor
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

log = logging.getLogger(__name__)

ONE_PASS_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3"})
_VERSIONS = (2, 3)
# Metadata value types (the GGUF spec's numbering): fixed-size ones as struct codes; 8 is a
# string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # torch order: ggml lists dimensions fastest-moving first
    ggml_type: int
    start: int  # byte offset in the file


@dataclass(frozen=True)
class GgufHeader:
    path: str
    metadata: dict[str, Any]  # an array of strings (the vocabulary, the merges) as its length
    tensors: tuple[GgufTensor, ...]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    @property
    def one_pass(self) -> bool:
        """Whether this module loads the file; otherwise transformers' own GGUF load does. (A
        llama file named exactly "mistral" is one transformers turns into a Mistral config.)"""
        return self.architecture in ONE_PASS_ARCHITECTURES and self.metadata.get("general.name") != "mistral"


def read_header(path: str) -> GgufHeader:
    """The metadata and tensor table of a little-endian GGUF (v2 or v3); raises ValueError otherwise."""
    try:
        return _read_header(path)
    except struct.error as e:
        raise ValueError(f"{path} ends inside its GGUF header ({e})") from None


def _read_header(path: str) -> GgufHeader:
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in _VERSIONS:
        raise ValueError(f"{path} is GGUF version {version}; this reader takes versions 2 and 3, little-endian")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = _string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, value_type)
    entries = []
    for _ in range(tensor_count):
        name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        entries.append((name, tuple(reversed(shape)), ggml_type, offset))
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    data_start = -(-pos // alignment) * alignment
    tensors = tuple(GgufTensor(name, shape, t, data_start + offset) for name, shape, t, offset in entries)
    return GgufHeader(path, metadata, tensors)


def _string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8:pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _value(blob: np.ndarray, pos: int, value_type: int) -> tuple[Any, int]:
    if value_type in _SCALARS:
        code = "<" + _SCALARS[value_type]
        return struct.unpack_from(code, blob, pos)[0], pos + struct.calcsize(code)
    if value_type == _STRING:
        return _string(blob, pos)
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF metadata type {value_type}")
    element_type, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if element_type in _SCALARS:
        code = f"<{count}{_SCALARS[element_type]}"
        return list(struct.unpack_from(code, blob, pos)), pos + struct.calcsize(code)
    if element_type != _STRING:
        raise ValueError(f"GGUF metadata holds an array of type {element_type}")
    for _ in range(count):  # strings are variable-length: walk past them
        (length,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + length
    return count, pos


def config_values(header: GgufHeader) -> dict[str, Any]:
    """The config's fields, named by transformers' GGUF metadata table, as its GGUF load names them."""
    table = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    values: dict[str, Any] = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    for key, value in header.metadata.items():
        prefix, _, rest = key.partition(".")
        field = table.get(prefix, {}).get(rest)
        if field not in (None, -1):
            values[field] = value
    values.setdefault("vocab_size", header.metadata.get("tokenizer.ggml.tokens"))  # the vocabulary's length
    return values


def one_pass_header(path: str) -> GgufHeader | None:
    """The file's header when this module reads the file; None to leave it to transformers (an
    architecture not read here, or a header this reader does not take, such as a big-endian one)."""
    try:
        header = read_header(path)
    except ValueError as e:
        log.info("leaving %s to transformers' GGUF load: %s", path, e)
        return None
    return header if header.one_pass else None


def load_config(path: str) -> PretrainedConfig:
    header = one_pass_header(path)
    if header is None:
        folder, name = _folder_and_file(path)
        return AutoConfig.from_pretrained(folder, gguf_file=name)
    return _config(header)


def _config(header: GgufHeader) -> PretrainedConfig:
    config = AutoConfig.for_model(**config_values(header))
    config.name_or_path = _folder_and_file(header.path)[0]  # as transformers' GGUF load sets it
    return config


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """In one pass: the tokenizer class AutoTokenizer picks for this config, built from the GGUF by
    transformers (AutoTokenizer would first parse the whole file again for the config)."""
    folder, name = _folder_and_file(path)
    header = one_pass_header(path)
    if header is None:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model_type = _config(header).model_type
    tokenizer_class = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")
    return tokenizer_class.from_pretrained(folder, gguf_file=name)


def load_model(path: str, dtype: torch.dtype, **from_pretrained: Any) -> PreTrainedModel:
    """The model, before `.eval()` and placement. `from_pretrained` options (a sharded load's) go
    through transformers' own GGUF load, which applies them as it reads."""
    header = one_pass_header(path)
    if from_pretrained or header is None:
        folder, name = _folder_and_file(path)
        return AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=dtype, **from_pretrained)
    started = time.monotonic()
    config = _config(header)
    with torch.device("meta"):  # only for the class and its parameter names
        skeleton = AutoModelForCausalLM.from_config(config)
    weights = load_weights(header, config_values(header), list(skeleton.state_dict()), dtype)
    model = type(skeleton).from_pretrained(
        None, config=config, state_dict=weights, dtype=dtype)
    model.config.name_or_path = config.name_or_path
    log.info("read %s in one pass (%d tensors) in %.1f s", path, len(weights), time.monotonic() - started)
    return model


def _folder_and_file(path: str) -> tuple[str, str]:
    folder, name = os.path.split(path)
    return folder or ".", name


def load_weights(header: GgufHeader, values: dict[str, Any], parameter_names: list[str], dtype: torch.dtype
                 ) -> dict[str, torch.Tensor]:
    """`{parameter name: tensor}`: each GGUF tensor dequantised by gguf-py, processed by transformers'
    tensor processor for the architecture, and named by gguf-py's name table, built once."""
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == header.architecture)
    table = gguf.get_tensor_name_map(arch, values["num_hidden_layers"])
    gguf_to_hf = {}
    for hf_name in parameter_names:
        base, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            base, _, last = hf_name.rpartition(".")
            suffix = "." + last
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            gguf_to_hf[gguf_name + suffix] = hf_name
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=values)
    blob = np.memmap(header.path, mode="r", dtype=np.uint8)
    weights = {}
    for tensor in header.tensors:
        block_elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor.ggml_type)]
        row_bytes = tensor.shape[-1] // block_elements * block_bytes
        raw = blob[tensor.start:tensor.start + math.prod(tensor.shape[:-1]) * row_bytes]
        array = gguf.quants.dequantize(raw.reshape(*tensor.shape[:-1], row_bytes),
                                       gguf.GGMLQuantizationType(tensor.ggml_type))
        result = processor.process(weights=array, name=tensor.name, tensor_key_mapping=gguf_to_hf, parsed_parameters={})
        if result.name in gguf_to_hf:
            weights[gguf_to_hf[result.name]] = torch.from_numpy(np.copy(result.weights)).to(dtype)
    return weights
