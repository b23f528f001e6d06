"""`splitspec check-drafter`: a running drafter service, in any language, held to the contract.

A drafter written without the Python SDK (Go, Rust, Node.js...) has protos/PROTOCOL.md and its checklist
(§14) to go by; this command runs that checklist against the service over gRPC, as a verifier would meet
it: health, GetDrafterInfo, one result per sequence in order, drafts within their bounds, the delta
protocol (appends, overlaps, gaps, contradictions, unknown sequences, deltas with no draft asked, state
kept apart per verifier), releases, validation of a whole request before any state changes, the draft
stream, token trees, cache salts kept apart, the time a call takes at a realistic batch, a message over
gRPC's default 4 MiB limit, and bearer auth. Each check uses verifier ids of its own (`check-<run>-<check>`),
so it meets no real verifier's state, and releases what it created; a drafter that learns from finished
requests keeps one short output the cache-salt check finished, under a salt of that run's alone.

A check prints PASS, FAIL with what was expected and what came, or SKIP (an optional part the drafter
does not advertise, or a check left out with `--skip`); the exit status is 1 if any failed. Drafts are
compared between a sequence built by deltas and the same context sent whole: a drafter that drafts at
random fails that comparison unless `--nondeterministic` is given.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_sdk.drafter import CACHE_SALT, LEARNS_FROM_FINISHED, STREAM_RELEASES
from drafter_sdk.proto import drafter_pb2 as pb
from drafter_sdk.proto import drafter_pb2_grpc
from drafter_sdk.service.security import TOKEN_ENV_VAR, auth_metadata, read_token
from drafter_sdk.tree import TREE_CAPABILITY, tree_problem
from verifier_service.spec_decode.config import DEFAULT_CALL_DEADLINE_S
from verifier_service.tools.cli import add_client_security, open_channel

OK, RESYNC = pb.DRAFT_STATUS_OK, pb.DRAFT_STATUS_RESYNC_REQUIRED
SERVICE = pb.DESCRIPTOR.services_by_name["DrafterService"].full_name
# A context an n-gram or suffix drafter drafts from (it repeats), in ids any vocabulary holds.
PATTERN = [11, 12, 13, 14, 15, 16, 17] * 6
LARGE_TOKENS = 1_500_000  # ids of 3 bytes on the wire: a message of about 4.5 MB, past gRPC's default 4 MiB


class Failed(Exception):
    """What the check expected, and what came."""


class Skipped(Exception):
    """Why the check did not run."""


@dataclass
class Drafter:
    """The service under check, as a verifier calls it."""

    channel: grpc.Channel
    metadata: tuple[tuple[str, str], ...]
    timeout_s: float
    nondeterministic: bool
    deadline_ms: float
    run: str  # this run's part of every verifier id
    info: pb.GetDrafterInfoResponse | None = None

    @functools.cached_property
    def stub(self) -> drafter_pb2_grpc.DrafterServiceStub:  # made once: the latency check times calls, not this
        return drafter_pb2_grpc.DrafterServiceStub(self.channel)

    def verifier(self, check: str) -> str:
        return f"check-{self.run}-{check}"

    def prepare(self, verifier: str, *sequences: pb.DraftSequence) -> list[pb.DraftResult]:
        reply = self.stub.PrepareDraftTokens(pb.PrepareDraftTokensRequest(verifier_id=verifier, sequences=sequences),
                                             timeout=self.timeout_s, metadata=self.metadata)
        return list(reply.results)

    def one(self, verifier: str, sequence: pb.DraftSequence) -> pb.DraftResult:
        (result,) = expect_results(self.prepare(verifier, sequence), [sequence])
        return result

    def release(self, verifier: str, request_ids: list[str],
                reason: pb.ReleaseReason = pb.RELEASE_REASON_CANCELLED) -> int:
        reasons = [reason] * len(request_ids)  # CANCELLED: only the cache-salt check has a drafter learn one
        return self.stub.ReleaseRequests(pb.ReleaseRequestsRequest(verifier_id=verifier, request_ids=request_ids,
                                                                   reasons=reasons),
                                         timeout=self.timeout_s, metadata=self.metadata).released

    @property
    def capabilities(self) -> set[str]:
        return set(self.info.capabilities) if self.info is not None else set()

    @property
    def max_draft_len(self) -> int:
        return self.info.max_draft_len if self.info is not None else 0


def seq(request_id: str, context_len: int, new_tokens: list[int], draft_len: int = 4, prompt_len: int = 7,
        max_draft_nodes: int = 0, cache_salt_id: str = "") -> pb.DraftSequence:
    return pb.DraftSequence(request_id=request_id, context_len=context_len, new_tokens=new_tokens,
                            prompt_len=prompt_len, draft_len=draft_len, max_draft_nodes=max_draft_nodes,
                            cache_salt_id=cache_salt_id)


def expect_results(results: list[pb.DraftResult], asked: list[pb.DraftSequence]) -> list[pb.DraftResult]:
    ids = [r.request_id for r in results]
    if ids != [s.request_id for s in asked]:
        raise Failed(f"one result per sequence, in order, naming it: asked {[s.request_id for s in asked]}, "
                     f"answered {ids}")
    return results


def expect_status(result: pb.DraftResult, status: int, why: str) -> None:
    if result.status != status:
        raise Failed(f"{why}: expected {pb.DraftStatus.Name(status)}, got {pb.DraftStatus.Name(result.status)}")
    if status == RESYNC and result.draft_tokens:
        raise Failed(f"{why}: RESYNC_REQUIRED with draft tokens {list(result.draft_tokens)} (it must carry none)")


def expect_code(call: Callable[[], object], code: grpc.StatusCode, why: str) -> None:
    try:
        call()
    except grpc.RpcError as exc:
        if exc.code() != code:
            raise Failed(f"{why}: expected {code.name}, got {exc.code().name} ({exc.details()})") from None
        return
    raise Failed(f"{why}: expected {code.name}, the call succeeded")


def same_draft(d: Drafter, verifier: str, built: pb.DraftResult, context: list[int], why: str) -> None:
    """`built` (a sequence built by deltas) drafts as the same context sent whole does."""
    whole = d.one(verifier, seq(f"whole-{uuid.uuid4().hex[:8]}", 0, context, draft_len=4))
    d.release(verifier, [whole.request_id])
    if not d.nondeterministic and list(built.draft_tokens) != list(whole.draft_tokens):
        raise Failed(f"{why}: drafted {list(built.draft_tokens)}, the same context sent whole drafts "
                     f"{list(whole.draft_tokens)} (its held context is not the one sent; --nondeterministic if it "
                     "drafts at random)")


# --- the checks --------------------------------------------------------------------------------------------

def check_health(d: Drafter) -> str:
    health = health_pb2_grpc.HealthStub(d.channel)
    for service in ("", SERVICE):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=d.timeout_s).status
        if status != health_pb2.HealthCheckResponse.SERVING:
            raise Failed(f"grpc.health.v1 Check({service!r}): expected SERVING, got "
                         f"{health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
    return f"SERVING for '' and {SERVICE}, without a token"


def check_info(d: Drafter) -> str:
    d.info = d.stub.GetDrafterInfo(pb.GetDrafterInfoRequest(), timeout=d.timeout_s, metadata=d.metadata)
    if not d.info.name:
        raise Failed("GetDrafterInfo: name is empty")
    return (f"{d.info.name} {d.info.version}".strip() + f", max_draft_len {d.info.max_draft_len or 'any'}, vocab "
            f"{d.info.vocab_size or 'not given'}, capabilities {sorted(d.info.capabilities) or 'none'}")


def check_results(d: Drafter) -> str:
    v = d.verifier("results")
    asked = [seq(name, 0, PATTERN[i:], draft_len=n) for i, (name, n) in enumerate(zip("abc", (4, 2, 1)))]
    results = expect_results(d.prepare(v, *asked), asked)
    for r in results:
        expect_status(r, OK, f"a new sequence ({r.request_id})")
    d.release(v, ["a", "b", "c"])
    return "three sequences: three results in their order, each OK"


def check_bounds(d: Drafter) -> str:
    v = d.verifier("bounds")
    vocab, longest = d.info.vocab_size if d.info else 0, 0
    for draft_len in (1, 3, 8, 16):
        r = d.one(v, seq("a", 0, PATTERN, draft_len=draft_len))
        most = min(draft_len, d.max_draft_len) if d.max_draft_len else draft_len
        if len(r.draft_tokens) > most:
            raise Failed(f"draft_len {draft_len} (max_draft_len {d.max_draft_len or 'any'}): "
                         f"{len(r.draft_tokens)} draft tokens, at most {most} allowed")
        if r.draft_parents:
            raise Failed(f"max_draft_nodes 0 asks for a chain: got draft_parents {list(r.draft_parents)}")
        if bad := [t for t in r.draft_tokens if t < 0 or (vocab and t >= vocab)]:
            raise Failed(f"draft ids outside [0, {vocab or 'vocab'}): {bad}")
        longest = max(longest, len(r.draft_tokens))
    d.release(v, ["a"])
    if longest == 0:
        return "no draft at all from a repeating context (allowed, but nothing to verify: is it drafting?)"
    return f"drafts of at most min(draft_len, max_draft_len) ids, in the vocabulary (longest {longest})"


def check_deltas(d: Drafter) -> str:
    v = d.verifier("deltas")
    held = PATTERN[:30]
    expect_status(d.one(v, seq("a", 0, held)), OK, "a new sequence")
    more = PATTERN[30:33]
    expect_status(d.one(v, seq("a", len(held), more)), OK, "the tokens since the last call")
    held += more
    overlap = held[-2:] + PATTERN[33:35]  # two tokens it holds, two new
    r = d.one(v, seq("a", len(held) - 2, overlap))
    expect_status(r, OK, "an overlap (the first two new tokens already held)")
    held += PATTERN[33:35]
    same_draft(d, v, r, held, "after a whole context, an append and an overlap")
    d.release(v, ["a"])
    return "appends and overlaps applied: drafts as from the same context sent whole"


def check_resync(d: Drafter) -> str:
    v = d.verifier("resync")
    expect_status(d.one(v, seq("unknown", 12, PATTERN[12:20])), RESYNC, "a delta for a sequence never sent")
    held = PATTERN[:20]
    expect_status(d.one(v, seq("a", 0, held)), OK, "a new sequence")
    expect_status(d.one(v, seq("a", 25, PATTERN[25:27])), RESYNC, "a gap (context_len past what it holds)")
    r = d.one(v, seq("a", 0, PATTERN[:27]))
    expect_status(r, OK, "the whole context after a resync")
    expect_status(d.one(v, seq("a", 5, PATTERN[5:10])), RESYNC,
                  "a delta ending before what it holds (a contradiction)")
    expect_status(d.one(v, seq("a", 27, PATTERN[27:28])), RESYNC,
                  "the next delta after a contradiction (its state must have been dropped)")
    d.release(v, ["a"])
    return "unknown sequences, gaps and contradictions answered RESYNC_REQUIRED, with no draft"


def check_no_draft(d: Drafter) -> str:
    v = d.verifier("no-draft")
    expect_status(d.one(v, seq("a", 0, PATTERN[:20])), OK, "a new sequence")
    r = d.one(v, seq("a", 20, PATTERN[20:24], draft_len=0))
    expect_status(r, OK, "a delta with draft_len 0")
    if r.draft_tokens:
        raise Failed(f"draft_len 0: got draft tokens {list(r.draft_tokens)}")
    r = d.one(v, seq("a", 24, PATTERN[24:25]))
    expect_status(r, OK, "the delta after one with draft_len 0 (which must have been applied)")
    same_draft(d, v, r, PATTERN[:25], "after a delta with draft_len 0")
    d.release(v, ["a"])
    return "a delta with draft_len 0 is applied, with no draft"


def check_namespacing(d: Drafter) -> str:
    one, two = d.verifier("ns1"), d.verifier("ns2")
    expect_status(d.one(one, seq("a", 0, PATTERN[:20])), OK, "a new sequence")
    expect_status(d.one(two, seq("a", 20, PATTERN[20:22])), RESYNC,
                  "the same request_id from another verifier_id (state is keyed by both)")
    d.release(one, ["a"])
    return "state kept apart per (verifier_id, request_id)"


def check_release(d: Drafter) -> str:
    v = d.verifier("release")
    d.prepare(v, seq("a", 0, PATTERN[:20]), seq("b", 0, PATTERN[:21]))
    released = d.release(v, ["a", "b", "never-sent"])
    if released != 2:
        raise Failed(f"releasing two held sequences and one never sent: released {released}, expected 2")
    expect_status(d.one(v, seq("a", 20, PATTERN[20:22])), RESYNC, "a delta for a released sequence")
    d.release(v, ["a"])
    return "releases drop state and count what they dropped"


def check_validation(d: Drafter) -> str:
    v = d.verifier("validation")
    bad = grpc.StatusCode.INVALID_ARGUMENT
    expect_code(lambda: d.prepare("", seq("a", 0, PATTERN)), bad, "an empty verifier_id")
    expect_code(lambda: d.prepare(v, seq("a", 0, PATTERN), seq("a", 0, PATTERN)), bad, "a request_id twice")
    expect_code(lambda: d.prepare(v, seq("a", 0, PATTERN), seq("b", 0, [5, -3, 7])), bad, "a negative token id")
    expect_status(d.one(v, seq("a", len(PATTERN), [11])), RESYNC,
                  "a sequence of a refused request (the whole request is checked before any state changes)")
    return "malformed requests refused whole with INVALID_ARGUMENT, no state changed"


def check_stream(d: Drafter) -> str:
    v = d.verifier("stream")
    asked = [pb.PrepareDraftTokensStreamRequest(request=pb.PrepareDraftTokensRequest(
                 verifier_id=v, sequences=[seq("a", 0, PATTERN[:30])])),
             pb.PrepareDraftTokensStreamRequest(request=pb.PrepareDraftTokensRequest(
                 verifier_id=v, sequences=[seq("a", 30, PATTERN[30:33])]))]
    releases = STREAM_RELEASES in d.capabilities
    if releases:
        asked.append(pb.PrepareDraftTokensStreamRequest(release=pb.ReleaseRequestsRequest(
            verifier_id=v, request_ids=["a"], reasons=[pb.RELEASE_REASON_CANCELLED])))
    try:
        answers = list(d.stub.PrepareDraftTokensStream(iter(asked), timeout=d.timeout_s, metadata=d.metadata))
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise Skipped("PrepareDraftTokensStream is not served (optional, PROTOCOL.md §2a)") from None
        raise
    kinds = [a.WhichOneof("message") for a in answers]
    if kinds != ["response", "response", *(["released"] if releases else [])]:
        raise Failed(f"one answer per message, in order: sent {[m.WhichOneof('message') for m in asked]}, "
                     f"answered {kinds}")
    for answer, why in zip(answers[:2], ("a new sequence", "the tokens since the last message")):
        (result,) = expect_results(list(answer.response.results), list(asked[0].request.sequences))
        expect_status(result, OK, f"on the stream, {why}")
    same_draft(d, v, answers[1].response.results[0], PATTERN[:33], "on the stream")
    if releases and answers[2].released.released != 1:
        raise Failed(f"a release on the stream of one held sequence: released {answers[2].released.released}")
    if not releases:
        d.release(v, ["a"])
    return "one answer per message, in order, as PrepareDraftTokens answers" + (
        "; releases taken on the stream" if releases else "")


def check_trees(d: Drafter) -> str:
    if TREE_CAPABILITY not in d.capabilities:
        raise Skipped(f"no {TREE_CAPABILITY!r} capability (token trees are optional, PROTOCOL.md §6a)")
    v = d.verifier("trees")
    nodes = 0
    for draft_len, budget in ((4, 8), (2, 16), (6, 3)):
        r = d.one(v, seq("a", 0, PATTERN, draft_len=draft_len, max_draft_nodes=budget))
        parents = list(r.draft_parents) or [-1] + list(range(len(r.draft_tokens) - 1))  # empty: a chain
        depth = min(draft_len, d.max_draft_len) if d.max_draft_len else draft_len
        if problem := tree_problem(list(r.draft_tokens), parents, depth, budget):
            raise Failed(f"a tree of at most {budget} nodes and depth {draft_len}: {problem}")
        nodes = max(nodes, len(r.draft_tokens))
    d.release(v, ["a"])
    return f"valid trees within their node budget and depth (largest {nodes} nodes)"


def check_cache_salt(d: Drafter) -> str:
    """A finished output taught under one salt drafts for that salt again, and for no other salt and no unsalted
    sequence (PROTOCOL.md §7, "Cache salts keep tenants apart")."""
    if CACHE_SALT not in d.capabilities:
        raise Skipped(f"no {CACHE_SALT!r} capability (a verifier sends it no request with a cache salt)")
    v = d.verifier("cache-salt")
    mine, other = uuid.uuid4().hex, uuid.uuid4().hex
    expect_status(d.one(v, seq("a", 0, PATTERN, cache_salt_id=mine)), OK, "a sequence with a cache_salt_id")
    d.release(v, ["a"])
    if LEARNS_FROM_FINISHED not in d.capabilities:
        return f"salted sequences answered; no {LEARNS_FROM_FINISHED!r}, so nothing it learns crosses salts"
    taught = list(range(20, 60))  # a passage no other check sends, after a prompt of 7 of its own
    expect_status(d.one(v, seq("taught", 0, [61] * 7 + taught, draft_len=0, cache_salt_id=mine)), OK,
                  "a salted sequence finishing")
    d.release(v, ["taught"], pb.RELEASE_REASON_FINISHED)
    context, follows = [62, 63] + taught[10:20], taught[20]

    def drafts_on(salt: str, name: str) -> bool:
        r = d.one(v, seq(name, 0, context, cache_salt_id=salt))
        d.release(v, [name])
        return list(r.draft_tokens[:1]) == [follows]

    if not drafts_on(mine, "same-salt"):
        raise Skipped("it drafted nothing from a finished output under the same salt, so there is nothing to keep "
                      "apart (a drafter that learns only some outputs, or a cache scope of one request)")
    for salt, name in ((other, "another salt"), ("", "no salt")):
        if drafts_on(salt, name.replace(" ", "-")):
            raise Failed(f"a finished output taught under one cache_salt_id drafted for a sequence with {name}")
    return "a finished output drafts for its own salt again, and for neither another salt nor none"


def check_latency(d: Drafter, batch: int = 16, context: int = 512, calls: int = 30) -> str:
    v = d.verifier("latency")
    contexts = [[PATTERN[(i + j) % len(PATTERN)] for j in range(context)] for i in range(batch)]
    ids = [f"r{i}" for i in range(batch)]
    d.prepare(v, *(seq(rid, 0, ctx) for rid, ctx in zip(ids, contexts)))
    took = []
    for step in range(calls):
        sequences = [seq(rid, len(ctx), [PATTERN[(len(ctx) + k) % len(PATTERN)] for k in range(3)])
                     for rid, ctx in zip(ids, contexts)]
        started = time.perf_counter()
        results = d.prepare(v, *sequences)
        took.append(time.perf_counter() - started)
        for ctx, s, r in zip(contexts, sequences, results):
            if r.status != OK:
                raise Failed(f"call {step + 1} of {calls}: {r.request_id} answered {pb.DraftStatus.Name(r.status)}")
            ctx += s.new_tokens
    d.release(v, ids)
    p50, p99 = statistics.median(took) * 1000, sorted(took)[int(0.99 * (len(took) - 1))] * 1000
    figures = f"{batch} sequences of {context}+ tokens a call: p50 {p50:.1f} ms, p99 {p99:.1f} ms"
    if p99 > d.deadline_ms:
        raise Failed(f"{figures}: over the verifier's deadline of {d.deadline_ms:g} ms (--drafter-deadline-ms), "
                     "past which a step goes without drafts")
    return f"{figures}, within the {d.deadline_ms:g} ms deadline"


def check_large_message(d: Drafter) -> str:
    v = d.verifier("large")
    tokens = [20000 + i % 97 for i in range(LARGE_TOKENS)]
    try:
        r = d.one(v, seq("a", 0, tokens, prompt_len=LARGE_TOKENS))
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise Failed(f"a {LARGE_TOKENS:,}-token context (about 4.5 MB): RESOURCE_EXHAUSTED ({exc.details()}); "
                         "raise the receive limit above gRPC's default 4 MiB (PROTOCOL.md §11)") from None
        raise
    if r.status not in (OK, RESYNC):
        raise Failed(f"a {LARGE_TOKENS:,}-token context: status {pb.DraftStatus.Name(r.status)}")
    d.release(v, ["a"])
    return f"a {LARGE_TOKENS:,}-token context (about 4.5 MB) taken"


def check_auth(d: Drafter) -> str:
    if not d.metadata:
        raise Skipped("no token given (--auth-token-file or $" + TOKEN_ENV_VAR + ")")
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    stub = d.stub
    expect_code(lambda: stub.GetDrafterInfo(pb.GetDrafterInfoRequest(), timeout=d.timeout_s), unauthenticated,
                "a call without the token")
    expect_code(lambda: stub.GetDrafterInfo(pb.GetDrafterInfoRequest(), timeout=d.timeout_s,
                                            metadata=auth_metadata("not-the-token")), unauthenticated,
                "a call with a wrong token")
    return "calls without the token, or with a wrong one, refused UNAUTHENTICATED"


CHECKS: dict[str, Callable[[Drafter], str]] = {
    "health": check_health, "info": check_info, "results": check_results, "bounds": check_bounds,
    "deltas": check_deltas, "resync": check_resync, "no-draft": check_no_draft, "namespacing": check_namespacing,
    "release": check_release, "validation": check_validation, "stream": check_stream, "trees": check_trees,
    "cache-salt": check_cache_salt, "latency": check_latency, "large-message": check_large_message, "auth": check_auth}


def run_checks(d: Drafter, skip: set[str]) -> Iterator[tuple[str, str, str]]:
    """(check, PASS | FAIL | SKIP, detail) for each check, in order."""
    for name, check in CHECKS.items():
        if name in skip:
            yield name, "SKIP", "left out (--skip)"
            continue
        try:
            yield name, "PASS", check(d)
        except Skipped as exc:
            yield name, "SKIP", str(exc)
        except Failed as exc:
            yield name, "FAIL", str(exc)
        except grpc.RpcError as exc:
            yield name, "FAIL", f"the call failed: {exc.code().name} ({exc.details()})"


def main(args: argparse.Namespace) -> int:
    skip = set(filter(None, args.skip.split(","))) if args.skip else set()
    if unknown := skip - set(CHECKS):
        print(f"splitspec check-drafter: --skip: no check named {', '.join(sorted(unknown))}; checks: "
              f"{', '.join(CHECKS)}", file=sys.stderr)
        return 2
    try:
        token = read_token(args.auth_token_file)
        channel = open_channel(args, [("grpc.max_send_message_length", 64 << 20),
                                      ("grpc.max_receive_message_length", 64 << 20)])
    except (OSError, ValueError) as exc:
        print(f"splitspec check-drafter: {exc}", file=sys.stderr)
        return 2
    drafter = Drafter(channel, auth_metadata(token) if token else (), args.timeout, args.nondeterministic,
                      args.deadline_ms, uuid.uuid4().hex[:8])
    counts: dict[str, int] = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    with channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=args.timeout)
        except grpc.FutureTimeoutError:
            print(f"splitspec check-drafter: nothing answers at {args.target}", file=sys.stderr)
            return 2
        width = max(map(len, CHECKS))
        for name, outcome, detail in run_checks(drafter, skip):
            counts[outcome] += 1
            print(f"{outcome}  {name:<{width}}  {detail}", flush=True)
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="localhost:50052", help="the drafter service (host:port)")
    p.add_argument("--skip", metavar="CHECK,...", help=f"checks to leave out, of: {', '.join(CHECKS)}")
    p.add_argument("--nondeterministic", action="store_true",
                   help="the drafter drafts at random: do not compare drafts of the same context")
    p.add_argument("--deadline-ms", type=float, default=DEFAULT_CALL_DEADLINE_S * 1000,
                   help="the verifier's --drafter-deadline-ms that the latency check holds the p99 to "
                        f"(default {DEFAULT_CALL_DEADLINE_S * 1000:g})")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a call may take before it fails")
    add_client_security(p, "drafter")
    p.set_defaults(func=main)

