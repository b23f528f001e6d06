"""`splitspec`: talk to a verifier (generate, run-batch), or try the whole system locally (demo, bench)."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
from collections.abc import Callable

import grpc

from drafter_sdk.errors import ModelLoadError
from drafter_sdk.proto import verifier_pb2, verifier_pb2_grpc
from drafter_sdk.service.package_version import package_version
from drafter_sdk.service.process_exit import skip_final_collection
from drafter_sdk.service.security import (
    TOKEN_ENV_VAR,
    auth_metadata,
    channel_credentials,
    key_pair_problem,
    read_token,
)
from verifier_service.model.generation_config import SAMPLING_KEYS


def build_params(args: argparse.Namespace) -> verifier_pb2.GenerationParams:
    # Sampling flags left out stay unset: the server's defaults (the model's generation config) apply.
    sampling = {name: getattr(args, name) for name in SAMPLING_KEYS if getattr(args, name) is not None}
    params = verifier_pb2.GenerationParams(
        sampling=verifier_pb2.SamplingParams(**sampling, frequency_penalty=args.frequency_penalty,
                                             presence_penalty=args.presence_penalty, bad_words=args.bad_word or []),
        stopping=verifier_pb2.StoppingCriteria(stop=args.stop or [], stop_token_ids=args.stop_token_id or [],
                                               ignore_eos=args.ignore_eos, min_new_tokens=args.min_new_tokens),
        speculation=verifier_pb2.SpeculationOverrides(disable=args.no_speculation))
    if args.max_new_tokens is not None:
        params.stopping.max_new_tokens = args.max_new_tokens
    if args.seed is not None:
        params.sampling.seed = args.seed
    if args.max_draft_len is not None:
        params.speculation.max_draft_len = args.max_draft_len
    if args.truncate_prompt_tokens is not None:
        params.truncate_prompt_tokens = args.truncate_prompt_tokens
    if args.json_schema is not None:
        with open(args.json_schema, encoding="utf-8") as f:
            params.structured_output.json_schema = f.read()
    elif args.json:
        params.structured_output.json_object = True
    elif args.regex is not None:
        params.structured_output.regex = args.regex
    elif args.choice:
        params.structured_output.choice.choices.extend(args.choice)
    if args.prediction is not None:
        with open(args.prediction, encoding="utf-8") as f:
            params.prediction = f.read()
    if args.raw:
        params.prompt = args.prompt
    else:
        params.chat.messages.append(verifier_pb2.ChatMessage(role="user", content=args.prompt))
        params.chat.template_kwargs = args.chat_template_kwargs or ""
    return params


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number within [low, high], the range of the proto field it fills (outside
    it, protobuf would raise)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be within [{low}, {high}], not {value}")
        return value
    return parse


# Flag types for the proto's uint32 and int32 fields (http_schema.py has the same bounds as pydantic limits).
uint32 = whole_number(0, 2**32 - 1)
int32 = whole_number(-(2**31), 2**31 - 1)


def nucleus(text: str) -> float:
    """An argparse type for --top-p: within (0, 1]. gRPC reads an explicit 0 as no filtering, which a user
    asking for the narrowest nucleus would not expect (the HTTP API refuses it, as vLLM does)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within (0, 1] (1 = no filtering), not {text}")
    return value


