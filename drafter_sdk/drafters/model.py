"""ModelDrafter: a small causal LM that drafts greedily, with its own KV cache kept in step.

Needs the `model-drafter` extra (torch, transformers); `import drafter_sdk` never imports it.

Per sequence the drafter holds the tokens its KV covers: the committed context
it last saw plus its own greedy continuation of it (the last draft, and with
drafting ahead the next one too). Each call keeps the longest common prefix of
what it holds and the committed context; rolling back rejected draft tokens is
a length change (their KV positions are overwritten later), never a copy. If
the context is a prefix of what it holds and that part is its own greedy
continuation, the draft is already there (a hit: no forward at all). Otherwise
the committed tokens it lacks run through the model in one packed forward for
every sequence of the call, then one forward per draft position drafts all
sequences at once.

Drafting ahead: once a call is answered, the drafter keeps extending each
sequence's greedy continuation by its draft length + 1 tokens, i.e. on the
assumption that the whole draft is accepted and the target's bonus token is the
draft model's own next choice. If the next call's context is exactly that, it
is a hit. The work runs on the drafter's model thread between calls and stops at
the next forward boundary once a new call or a release arrives.

All torch work (loading, every forward, KV allocation) runs on one model thread
of the drafter's own: on CPU, OpenMP regions entered from several threads made
later forwards slower (see verifier_service/builder.py). In a process that runs
another model on the CPU, the drafter takes that model's thread instead
(`model_thread`): the verifier's in-process DRAFT_TARGET decoded 96 tokens without
speculation in 3.2 s before its draft model first ran on a thread of its own, and
in 5.8 s after.

KV memory is bounded by `kv_cache_memory_gb`: each sequence owns K/V tensors
grown in blocks; a sequence that does not fit gets no draft instead of an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from drafter_sdk.drafter import Drafter, DraftRequest, Key
from drafter_sdk.loading import causal_lm, layer_attention
from drafter_sdk.loading.tokenizer_fingerprint import tokenizer_fingerprint

log = logging.getLogger(__name__)

ATTENTION = "splitspec_draft_packed"
STEP_KWARG = "splitspec_draft_step"
BLOCK_TOKENS = 64  # KV grows in blocks of this many positions
T = TypeVar("T")


@dataclass
class DraftStats:
    """Counters of what the drafter did, for `splitspec bench` and logs."""

    lookups: int = 0  # sequences asked for a draft
    hits: int = 0  # answered from what was already drafted (ahead), without a forward
    no_room: int = 0  # no draft: the sequence did not fit the KV budget or the model's positions
    catch_up_tokens: int = 0  # committed tokens run through the model
    forwards: int = 0  # forwards while answering calls
    ahead_forwards: int = 0  # forwards run ahead, between calls

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(eq=False)
class _Sequence:
    """What the drafter holds for one key. K/V rows 0..len(tokens)-1 are valid."""

    k: torch.Tensor  # [layers, kv_heads, capacity, head_dim]
    v: torch.Tensor
    tokens: list[int] = field(default_factory=list)
    committed: int = 0  # how many of `tokens` are the committed context last seen (immutable)
    # tokens[i] for i >= greedy_from is the model's greedy choice after tokens[:i] ...
    greedy_from: int = 0
    # ... and next_token its choice after all of them (-1: not known, e.g. before any forward).
    next_token: int = -1

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def chain(self, start: int, length: int) -> list[int]:
        """The greedy continuation from `start`, as far as it is known (at most `length` tokens)."""
        known = self.tokens[start:start + length]
        if len(known) < length and self.next_token >= 0 and start <= len(self.tokens):
            known.append(self.next_token)
        return known


class _PackedStep:
    """One forward over several sequences' new tokens packed into one row (as the verifier's runner)."""

    def __init__(self, rows: list[tuple[_Sequence, int, int]], device: torch.device) -> None:
        self.rows: list[tuple[int, int, _Sequence, int, torch.Tensor | None]] = []
        positions: list[int] = []
        offset = 0
        self.device = device
        self._visible: dict[tuple[int, int | None], torch.Tensor] = {}  # by (row, window), for the layers that need it
        for seq, start, n in rows:
            # queries see keys up to their own position
            mask = layer_attention.chain_visible(start, n, None, device) if n > 1 else None
            self.rows.append((offset, n, seq, start, mask))
            positions += range(start, start + n)
            offset += n
        self.positions = torch.tensor([positions], device=device)

    def _visible_mask(self, row: int, window: int | None) -> torch.Tensor:
        """[n, start + n] bool: which keys the row's queries see, within `window` where one is set."""
        if (row, window) not in self._visible:
            _, n, _, start, _ = self.rows[row]
            self._visible[row, window] = layer_attention.chain_visible(start, n, window, self.device)
        return self._visible[row, window]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, attention: layer_attention.LayerAttention) -> torch.Tensor:
        outputs = []
        window = attention.window
        for row, (offset, n, seq, start, mask) in enumerate(self.rows):
            k_cache, v_cache = seq.k[layer], seq.v[layer]
            k_cache[:, start:start + n] = key[0, :, offset:offset + n]
            v_cache[:, start:start + n] = value[0, :, offset:offset + n]
            bound = layer_attention.binding(window, start + n)
            if not attention.fused:
                outputs.append(layer_attention.attend(
                    query[:, :, offset:offset + n], k_cache[None, :, :start + n], v_cache[None, :, :start + n],
                    self._visible_mask(row, bound), scaling if scaling is not None else query.shape[-1] ** -0.5,
                    attention))
                continue
            if bound is not None:
                mask = self._visible_mask(row, bound)
            outputs.append(F.scaled_dot_product_attention(
                query[:, :, offset:offset + n], k_cache[None, :, :start + n], v_cache[None, :, :start + n],
                attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]))
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
        return out.transpose(1, 2)


