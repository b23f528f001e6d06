"""CUDA graphs for decode and verify steps: one replay instead of a forward's thousand-odd launches.

On a GPU a small model's eager forward is bound by the host issuing kernels, not by the GPU
running them. On an H200 whose host ran Python at 56 ns a loop, a one-token forward of a model of
SmolLM2-135M's shapes took 30.4 ms eager, 2.2 ms of it on the GPU, and 2.45 ms as a graph replay.
vLLM and SGLang capture their decode steps for the same reason.

A graph replays fixed shapes in fixed memory, so a step is captured under a key of what it fixes:
- the number of rows (sequences), padded to a power of two by repeating the first row, but not their
  KV slots: which slot each row reads and writes is an input, so a batch whose sequences come and go,
  or move to other slots, keeps its graphs, and batches of 5 to 8 sequences share one;
- the row length L: every row padded to the power of two at or above the longest, and a step of
  drafts to at least MIN_DRAFT_STEP_LENGTH, so a draft length that changes from step to step keeps
  one graph;
- the attention window W: each row attends over its slot's first W positions, W the power of two
  at or above the longest row's end (at least MIN_WINDOW), so one graph serves a sequence from W/2
  to W tokens. Keys past a row's own position are masked out.
- whether a row is a token tree (model/tree_attention.py): then each token's position and which
  of its row's new tokens it sees are inputs too, not computed from the row's start.
A key is captured the second time it is seen (a batch that changes every step stays eager), and the
`max_graphs` most recently used are kept. Decode and verify steps of every batch size up to the KV
cache's sequences, and one sequence's token trees and prompt chunks, are captured at start-up
(`capture_ahead`). A capture stalls the step that makes it (a warm-up forward, the captured
one, and instantiating the graph), so keys are few and many are kept.

Padding every row to the longest would make a prompt's chunk beside decode rows a step of rows x
chunk tokens, over `max_tokens`. Such a step runs as one graph per length of row instead (decode
and verify rows in one, the chunk in another, each keyed as above), one replay after the other:
with a step budget of `max_tokens` (builder.calibrate), chunked prefill stays in the graphs. A
step that no grouping fits, and token trees with rows over MAX_TREE_LENGTH, run eagerly; so does
every step of a sharded model (builder.make_runner).

What changes between replays goes in through static device tensors: the token ids, each row's slot
and start (chains compute positions, K/V write positions and masks from the starts inside the graph),
and for trees the positions and each row's ancestor matrix. A padding token computes what no one
reads: it writes its K/V into its own row's slot after the row's real tokens, positions past the
sequence's committed length, which no prefix-cache block covers, which no tree's accepted path is
moved from, and which the row's next real tokens overwrite before any query reads them. A padding
row repeats the first row: the same tokens at the same positions of the same slot, so it writes
what that row writes, and its outputs are not read.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafter_sdk.loading import layer_attention
from verifier_service.model.kv_cache import KVCache
from verifier_service.model.tree_attention import ancestors, is_chain_row

log = logging.getLogger(__name__)

MIN_WINDOW = 256  # keys attended over by the shortest graphs: below that, fewer graphs beat fewer reads
# A step whose rows carry more than one token (drafts, chunks) is padded to at least this many tokens a
# row: on an H200 a forward of 2 to 17 tokens cost the same 3.7-3.9 ms, and lengths 2, 4 and 8 would be
# three graphs, three captures, for a draft length the planner or the drafter changes step by step.
MIN_DRAFT_STEP_LENGTH = 8
MAX_TREE_LENGTH = 64  # padded tokens of a row in a token-tree graph (its ancestor matrices go in each step)


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def batch_rows(n: int) -> int:
    """The rows a step of n sequences runs as."""
    return _power_of_two_at_least(n)


def padded_length(n: int) -> int:
    """A row of n tokens, padded: a decode row stays 1, longer rows go to a power of two, at least
    MIN_DRAFT_STEP_LENGTH."""
    return 1 if n == 1 else _power_of_two_at_least(max(n, MIN_DRAFT_STEP_LENGTH))


@dataclass(frozen=True)
class GraphKey:
    rows: int  # sequences in the step, padded to a power of two (their slots are inputs)
    length: int  # tokens per row, padded
    window: int  # keys each row attends over
    tree: bool = False  # some row is a token tree: positions and ancestor matrices are inputs


class StaticStep:
    """runner.PackedStep's attention for fixed shapes: rows of `key.length` tokens over `key.window`
    keys, each row's slot and start read from device tensors [rows]; for a tree key also the tokens'
    positions [rows * length] and each row's ancestor matrix [rows, length, length]."""

    def __init__(self, cache: KVCache, key: GraphKey, slots: torch.Tensor, starts: torch.Tensor,
                 tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.cache = cache
        self.key = key
        self.slots = slots
        n, device = key.length, starts.device
        offsets = torch.arange(n, device=device)
        self.write_positions = starts[:, None] + offsets[None, :]  # [rows, length]
        heads = torch.arange(cache.shape.num_kv_heads, device=device)
        # Where the new K/V go: cache[layer][slot, head, position], [rows, heads, length] of them.
        self.write_index = (slots[:, None, None], heads[None, :, None], self.write_positions[:, None, :])
        keys = torch.arange(key.window, device=device)
        # Computed within the forward (so within a capture) at the first layer with its sliding window.
        self._windowed: dict[int, torch.Tensor] = {}
        if tree is None:  # chains: causal
            self.positions = self.write_positions.reshape(1, -1)  # [1, rows * length]
            self.masks = keys[None, None, :] <= self.write_positions[:, :, None]  # [rows, length, window]
            self.key_positions = keys[None, :]  # [1, window]
            return
        positions, seen = tree
        self.positions = positions.view(1, -1)
        # The cached context, and within the row's own new tokens its ancestors.
        offset = keys[None, :] - starts[:, None]  # [rows, window]: key position within the new tokens
        new = (offset >= 0) & (offset < n)
        own = seen.gather(2, offset.clamp(0, n - 1)[:, None, :].expand(-1, n, -1))  # [rows, length, window]
        self.masks = (offset < 0)[:, None, :] | (own & new[:, None, :])
        # [rows, window]: a new node's key sits at its depth's position, not at its K/V index
        self.key_positions = torch.where(new, positions.view(key.rows, n).gather(1, offset.clamp(0, n - 1)), keys)

    def _masks(self, window: int | None) -> torch.Tensor:
        """[rows, length, window] bool: which keys each token sees, within a sliding window where one is set."""
        if window is None or window >= self.key.window:  # no query sees a key `window` positions back
            return self.masks
        if window not in self._windowed:
            queries = self.positions.view(self.key.rows, self.key.length)
            self._windowed[window] = self.masks & layer_attention.in_window(queries, self.key_positions, window)
        return self._windowed[window]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, attention: layer_attention.LayerAttention = layer_attention.PLAIN
               ) -> torch.Tensor:
        """Every row at once: rows are the batch of one attention, since they share a length and a window."""
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # [slots, kv heads, capacity, head_dim]
        rows, n, window = self.key.rows, self.key.length, self.key.window

        def by_row(x: torch.Tensor) -> torch.Tensor:  # [1, heads, rows * n, D] -> [rows, heads, n, D]
            return x[0].unflatten(1, (rows, n)).transpose(0, 1)

        k_cache.index_put_(self.write_index, by_row(key))
        v_cache.index_put_(self.write_index, by_row(value))
        # Each row's window of its slot: a copy of `window` keys, the price of slots given as inputs.
        keys = k_cache[:, :, :window].index_select(0, self.slots)
        values = v_cache[:, :, :window].index_select(0, self.slots)
        masks = self._masks(attention.window)[:, None]
        if attention.fused:
            out = F.scaled_dot_product_attention(by_row(query), keys, values, attn_mask=masks, scale=scaling,
                                                 enable_gqa=query.shape[1] != key.shape[1])  # [rows, heads, n, D]
        else:
            out = layer_attention.attend(by_row(query), keys, values, masks,
                                         scaling if scaling is not None else query.shape[-1] ** -0.5, attention)
        return out.transpose(1, 2).reshape(1, rows * n, out.shape[1], out.shape[3])  # [1, N, heads, D]