def json_object(text: str) -> str:
    """An argparse type: text that parses as a JSON object, passed on as it is."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return text


def format_stats(stats: verifier_pb2.SpeculationStats) -> str:
    return (f"steps={stats.num_steps} drafts={stats.num_drafts} draft_tokens={stats.num_draft_tokens} "
            f"draft_nodes={stats.num_draft_nodes} "
            f"accepted={stats.num_accepted_tokens} mean_acceptance_length={stats.mean_acceptance_length:.2f} "
            f"acceptance_rate={stats.acceptance_rate:.2f} prediction_accepted={stats.accepted_prediction_tokens} "
            f"prediction_rejected={stats.rejected_prediction_tokens} "
            f"per_position={list(stats.num_accepted_tokens_per_pos)}")


def open_channel(args: argparse.Namespace, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """Plaintext, or TLS when any --tls-* flag is given (mutual TLS with --tls-cert/--tls-key)."""
    options = list(options or [])
    if not (args.tls or args.tls_ca or args.tls_cert):
        return grpc.insecure_channel(args.target, options=options)
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    return grpc.secure_channel(args.target, channel_credentials(args.tls_ca, args.tls_cert, args.tls_key),
                               options=options)


def generate(args: argparse.Namespace) -> int:
    try:
        params = build_params(args)
    except OSError as exc:  # --json-schema or --prediction names a file that cannot be read
        print(f"splitspec: {exc}", file=sys.stderr)
        return 2
    if problem := key_pair_problem(args.tls_cert, args.tls_key):
        print(f"splitspec: {problem}", file=sys.stderr)
        return 2
    if args.raw and args.chat_template_kwargs:
        print("splitspec: --chat-template-kwargs renders a chat; --raw sends the text as it is", file=sys.stderr)
        return 2
    try:
        token = read_token(args.auth_token_file)
        channel = open_channel(args)
    except (OSError, ValueError) as exc:
        print(f"splitspec: {exc}", file=sys.stderr)
        return 2
    metadata = auth_metadata(token) if token else None
    with channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        try:
            if args.stream:
                stats = verifier_pb2.SpeculationStats()
                for message in stub.GenerateStream(verifier_pb2.GenerateStreamRequest(params=params),
                                                   timeout=args.timeout, metadata=metadata):
                    sys.stdout.write(message.output.text)
                    sys.stdout.flush()
                    stats = message.output.stats
                print()
            else:
                reply = stub.Generate(verifier_pb2.GenerateRequest(params=params), timeout=args.timeout,
                                      metadata=metadata)
                print(reply.output.text)
                stats = reply.output.stats
        except grpc.RpcError as exc:
            print(f"splitspec: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(f"[{format_stats(stats)}]", file=sys.stderr)
    return 0


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="send a prompt to a verifier and print the text and speculation stats",
                       allow_abbrev=False)  # `--auth-token SECRET` must not pass for --auth-token-file
    p.add_argument("prompt")
    p.add_argument("--target", default="localhost:50051", help="verifier address")
    p.add_argument("--raw", action="store_true", help="send as raw text instead of a chat user message")
    p.add_argument("--chat-template-kwargs", type=json_object, metavar="JSON",
                   help="more variables for the model's chat template, as a JSON object (vLLM's "
                        "chat_template_kwargs), e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--max-new-tokens", type=uint32, help="default: the server's (GetServerInfo)")
    p.add_argument("--min-new-tokens", type=uint32, default=0,
                   help="no end (EOS, stop token or string) before them")
    p.add_argument("--temperature", type=float, help="0 = greedy; left out, the server's default: the model's "
                                                      "generation config's, else greedy (as --top-p, --top-k, "
                                                      "--min-p and --repetition-penalty)")
    p.add_argument("--top-p", type=nucleus, help="in (0, 1]; 1 = no filtering")
    p.add_argument("--top-k", type=int32)
    p.add_argument("--min-p", type=float, help="0 = off")
    p.add_argument("--seed", type=whole_number(0, 2**64 - 1))
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = none")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = none")
    p.add_argument("--repetition-penalty", type=float, help="vLLM's, > 0; 1 = none")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=whole_number(0, 2**31 - 1), action="append", metavar="ID",
                   help="stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    p.add_argument("--bad-word", action="append", metavar="WORD",
                   help="a word that cannot be generated (repeatable; vLLM's bad_words)")
    p.add_argument("--truncate-prompt-tokens", type=int32, metavar="N",
                   help="keep only the prompt's last N tokens; -1: as many as leave room for the answer (vLLM's)")
    p.add_argument("--stream", action="store_true", help="print text as it is accepted")
    p.add_argument("--no-speculation", action="store_true", help="decode this request without drafts")
    p.add_argument("--max-draft-len", type=uint32, metavar="N",
                   help="draft at most N tokens a step for this request (below the verifier's own limit)")
    form = p.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    form.add_argument("--json-schema", metavar="FILE", help="answer with JSON following this JSON Schema file")
    form.add_argument("--json", action="store_true", help="answer with a JSON object")
    form.add_argument("--regex", help="answer with text this regular expression matches whole")
    form.add_argument("--choice", action="append", help="answer with exactly one of these (repeatable)")
    p.add_argument("--prediction", metavar="FILE", help="text the answer is expected to largely repeat (OpenAI's "
                   "Predicted Outputs, e.g. a file to be rewritten with a few changes): the verifier drafts from it")
    p.add_argument("--timeout", type=float, default=600.0)
    add_client_security(p, "verifier")
    p.set_defaults(func=generate)


def add_client_security(p: argparse.ArgumentParser, server: str) -> None:
    """How a command connects to `server` (open_channel): TLS, mutual TLS, a bearer token."""
    s = p.add_argument_group("security")
    s.add_argument("--tls", action="store_true", help="connect over TLS, verifying with the system's CA roots")
    s.add_argument("--tls-ca", help=f"PEM CA bundle verifying the {server}'s certificate (implies --tls)")
    s.add_argument("--tls-cert", help="PEM client certificate for mutual TLS (needs --tls-key; implies --tls)")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--tls-server-name", help="expected name in the server certificate, when not the target host")
    s.add_argument("--auth-token-file",
                   help=f"file holding the bearer token (default: ${TOKEN_ENV_VAR}, if set)")


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind the command as Ctrl-C does, so that the services it started stop with it.

    `kill PID` or a supervisor stopping `splitspec bench` signals this process only; by default it
    would die without running its `finally` blocks and leave its verifiers and drafters serving.
    A second SIGTERM is ignored, so it cannot cut that clean-up short (SIGKILL still can)."""
    def handler(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


# name: (the module that defines and runs it, its one line of help). A command's module is imported only when
# that command runs: bench and most of its kin import torch and transformers (seconds), which `generate`,
# `demo` and `--help` do not need.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("verifier_service.tools.demo", "run a drafter and a verifier locally and compare with plain decoding"),
    "run-batch": ("verifier_service.tools.run_batch",
                  "answer a file of requests in OpenAI's batch format (JSONL) with a running verifier; resumable"),
    "check-drafter": ("verifier_service.tools.check_drafter",
                      "hold a running drafter service, in any language, to the contract (PROTOCOL.md's checklist)"),
    "bench": ("verifier_service.tools.bench.run",
              "side-by-side speed: plain, n-gram and suffix drafters (in-process and remote), transformers"),
    "bench-tp": ("verifier_service.tools.bench.tp",
                 "tensor parallelism: the same verifier over 1, 2, ... ranks, side by side"),
    "bench-drafter-memory": ("verifier_service.tools.bench.drafter_memory",
                             "drafter state bytes per held token, and a flood against the state budget "
                             "(no model needed)"),
    "bench-http": ("verifier_service.tools.bench.http",
                   "the HTTP API's cost over gRPC: batch-1 latency, streaming throughput"),
    "bench-serve": ("verifier_service.tools.bench.endpoint",
                    "a running verifier's HTTP API under load (request rate, concurrency): TTFT, TPOT, "
                    "throughput, with speculation and without"),
    "bench-replicas": ("verifier_service.tools.bench.replicas",
                       "two suffix drafter replicas: each told of every finished request, or only the one "
                       "that served it"),
}


def main(argv: list[str] | None = None) -> int:
    skip_final_collection()
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="splitspec", description=__doc__)
    parser.add_argument("--version", action="version", version=package_version())
    sub = parser.add_subparsers(required=True, metavar="command")
    add_generate(sub)
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    exit_on_sigterm()
    try:
        return args.func(args)
    except ModelLoadError as exc:  # a --model or --device that cannot load: one line, not a traceback
        parser.exit(2, f"splitspec: {exc}\n")


if __name__ == "__main__":
    raise SystemExit(main())
