"""`vllm serve` flags that splitspec-verifier does not take, each with what does its work here; and
vLLM's API key variable and --dtype names, which it takes.

A vLLM command line moved over as it is fails on such a flag with the way to say it here, instead of
argparse's bare "unrecognized arguments". The flags both take (--model given first, --max-model-len,
--served-model-name, --speculative-config, --enforce-eager, ...) are the parser's own (cli.py). A
deployment moved over with its key in VLLM_API_KEY keeps it: ignored, it would serve without one.
"""

from __future__ import annotations

# The token clients must send where neither --auth-token-file nor $SPLITSPEC_AUTH_TOKEN gives one.
API_KEY_ENV_VAR = "VLLM_API_KEY"

# vLLM's other --dtype names for two of ours.
DTYPE_NAMES = {"half": "float16", "float": "float32"}

_CHUNKED = ("chunked prefill is always on, as in vLLM V1: a prompt longer than what a step's "
            "--max-num-batched-tokens leaves is prefilled over several steps")
_TLS = "the verifier's TLS serves its gRPC and HTTP ports alike: --tls-cert, --tls-key and --tls-client-ca"
_SPECULATIVE = ("vLLM's older speculative flags: --speculative-config (vLLM's JSON, or splitspec's), or "
                "--speculative-mode with --max-draft-len, --draft-model or --max-matching-ngram-size")
_PIPELINE = "only tensor parallelism: --tensor-parallel-size (-tp)"
_DATA = "run more verifier replicas (deploy/ scales the verifier's Deployment)"
_QUANTIZATION = "weights are served in --dtype (a GGUF's quantized ones are dequantized as they load)"
_SWAP = "no KV swap or offload: a request that finds no KV slot waits for one (--max-queue-len)"

HINTS: dict[str, str] = {
    "--api-key": "no secret is taken as a flag value (it would show in `ps`): put the key in a file for "
                 f"--auth-token-file, or in $SPLITSPEC_AUTH_TOKEN (or ${API_KEY_ENV_VAR}, as vLLM reads it)",
    "--gpu-memory-utilization": "the KV cache is given in GB per rank, not as a share of the GPU: "
                                "--kv-cache-memory-gb",
    "--kv-cache-memory": "--kv-cache-memory-gb, in GB",
    "--enable-chunked-prefill": _CHUNKED,
    "--no-enable-chunked-prefill": _CHUNKED,
    "--trust-remote-code": "no model's own code is ever run: the verifier computes the architectures it knows "
                           "(README, Architectures)",
    "--quantization": _QUANTIZATION,
    "-q": _QUANTIZATION,
    "--tokenizer": "the tokenizer is the model's own: its folder's, or its GGUF's",
    "--pipeline-parallel-size": _PIPELINE,
    "-pp": _PIPELINE,
    "--data-parallel-size": _DATA,
    "-dp": _DATA,
    "--max-logprobs": "up to 20 log-probabilities a position, OpenAI's top_logprobs limit, always",
    "--block-size": "the KV cache holds a slot per sequence; the prefix cache matches prompts in 16-token blocks",
    "--swap-space": _SWAP,
    "--cpu-offload-gb": _SWAP,
    "--disable-log-requests": "requests are not logged unless --enable-log-requests",
    "--uvicorn-log-level": "--log-level sets every logger's level, the HTTP server's included",
    "--ssl-certfile": _TLS,
    "--ssl-keyfile": _TLS,
    "--ssl-ca-certs": _TLS,
    "--speculative-model": _SPECULATIVE,
    "--num-speculative-tokens": _SPECULATIVE,
    "--ngram-prompt-lookup-max": _SPECULATIVE,
    "--disable-fastapi-docs": "no /docs, /redoc or /openapi.json are served",
    "--enable-request-id-headers": "every HTTP response carries its X-Request-Id already",
}


def dtype(name: str) -> str:
    """A --dtype value under our name for it."""
    return DTYPE_NAMES.get(name, name)


def explain(unrecognized: list[str]) -> str:
    """argparse's error for the arguments it did not take, with the way to say each vLLM flag among them
    here. Where one is, only flags are named: a word among the rest may be a secret's value (`--api-key
    sk-...`), and the flag's own value (`--api-key=sk-...`) is cut off too."""
    flags = list(dict.fromkeys(arg.split("=", 1)[0] for arg in unrecognized if arg.startswith("-")))
    known = [flag for flag in flags if flag in HINTS]
    if not known:
        return f"unrecognized arguments: {' '.join(unrecognized)}"
    others = [flag for flag in flags if flag not in HINTS]
    said = "\n  ".join(["vLLM's flags that splitspec-verifier does not take:", *(f"{f}: {HINTS[f]}" for f in known)])
    return said + (f"\nunrecognized arguments: {' '.join(others)}" if others else "")