@dataclass
class _Captured:
    # [rows * length + 2 * rows (+ rows * length)] long: the padded token ids, the rows' slots and starts
    # (and for a tree key the tokens' positions)
    inputs: torch.Tensor
    seen: torch.Tensor | None = None  # tree keys: [rows, length, length] bool, each row's ancestor matrix
    hidden: torch.Tensor | None = None  # [rows * length, hidden]: the last hidden states, rewritten by each run
    graph: torch.cuda.CUDAGraph | None = None  # None: run the static forward eagerly (capture off)


# The model body over packed input ids [1, N] with a step's attention: last hidden states [1, N, hidden].
RunBody = Callable[[torch.Tensor, StaticStep], torch.Tensor]


class StepGraphs:
    """The runner's captured steps. `capture` False runs the same fixed-shape steps without
    capturing them (a CPU has no CUDA graphs; the tests check the shapes' arithmetic there)."""

    def __init__(self, run_body: RunBody, cache: KVCache, max_tokens: int, max_graphs: int = 128,
                 capture: bool = True) -> None:
        self.run_body = run_body
        self.cache = cache
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.capture = capture
        self.device = cache.k.device
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._graphs: OrderedDict[GraphKey, _Captured] = OrderedDict()
        self._seen: OrderedDict[GraphKey, None] = OrderedDict()  # keys met once, not captured
        self.enabled = True
        self.captures = 0
        self.replays = 0  # steps run as a graph (without capture: at a graph's shapes)

    def key(self, slots: list[int], starts: list[int], lengths: list[int], tree: bool = False) -> GraphKey | None:
        """The graph a step of these rows runs as (`tree`: some row is a token tree), or None: it runs
        eagerly."""
        if not self.enabled or not slots:
            return None
        length = padded_length(max(lengths))
        capacity = self.cache.shape.capacity
        rows = batch_rows(len(slots))
        if (length * rows > self.max_tokens or (tree and length > MAX_TREE_LENGTH)
                or any(start + length > capacity for start in starts)):
            return None
        end = max(start + n for start, n in zip(starts, lengths))
        window = min(capacity, max(MIN_WINDOW, _power_of_two_at_least(end)))
        return GraphKey(rows, length, window, tree)

    def groups(self, slots: list[int], starts: list[int], lengths: list[int],
               parents: list[int]) -> list[tuple[GraphKey, list[int]]] | None:
        """The graphs a step of these rows runs as, each with the rows (indices into the step) it runs;
        None: it runs eagerly. One graph for all rows where they have a key. Otherwise, as where a
        prompt's chunk beside decode rows would pad every row to the chunk's length, rows are grouped by
        their padded length, shortest first, as many lengths together as keep a key: a graph each."""
        if not self.enabled or not slots:
            return None
        key = self.key(slots, starts, lengths, tree=bool(parents))
        if key is not None:
            return [(key, list(range(len(slots))))]
        offsets = list(itertools.accumulate(lengths, initial=0))
        # A group is a tree only if one of its rows is: a chunk is a chain, and tree keys stop at MAX_TREE_LENGTH.
        tree = [bool(parents) and not is_chain_row(parents[offsets[r]:offsets[r + 1]]) for r in range(len(slots))]

        def key_of(rows: list[int]) -> GraphKey | None:
            return self.key([slots[r] for r in rows], [starts[r] for r in rows], [lengths[r] for r in rows],
                            any(tree[r] for r in rows))

        by_length: dict[int, list[int]] = {}
        for r, n in enumerate(lengths):
            by_length.setdefault(padded_length(n), []).append(r)
        if len(by_length) < 2:
            return None
        out: list[tuple[GraphKey, list[int]]] = []
        rows: list[int] = []
        for length in sorted(by_length):
            grown, grown_key = rows + by_length[length], key_of(rows + by_length[length])
            if grown_key is None and key is not None:  # the rows so far are a graph; these start the next
                out.append((key, rows))
                grown, grown_key = by_length[length], key_of(by_length[length])
            if grown_key is None:
                return None
            rows, key = grown, grown_key
        assert key is not None
        return [*out, (key, rows)]

    def hidden_states(self, input_ids: list[int], slots: list[int], starts: list[int], lengths: list[int],
                      logit_index: list[int], parents: list[int]) -> torch.Tensor | None:
        """A step of these rows (runner.ForwardBatch's fields): the last hidden states at the packed
        positions `logit_index` [len(logit_index), hidden], or None where it runs eagerly (no graphs for
        it; a graph's first sighting; a capture that failed)."""
        groups = self.groups(slots, starts, lengths, parents)
        if groups is None:
            return None
        fresh = [key for key, _ in groups if key not in self._graphs and key not in self._seen]
        if fresh:
            for key in fresh:
                self._seen[key] = None
            while len(self._seen) > 4 * self.max_graphs:
                self._seen.popitem(last=False)
            return None
        if len(groups) == 1:
            return self._replay(groups[0][0], input_ids, slots, starts, lengths, parents, logit_index)
        offsets = list(itertools.accumulate(lengths, initial=0))
        group_of = [0] * offsets[-1]  # packed position -> its row's group
        for g, (_, rows) in enumerate(groups):
            for r in rows:
                group_of[offsets[r]:offsets[r + 1]] = [g] * lengths[r]
        out: torch.Tensor | None = None
        for g, (key, rows) in enumerate(groups):
            packed = [p for r in rows for p in range(offsets[r], offsets[r + 1])]  # the group's tokens, in order
            local = {p: i for i, p in enumerate(packed)}
            picked = [k for k, p in enumerate(logit_index) if group_of[p] == g]
            hidden = self._replay(key, [input_ids[p] for p in packed], [slots[r] for r in rows],
                                  [starts[r] for r in rows], [lengths[r] for r in rows],
                                  [parents[p] for p in packed] if key.tree else [],
                                  [local[logit_index[k]] for k in picked])
            if hidden is None:  # a capture failed: graphs are off; the step runs eagerly (the same K/V again)
                return None
            if out is None:
                out = hidden.new_empty(len(logit_index), hidden.shape[1])
            out.index_copy_(0, torch.tensor(picked, dtype=torch.long, device=self.device), hidden)
        return out

    def _replay(self, key: GraphKey, input_ids: list[int], slots: list[int], starts: list[int], lengths: list[int],
                parents: list[int], logit_index: list[int]) -> torch.Tensor | None:
        """One graph's rows (capturing it at its second sighting): their hidden states at `logit_index`,
        copied out of the graph's memory before another graph of the step replays (graphs share a
        memory pool, so one captured earlier may reuse where this one's output lies)."""
        captured = self._graphs.get(key)
        padded = [r * key.length + i for r, n in enumerate(lengths) for i in range(n)]  # packed -> padded
        values, seen = self._inputs(key, padded, input_ids, slots, starts, lengths, parents)
        if captured is None:
            self._seen.pop(key, None)  # seen, or captured and then evicted by this step's other graph
            captured = self._capture(key, values, seen)
            if captured is None:
                return None
        else:
            self._graphs.move_to_end(key)
            captured.inputs.copy_(torch.tensor(values))
            if seen is not None:
                assert captured.seen is not None
                captured.seen.copy_(seen)
            self._run(key, captured)
        assert captured.hidden is not None
        index = torch.tensor([padded[p] for p in logit_index], dtype=torch.long, device=self.device)
        return captured.hidden.index_select(0, index)

    def capture_ahead(self, shapes: list[tuple[int, int, bool]], max_window: int) -> int:
        """Capture steps before serving, so that the first requests do not stall on them: for each
        (rows, tokens, tree) of `shapes`, that many rows of that many tokens (decode, verify, a prompt's
        chunk; a token tree where `tree`), after contexts at every window up to `max_window`. Every row
        runs in one borrowed free KV slot, whose K/V it leaves as garbage. `max_graphs` grows to twice
        their number where it was less. Returns how many shapes it captured (0 where a capture failed:
        graphs are then off)."""
        slot = self.cache.allocate()
        steps: dict[GraphKey, tuple[int, int, int, bool]] = {}  # each shape's first (rows, start, tokens, tree)
        window = MIN_WINDOW
        while window <= min(max_window, self.cache.shape.capacity):
            for rows, n, tree in shapes:
                # After a context that needs this window (a row over half of it needs it from the start).
                start = window // 2 if window > MIN_WINDOW and n <= window // 2 else 0
                key = self.key([slot] * rows, [start] * rows, [n] * rows, tree)
                if key is not None:
                    steps.setdefault(key, (rows, start, n, tree))
            window *= 2
        self.max_graphs = max(self.max_graphs, 2 * len(steps))  # what is captured ahead is kept, with room
        try:
            for rows, start, n, tree in steps.values():
                parents = [-1, *range(n - 1)] * rows if tree else []  # chains given as trees
                for _ in range(2):  # seen, then captured
                    self.hidden_states([0] * (rows * n), [slot] * rows, [start] * rows, [n] * rows, [n - 1],
                                       parents)
        finally:
            self.cache.free(slot)
        return len(steps) if self.enabled else 0

    @staticmethod
    def _inputs(key: GraphKey, padded: list[int], input_ids: list[int], slots: list[int], starts: list[int],
                lengths: list[int], parents: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """_Captured.inputs' values (the token ids at their padded places, the slots, the starts, for a
        tree key the position ids) and for a tree key its ancestor matrices; padding rows repeat row 0."""
        pad = key.rows - len(lengths)
        if pad:
            n = lengths[0]
            padded = padded + [r * key.length + i for r in range(len(lengths), key.rows) for i in range(n)]
            input_ids = input_ids + input_ids[:n] * pad
            parents = parents + parents[:n] * pad if parents else parents
            slots, starts, lengths = slots + [slots[0]] * pad, starts + [starts[0]] * pad, lengths + [n] * pad
        values = [0] * (key.rows * key.length) + slots + starts
        for p, token in zip(padded, input_ids):
            values[p] = token
        if not key.tree:
            return values, None
        positions, seen = StepGraphs._tree_inputs(key, starts, lengths, parents)
        return values + positions, seen

    @staticmethod
    def _tree_inputs(key: GraphKey, starts: list[int], lengths: list[int],
                     parents: list[int]) -> tuple[list[int], torch.Tensor]:
        """Each padded token's position id, and each row's ancestor matrix [rows, length, length]
        (model/tree_attention.py; a chain row's is causal, a padding token sees itself)."""
        n = key.length
        positions: list[int] = []
        seen = torch.zeros(len(lengths), n, n, dtype=torch.bool)
        seen.diagonal(dim1=1, dim2=2).fill_(True)
        offset = 0
        for r, (start, length) in enumerate(zip(starts, lengths)):
            row_seen, depth = ancestors(parents[offset:offset + length])
            seen[r, :length, :length] = torch.tensor(row_seen)
            positions += [start + d for d in depth] + list(range(start + length, start + n))
            offset += length
        return positions, seen

    def _forward(self, key: GraphKey, captured: _Captured) -> torch.Tensor:
        tokens, rows = key.rows * key.length, key.rows
        tree = None
        if captured.seen is not None:
            tree = (captured.inputs[tokens + 2 * rows:], captured.seen)
        slots, starts = captured.inputs[tokens:tokens + rows], captured.inputs[tokens + rows:tokens + 2 * rows]
        step = StaticStep(self.cache, key, slots, starts, tree)
        return self.run_body(captured.inputs[:tokens].view(1, -1), step)[0]

    def _run(self, key: GraphKey, captured: _Captured) -> None:
        if captured.graph is not None:
            captured.graph.replay()
        else:
            captured.hidden = self._forward(key, captured)
        self.replays += 1

    def _capture(self, key: GraphKey, values: list[int], seen: torch.Tensor | None) -> _Captured | None:
        captured = _Captured(torch.tensor(values, device=self.device),
                             None if seen is None else seen.to(self.device))
        if not self.capture:
            self._keep(key, captured)
            self._run(key, captured)
            return captured
        try:
            graph = self._record(key, captured)
        except RuntimeError as e:
            log.warning("capturing a CUDA graph failed (%s); steps run eagerly from now on", e)
            self.enabled = False
            return None
        captured.graph = graph
        self.captures += 1
        self._keep(key, captured)
        self._run(key, captured)
        return captured

    def _record(self, key: GraphKey, captured: _Captured) -> torch.cuda.CUDAGraph:
        with torch.cuda.device(self.device):
            # A warm-up on a side stream first (lazy initialisations must not be captured). It runs this
            # step's own inputs, so what it writes into the KV cache is what the replay writes again.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(key, captured)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work (an in-process draft model) does not break the capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                captured.hidden = self._forward(key, captured)
        return graph

    def _keep(self, key: GraphKey, captured: _Captured) -> None:
        self._graphs[key] = captured
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