def _packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
    step = kwargs.pop(STEP_KWARG, None)
    if not isinstance(step, _PackedStep):  # called outside a drafter forward, e.g. by generate()
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    return step.attend(module.layer_idx, query, key, value, scaling, layer_attention.from_kwargs(kwargs)), None


def _log_failure(future: Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        # Only a lost head start: the next call rolls back to what it finds and drafts as usual.
        log.error("drafting ahead failed", exc_info=future.exception())


class ModelDrafter(Drafter):
    name = "model"
    version = "1.0"
    capabilities = ("draft-model", "greedy")

    def __init__(self, model: str | None = None, device: str = "auto", dtype: str = "auto", max_draft_len: int = 8,
                 kv_cache_memory_gb: float = 1.0, draft_ahead: bool = True,
                 loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase] | None = None,
                 model_thread: Executor | None = None) -> None:
        """`model`: a folder, a .gguf file or None for the embedded SmolLM2; `loaded` passes a model and
        tokenizer already in memory instead (tests, the verifier in-process). `model_thread`: the thread
        whose torch work the drafter shares (it must not be blocked on the drafter's calls); the drafter
        does not shut it down, and drafts nothing ahead, which would hold it between calls.

        A model that is not there, or a device or dtype torch does not have, raises
        drafter_sdk.errors.ModelLoadError here, before the drafter serves, not in `load()`."""
        if max_draft_len < 1:
            raise ValueError("max_draft_len must be at least 1")
        if kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be positive")
        if loaded is None:
            self._source = causal_lm.resolve_source(model)
            self._device = causal_lm.pick_device(device)
            self._dtype = causal_lm.pick_dtype(dtype, self._device)
            causal_lm.load_config(self._source)  # a hub name that cannot be fetched fails here
        self.max_draft_len = max_draft_len
        self.kv_budget_bytes = int(kv_cache_memory_gb * 2**30)
        self.draft_ahead = draft_ahead and model_thread is None
        self.stats = DraftStats()
        self._loaded = loaded
        self._model: PreTrainedModel | None = None
        self._sequences: dict[Key, _Sequence] = {}
        self._used_bytes = 0
        self._kv_shape = (0, 0, 0, 0)  # layers, KV heads, key and value head sizes: known once loaded
        self._bytes_per_token = 0
        self._host_kv = True
        self._max_positions = 0
        # Bumped by every call from the SDK's worker: drafting ahead stops when it changes.
        self._generation = 0
        self._own_thread = model_thread is None
        self._model_thread = model_thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-model")

    # --- Drafter API (called on the SDK's worker thread) ---

    def load(self) -> None:
        self._on_model_thread(self._load)

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts, answered = self._on_model_thread(self._prepare, requests)
        if self.draft_ahead and answered:
            ahead = self._model_thread.submit(self._draft_ahead, answered, self._generation)
            ahead.add_done_callback(_log_failure)
        return drafts

    def on_release(self, key: Key) -> None:
        self._on_model_thread(self._drop, key)

    def state_bytes(self, key: Key) -> int:
        """Host KV memory held for `key` (0 on a GPU)."""
        seq = self._sequences.get(key)
        return seq.capacity * self._bytes_per_token if seq is not None and self._host_kv else 0

    def shared_state_bytes(self) -> int:
        """Nothing is shared between sequences (the weights are not state)."""
        return 0

    def wait_idle(self) -> None:
        """Return once drafting ahead is done (without stopping it early)."""
        self._model_thread.submit(lambda: None).result()

    @property
    def kv_bytes_used(self) -> int:
        return self._used_bytes

    def close(self) -> None:
        self._generation += 1
        if self._own_thread:
            self._model_thread.shutdown(wait=True, cancel_futures=True)

    # --- on the model thread ---

    def _on_model_thread(self, fn: Callable[..., T], *args: object) -> T:
        self._generation += 1  # stops drafting ahead at its next forward boundary
        return self._model_thread.submit(fn, *args).result()

    def _load(self) -> None:
        if self._loaded is not None:
            model, tokenizer = self._loaded
            self._loaded = None
        else:
            tokenizer = causal_lm.load_tokenizer(self._source)
            model = causal_lm.load_causal_lm(self._source, self._dtype, self._device)
        AttentionInterface.register(ATTENTION, _packed_attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
        model.set_attn_implementation(ATTENTION)
        cfg = model.config.get_text_config()
        heads = cfg.num_attention_heads
        self._kv_shape = (cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads,
                          *layer_attention.kv_head_dims(cfg))
        layers, kv_heads, k_dim, v_dim = self._kv_shape
        self._bytes_per_token = layers * kv_heads * (k_dim + v_dim) * torch.empty((), dtype=model.dtype).element_size()
        # The SDK's state budget protects host memory: a GPU's KV is bounded by --kv-cache-memory-gb alone.
        self._host_kv = model.device.type == "cpu"
        self._max_positions = getattr(cfg, "max_position_embeddings", None) or 1 << 30
        self._model = model
        self._base = model.base_model
        self._head = model.get_output_embeddings()
        self._no_mask = torch.empty(1, 1, 0, 0, device=model.device, dtype=model.dtype)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.tokenizer = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        log.info("draft model on %s (%s): %d layers, KV %.0f KiB per token, budget %.2f GiB, draft ahead %s",
                 model.device, str(model.dtype).removeprefix("torch."), layers, self._bytes_per_token / 1024,
                 self.kv_budget_bytes / 2**30,
                 "on" if self.draft_ahead else "off" if self._own_thread else "off (on the caller's model thread)")

    def _prepare(self, requests: list[DraftRequest]) -> tuple[list[list[int]], list[tuple[Key, int, int]]]:
        """Drafts, and for drafting ahead each drafted key with its context length and draft length."""
        drafts: list[list[int]] = [[] for _ in requests]
        wanted: list[tuple[int, _Sequence, int, int]] = []  # (index, sequence, context length, draft length)
        catch_up: list[tuple[_Sequence, int, list[int]]] = []
        with torch.inference_mode():
            for i, request in enumerate(requests):
                if request.draft_len <= 0:
                    continue  # the next draft catches up on its history
                self.stats.lookups += 1
                k = min(request.draft_len, self.max_draft_len)
                seq = self._sync(request.key, request.tokens, k, catch_up)
                if seq is None:
                    self.stats.no_room += 1
                    continue
                wanted.append((i, seq, len(request.tokens), k))
            if catch_up:
                self._catch_up(catch_up)
            self._extend([(seq, c + k) for _, seq, c, k in wanted], lambda: True)
        for i, seq, c, k in wanted:
            drafts[i] = seq.chain(c, k)
        return drafts, [(requests[i].key, c, len(drafts[i])) for i, _, c, _ in wanted if drafts[i]]

    def _sync(self, key: Key, context: Sequence[int], k: int,
              catch_up: list[tuple[_Sequence, int, list[int]]]) -> _Sequence | None:
        """Bring the key's state in step with `context`; None when it does not fit."""
        c = len(context)
        if c == 0 or c + k > self._max_positions:
            return None
        seq = self._sequences.get(key)
        if seq is None:
            seq = self._allocate(key, c + 2 * k + 1)
            if seq is None:
                return None
        # The committed part matches (the SDK's store drops a key whose history changed); compare the rest.
        p, limit = min(seq.committed, c), min(len(seq.tokens), c)
        while p < limit and seq.tokens[p] == context[p]:
            p += 1
        seq.committed = c
        if p == c and c >= seq.greedy_from and (c < len(seq.tokens) or seq.next_token >= 0):
            # Context is a prefix of what is held and its greedy continuation is known from there: a hit
            # if the whole draft is known already (else the draft forwards extend it, and it is no hit).
            if len(seq.chain(c, k)) == k:
                self.stats.hits += 1
            return seq
        keep = min(p, c - 1)  # the last committed token always runs: its logits give the first draft token
        del seq.tokens[keep:]  # rollback: a length change
        seq.greedy_from, seq.next_token = c, -1
        if not self._reserve(seq, c + k):
            self._drop(key)
            return None
        catch_up.append((seq, keep, list(context[keep:c])))
        return seq

    def _catch_up(self, rows: list[tuple[_Sequence, int, list[int]]]) -> None:
        tokens = [t for _, _, new in rows for t in new]
        choices = self._forward(tokens, [(seq, start, len(new)) for seq, start, new in rows])
        self.stats.forwards += 1
        self.stats.catch_up_tokens += len(tokens)
        for (seq, _, new), choice in zip(rows, choices):
            seq.tokens.extend(new)
            seq.next_token = choice

    def _extend(self, targets: list[tuple[_Sequence, int]], go_on: Callable[[], bool], ahead: bool = False) -> None:
        """One forward per position: grow each sequence's greedy chain (tokens + next_token) to its target."""
        while go_on():
            rows = [seq for seq, target in targets
                    if seq.next_token >= 0 and len(seq.tokens) + 1 < target and self._reserve(seq, len(seq.tokens) + 1)]
            if not rows:
                return
            choices = self._forward([seq.next_token for seq in rows], [(seq, len(seq.tokens), 1) for seq in rows])
            if ahead:
                self.stats.ahead_forwards += 1
            else:
                self.stats.forwards += 1
            for seq, choice in zip(rows, choices):
                seq.tokens.append(seq.next_token)
                seq.next_token = choice

    def _draft_ahead(self, answered: list[tuple[Key, int, int]], generation: int) -> None:
        """Extend each answered sequence to the next step's draft, assuming all accepted + the model's bonus."""
        live = [(seq, c + 2 * k + 1) for key, c, k in answered if (seq := self._sequences.get(key)) is not None]
        with torch.inference_mode():
            self._extend(live, lambda: self._generation == generation, ahead=True)

    def _forward(self, input_ids: list[int], rows: list[tuple[_Sequence, int, int]]) -> list[int]:
        """Greedy next token after the last new token of each row."""
        assert self._model is not None
        device = self._model.device
        step = _PackedStep(rows, device)
        out = self._base(input_ids=torch.tensor([input_ids], device=device), position_ids=step.positions,
                         attention_mask=self._no_mask, use_cache=False, **{STEP_KWARG: step})
        last, offset = [], 0
        for _, _, n in rows:
            offset += n
            last.append(offset - 1)
        hidden = out.last_hidden_state[0].index_select(0, torch.tensor(last, device=device))
        return self._head(hidden).argmax(dim=-1).tolist()

    # --- KV memory ---

    def _allocate(self, key: Key, tokens: int) -> _Sequence | None:
        capacity = self._fit(0, tokens)
        if capacity == 0:
            return None
        assert self._model is not None
        layers, kv_heads, k_dim, v_dim = self._kv_shape
        dtype, device = self._model.dtype, self._model.device
        seq = _Sequence(torch.zeros(layers, kv_heads, capacity, k_dim, dtype=dtype, device=device),
                        torch.zeros(layers, kv_heads, capacity, v_dim, dtype=dtype, device=device))
        self._used_bytes += capacity * self._bytes_per_token
        self._sequences[key] = seq
        return seq

    def _reserve(self, seq: _Sequence, tokens: int) -> bool:
        """Make room for `tokens` positions (grows by doubling within the budget); whether it fits."""
        if tokens <= seq.capacity:
            return True
        capacity = self._fit(seq.capacity, tokens)
        if capacity == 0:
            return False
        grown_k = seq.k.new_zeros(seq.k.shape[:2] + (capacity,) + seq.k.shape[3:])
        grown_v = seq.v.new_zeros(seq.v.shape[:2] + (capacity,) + seq.v.shape[3:])
        n = len(seq.tokens)
        grown_k[:, :, :n] = seq.k[:, :, :n]
        grown_v[:, :, :n] = seq.v[:, :, :n]
        self._used_bytes += (capacity - seq.capacity) * self._bytes_per_token
        seq.k, seq.v = grown_k, grown_v
        return True

    def _fit(self, current: int, tokens: int) -> int:
        """The capacity to grow from `current` to for `tokens` positions; 0 when it does not fit."""
        tokens = min(tokens, self._max_positions)
        free = (self.kv_budget_bytes - self._used_bytes) // self._bytes_per_token + current
        for want in (max(tokens, 2 * current), tokens):
            capacity = min(-(-want // BLOCK_TOKENS) * BLOCK_TOKENS, self._max_positions)
            if capacity <= free:
                return capacity
        return 0

    def _drop(self, key: Key) -> None:
        seq = self._sequences.pop(key, None)
        if seq is not None:
            self._used_bytes -= seq.capacity * self._bytes_per_token

    # --- for tests: the K/V the drafter holds for a key ---

    def kv_of(self, key: Key) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The tokens held for `key` and their K and V (copies), [layers, kv_heads, len, head_dim]."""
        def copy() -> tuple[list[int], torch.Tensor, torch.Tensor]:
            seq = self._sequences[key]
            n = len(seq.tokens)
            return list(seq.tokens), seq.k[:, :, :n].clone(), seq.v[:, :, :n].clone()
        return self._on_model_thread(copy)
