"""A starting replica takes what its peers learned (GetLearnedState), instead of relearning it from traffic.

Every replica of a learning drafter hears of every finished request (PROTOCOL.md section 7), so
the replicas of one Service hold about the same. One that starts empty, added by a scale-out or
replacing a pod in a rollout (where an emptyDir state file died with the old pod), asks its peers
before it serves: up to `max_asked` of the addresses of `target`, in random order, until one's
answer restores. A peer that is down, unreachable, still loading itself (as this replica is, should
the target list it), refuses, or answers what the drafter cannot restore (another configuration) is
skipped: like every drafter fault, a replica that finds no peer starts cold, which costs speed,
never an answer. Asking is bounded (`max_asked` peers, each `connect_timeout_s` to connect and
`timeout_s` to answer), so a network that drops the calls delays the start, never stops it.

The questions run on the drafter's worker thread, with gRPC's blocking API, inside `load`: the
event loop goes on answering health checks (NOT_SERVING until then), and a server that stops
meanwhile ends them at once (`Asking.cancel`) instead of waiting for their deadlines.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from drafter_sdk.proto import drafter_pb2, drafter_pb2_grpc
from drafter_sdk.service.addresses import lookup, parse_target
from drafter_sdk.service.lifecycle import MIB
from drafter_sdk.service.security import auth_metadata

log = logging.getLogger(__name__)

# A piece of a GetLearnedState answer: well under gRPC's default 4 MiB receive limit.
CHUNK_BYTES = 1 << 20
# With named tokens (security.read_named_tokens), the token replicas send each other.
PEERS_TOKEN_NAME = "peers"


@dataclass(frozen=True)
class Peers:
    target: str  # the gRPC target of every replica (a headless Service's dns:/// name, an ipv4: list)
    credentials: grpc.ChannelCredentials | None = None  # TLS to the peers; None: plaintext
    token: str | None = None  # a bearer token the peers accept
    timeout_s: float = 60.0  # for one peer's whole answer, once connected
    connect_timeout_s: float = 5.0  # a peer not connected by then is skipped (a firewall that drops)
    max_asked: int = 3  # any ready peer holds what another does: past a few, none is likely to answer

    @property
    def longest_s(self) -> float:
        """The longest asking can take: every peer asked connecting and answering at its deadline."""
        return self.max_asked * (self.connect_timeout_s + self.timeout_s)

    def restore(self, restore_learned: Callable[[bytes, str], bool], name: str, asking: Asking | None = None
                ) -> bool:
        """Give `restore_learned` (`DrafterServicer.restore_learned`: data, and where it came from for the
        log) peers' states until one is taken; False where none was, or once `asking` was cancelled."""
        asking = asking or Asking()
        host, port, given = parse_target(self.target)
        addresses = lookup(host, port, given)
        random.shuffle(addresses)
        for address in addresses[:self.max_asked]:
            if asking.cancelled:
                log.info("%s stops asking its peers: the server stops", name)
                return False
            start = time.perf_counter()
            try:
                data = self._ask(address, host, asking)
            except grpc.RpcError as exc:
                log.info("peer %s gave no learned state: %s %s", address, exc.code().name, exc.details())
                continue
            if not restore_learned(data, f"of peer {address}"):  # it replaces what the drafter holds
                continue
            log.info("%s restored the learned state of peer %s (%.1f MiB) in %.2f s", name, address,
                     len(data) / MIB, time.perf_counter() - start)
            return True
        log.info("no peer at %s gave %s a learned state (%d address%s)", self.target, name, len(addresses),
                 "" if len(addresses) == 1 else "es")
        return False

    def _ask(self, address: str, host: str, asking: Asking) -> bytes:
        # gRPC gives a connection attempt this long (20 s by default), and fails the call past it.
        options = [("grpc.min_reconnect_backoff_ms", round(self.connect_timeout_s * 1000))]
        if self.credentials is not None and host:
            options.append(("grpc.ssl_target_name_override", host))  # a certificate names the Service, not a pod
        channel = (grpc.secure_channel(address, self.credentials, options=options)
                   if self.credentials is not None else grpc.insecure_channel(address, options=options))
        with channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            answers = stub.GetLearnedState(drafter_pb2.GetLearnedStateRequest(), timeout=self.timeout_s,
                                           metadata=auth_metadata(self.token) if self.token else None)
            asking.follow(answers)
            return b"".join(answer.chunk for answer in answers)


@dataclass
class Asking:
    """One replica's questions to its peers, which `cancel` ends from any thread: the one in flight at
    once (it fails CANCELLED), the next ones before they start."""

    cancelled: bool = False
    _call: grpc.Call | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def follow(self, call: grpc.Call) -> None:
        with self._lock:
            self._call = call
            if self.cancelled:
                call.cancel()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            if self._call is not None:
                self._call.cancel()


def pieces(data: bytes) -> list[bytes]:
    """`data` cut into GetLearnedState answers of at most CHUNK_BYTES each (one empty one for no data)."""
    return [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
