"""Tensor parallelism on torch.distributed: the process group, rank 0's broadcast of each step,
the other ranks' loop, and the watchdog that turns a dead or hung rank into a clean failure.

Every rank holds a shard of the model, cut by transformers' own tensor-parallel plan
(`DistributedConfig(tp_plan="auto")`: attention by heads, MLP by columns then rows, the
vocabulary projection gathered), and the same share of the KV cache: its KV heads / N. Every
rank runs the same packed forward; the model's own collectives (the all-reduce after each
row-parallel layer, the gather of the logits) ride the default process group: nccl on CUDA,
gloo on CPU. Only rank 0 serves, schedules, drafts and samples, so before each forward its
runner broadcasts the step's ForwardBatch once, and the followers run that forward and drop the
logits, which rank 0 alone reads (at the logit positions only).

Rank 0's messages go over a separate gloo group, the control channel: a few integers need no
device synchronisation, and gloo fails a send to a dead rank at once and to a stuck one within
its timeout. Each message is a header [kind, three counts, payload length], then its payload:

- FORWARD: the ForwardBatch's five integer lists, one after another, then its token trees'
  parents (count first) and K/V moves;
- LAYOUTS: on CPU, the linear-layout table rank 0 measured and chose (model/linear_layout.py),
  so that every rank runs the same kernels, during the start-up measurements too;
- HEARTBEAT: sent when idle, so a follower waiting for the next step never times out and a dead
  or stuck one is found while no request runs;
- STOP: clean shutdown.

Failure: the watchdog on rank 0 fails the group when a rank it started exits, when a step or a
heartbeat has not finished within `rank_timeout_s`, or when one raises: after a forward that
raised part-way, the ranks may be out of step, and only a restart puts them back together (a
follower whose forward raises exits, for the same reason). The owner's callback
(api/server.py) then fails the requests in flight with UNAVAILABLE, turns health NOT_SERVING
and exits non-zero, so that Kubernetes restarts the pod.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from verifier_service.model.linear_layout import Layout, LinearLayouts
from verifier_service.model.ranks import Ranks, backend_for
from verifier_service.model.runner import ForwardBatch, ModelRunner

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.05
_LAYOUTS = list(Layout)


class RankFailure(RuntimeError):
    """A rank died, hung or broke a collective: the group cannot run another step."""


class Kind(enum.IntEnum):
    FORWARD = 1
    LAYOUTS = 2
    HEARTBEAT = 3
    STOP = 4


def join(ranks: Ranks, device: torch.device) -> None:
    """Join the default process group (returns once every rank has joined)."""
    backend = backend_for(device)
    dist.init_process_group(backend, init_method=ranks.init_method, rank=ranks.rank, world_size=ranks.size,
                            device_id=device if backend == "nccl" else None)
    log.info("rank %d of %d joined (%s)", ranks.rank, ranks.size, backend)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rewrap_sharded_linears(model: PreTrainedModel) -> None:
    """Put transformers' tensor-parallel forwards back around the forwards LinearLayouts installed.

    Both live in the module's `forward` attribute, so installing the layouts replaced the sharded
    layers' wrappers (the all-reduce after a row-parallel layer, the gather of the logits). The
    plan's own styles wrap the layouts' forwards again; inside, the weights are the local shards.
    """
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    plan, _, _ = model._resolve_parallel_plans(model.config.distributed_config)
    mesh = model._mesh_manager.get_mesh("tp")
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module = modules.get(name)
        if isinstance(module, torch.nn.Linear):
            ALL_PARALLEL_STYLES[style].install_forward(module, mesh)


class Channel:
    """Rank 0's messages to the other ranks, on a gloo group of its own."""

    def __init__(self, timeout_s: float) -> None:
        # Every rank creates it, so it is also where they meet after loading.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def send(self, kind: Kind, counts: tuple[int, int, int] = (0, 0, 0), payload: list[int] | None = None) -> None:
        payload = payload or []
        dist.broadcast(torch.tensor([kind, *counts, len(payload)], dtype=torch.int64), src=0, group=self.group)
        if payload:
            dist.broadcast(torch.tensor(payload, dtype=torch.int64), src=0, group=self.group)

    def receive(self) -> tuple[Kind, list[int], list[int]]:
        header = torch.empty(5, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        kind, a, b, c, length = header.tolist()
        payload = torch.empty(length, dtype=torch.int64)
        if length:
            dist.broadcast(payload, src=0, group=self.group)
        return Kind(kind), [a, b, c], payload.tolist()


def _encode(batch: ForwardBatch) -> tuple[tuple[int, int, int], list[int]]:
    counts = (len(batch.input_ids), len(batch.slots), len(batch.logit_index))
    moves = [x for move in batch.kv_moves for x in move]
    return counts, [*batch.input_ids, *batch.slots, *batch.starts, *batch.lengths, *batch.logit_index,
                    len(batch.parents), *batch.parents, *moves]


def _decode(counts: list[int], payload: list[int]) -> ForwardBatch:
    tokens, rows, logits = counts
    cuts = [0, *itertools.accumulate([tokens, rows, rows, rows, logits])]
    batch = ForwardBatch(*(payload[a:b] for a, b in zip(cuts, cuts[1:])))
    trees = payload[cuts[-1]]  # then the token trees' parents, then the K/V moves as triples
    batch.parents = payload[cuts[-1] + 1:cuts[-1] + 1 + trees]
    moves = payload[cuts[-1] + 1 + trees:]
    batch.kv_moves = [tuple(moves[i:i + 3]) for i in range(0, len(moves), 3)]
    return batch


def _layout_message(layouts: LinearLayouts) -> tuple[tuple[int, int, int], list[int]]:
    table = layouts.table()
    packed = Layout.PACKED in layouts.available
    return (len(table), int(packed), 0), [*table, *(_LAYOUTS.index(layout) for layout in table.values())]


class Leader:
    """Rank 0's side of the group: the runner's `peers` (told each forward before it runs, and to
    stop when the runner closes) and the watchdog over the other ranks.

    `on_failure(reason)` is called once, from whichever thread finds the failure first.
    """

    def __init__(self, timeout_s: float, others: list[subprocess.Popen[bytes]],
                 on_failure: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self.heartbeat_s = min(2.0, timeout_s / 4)
        self.failure: str | None = None
        self._others = others  # ranks this process started (none under torchrun), rank i at i - 1
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._channel: Channel | None = None
        self._layouts: LinearLayouts | None = None
        self._sent_layouts: tuple[object, ...] | None = None
        self._model_thread: ThreadPoolExecutor | None = None
        self._busy: tuple[str, float] | None = None  # (what, monotonic start) while a collective runs
        self._last_message = time.monotonic()
        self._heartbeat_queued = False
        self._closed = False
        threading.Thread(target=self._watch, name="rank-watchdog", daemon=True).start()

    def connect(self, layouts: LinearLayouts | None, model_thread: ThreadPoolExecutor) -> None:
        """On the model thread, once the runner exists: meet the other ranks on the control
        channel; from now on every forward is broadcast, and idle time is filled with heartbeats."""
        self._channel = Channel(self.timeout_s)
        self._layouts = layouts
        self._last_message = time.monotonic()
        self._model_thread = model_thread

    @contextlib.contextmanager
    def step(self, batch: ForwardBatch) -> Iterator[None]:
        """Around one forward on rank 0: tell the other ranks to run it too."""
        with self._collective("forward"):
            self._send_layouts_if_changed()
            self._channel.send(Kind.FORWARD, *_encode(batch))
            yield

    def close(self) -> None:
        """On the model thread, last: tell the other ranks to stop (they exit 0)."""
        self._closed = True
        if self.failure is None and self._channel is not None:
            try:
                self._channel.send(Kind.STOP)
            except RuntimeError as exc:
                log.warning("could not tell the other ranks to stop: %s", exc)
        leave()

    def end_others(self, wait_s: float) -> None:
        """Wait up to `wait_s` for the ranks this process started to exit, then kill the rest."""
        deadline = time.monotonic() + wait_s
        for child in self._others:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def _send_layouts_if_changed(self) -> None:
        if self._layouts is None:
            return
        counts, payload = _layout_message(self._layouts)
        if (counts, payload) != self._sent_layouts:
            self._channel.send(Kind.LAYOUTS, counts, payload)
            self._sent_layouts = (counts, payload)

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        if self.failure is not None:
            raise RankFailure(self.failure)
        self._busy = (what, time.monotonic())
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - gloo reports a lost peer as a bare RuntimeError
            self._fail(f"a {what} failed: {exc}")
            raise RankFailure(self.failure) from exc
        finally:
            self._busy = None
            self._last_message = time.monotonic()

    def _heartbeat(self) -> None:
        try:
            with self._collective("heartbeat"):
                self._send_layouts_if_changed()
                self._channel.send(Kind.HEARTBEAT)
        except RankFailure:
            pass  # reported by _fail already
        finally:
            self._heartbeat_queued = False

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        log.error("tensor parallelism failed: %s", reason)
        self._on_failure(reason)

    def _watch(self) -> None:
        """Never touches torch: it reads timestamps and child processes, and queues heartbeats on
        the model thread."""
        while self.failure is None and not self._closed:
            time.sleep(WATCH_PERIOD_S)
            for rank, child in enumerate(self._others, start=1):
                if (code := child.poll()) is not None and not self._closed:
                    self._fail(f"rank {rank} exited with code {code}")
            busy = self._busy
            if busy is not None and time.monotonic() - busy[1] > self.timeout_s:
                self._fail(f"a {busy[0]} did not finish within {self.timeout_s:g} s (--rank-timeout-s): "
                           "a rank is stuck")
            elif (busy is None and self._model_thread is not None and not self._heartbeat_queued
                  and time.monotonic() - self._last_message > self.heartbeat_s):
                self._heartbeat_queued = True
                try:
                    self._model_thread.submit(self._heartbeat)
                except RuntimeError:  # the model thread has shut down: the verifier is stopping
                    return


def connect_follower(timeout_s: float) -> Channel:
    """A follower's side of `Leader.connect` (call once its runner exists)."""
    return Channel(timeout_s)


def follow(runner: ModelRunner, channel: Channel) -> None:
    """A follower's loop: run each forward rank 0 sends until it says STOP.

    Raises when rank 0 goes away or falls silent for the channel's timeout, or when a forward
    raises (the ranks may be out of step: this one exits, and rank 0 fails the group).
    """
    while True:
        kind, counts, payload = channel.receive()
        if kind is Kind.FORWARD:
            runner.forward(_decode(counts, payload))
        elif kind is Kind.LAYOUTS and runner.layouts is not None:
            points, packed = counts[0], counts[1]
            runner.layouts.choose({p: _LAYOUTS[i] for p, i in zip(payload[:points], payload[points:])})
            if not packed:
                runner.layouts.drop_unused_packing()
        elif kind is Kind.STOP:
            return
