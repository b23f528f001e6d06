"""SuffixDecoding: drafts from each request's own context and from every finished output.

SuffixDecoding (Oliaro et al., arXiv 2411.04975; vLLM's `method="suffix"`, from
Snowflake's Arctic Inference) keeps two kinds of suffix tree (suffix_index.py):

- one per request, over its prompt and the tokens generated so far, grown from
  the delta stream as the SDK rebuilds it;
- a global one over finished requests' outputs (and, with `cache_prompts`, their
  prompts), at most `max_cached_requests` of them and `max_cached_mib` of memory,
  oldest evicted first: a count alone would let a client with long outputs grow
  it by gigabytes (10,000 outputs of 32,000 tokens hold about 4 GiB).

Each step, both trees look for the context's last <= `max_tree_depth` tokens and
propose their best-scoring greedy continuation; the third difference below says
which of the two is drafted. No match, no draft. Each request keeps where its
context matched in both trees (suffix_index.Cursor) and extends that by the
tokens it gained at the next step.

Three deliberate differences from Arctic Inference, measured by replays against
greedy outputs (BENCHMARKS.md). The first two are for copy-heavy loops (an agent sending
back its last answer with a small edit: the text to copy is in the request's own
context):

- the own tree does not count the context's own end as an occurrence: it has no
  continuation yet, and counting it halves the estimate of a passage seen once
  before, which then loses to weaker evidence in the global tree;
- `own_spec_factor` (8.0) caps a draft from the own tree at that many times its
  match length; the global tree keeps `max_spec_factor` (vLLM's 1.0). After each
  edit the match restarts short, and a factor of 1 drafts only as far as it
  matched; at 8, even a one-token match may draft the verifier's default 8 tokens,
  as prompt lookup does, and `min_token_prob` alone stops it.
  own_spec_factor == max_spec_factor is vLLM's rule.

The third decides between the two trees. Arctic Inference takes the higher score;
with `prefer_longer_match` (the default) the draft that follows the longer match
wins, the higher score only between equal matches (the own tree on a tie). A score
is a sum of probabilities estimated after its own match, and the two trees' estimates
are not alike: a passage the request's context holds once gives each of its tokens
probability 1, so a one- or two-token match in the own tree outscored a three- or
four-token match in the global tree that predicted better. As variable-order Markov
predictors do, the longer context is trusted first (BENCHMARKS.md: templated answers ran 1.20x
and 1.31x the n-gram drafter in two runs, against 1.17x). With `learn_choice` (the
default) that rule is where the drafter starts: both trees draft wherever either could win,
and what the verifier then accepts teaches it after which pairs of match lengths the other
tree drafts better (suffix_choice.py). Either way, the tree that drafted the request's last
step is searched first (it likely holds the longer match again), and the other only where
it holds a match that could win (by the rule alone: one as long as that draft's). A
request copying its own context then skips the global tree's search, and one answered
from other requests' outputs skips its own.

As a service, one suffix drafter behind many verifiers learns from all of their
outputs. `cache_scope` bounds that: "global" (every verifier, vLLM's
process-wide cache), "verifier" (one tree per verifier id) or "request" (no
global tree). Sharing never changes an output, since every draft is verified,
but how fast a request runs can tell whether similar text was generated for
someone else: scope it where that matters. Within any scope, requests with a
cache salt (`cache_salt_id`) share a global tree only with those of the same
salt, as the verifier's prefix cache shares KV.

Where the verifier verifies token trees (`max_draft_nodes` > 0), the drafter
answers SuffixDecoding's speculation tree instead of its greedy path: grown
best-first by estimated path probability from the match whose path scored best
(suffix_index.SuffixIndex.speculate_tree), so nodes go to the continuations the
two trees have seen most, as far as `min_token_prob`; its first branch is the
chain it would have drafted.

Only outputs the verifier released as FINISHED are learned; cancelled, failed
and evicted ones are dropped. The verifier sends the last tokens of a finished
request before releasing it to drafters that advertise `LEARNS_FROM_FINISHED`.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from drafter_sdk.drafter import CACHE_SALT, LEARNS_FROM_FINISHED, LOOKAHEAD, Drafter, DraftRequest, Key, ReleaseReason
from drafter_sdk.drafters import suffix_snapshot
from drafter_sdk.drafters.suffix_choice import LONG_MATCH, RECHECK_EVERY, ChoiceTable, Trial, bucket, pending_trials
from drafter_sdk.drafters.suffix_index import Cursor, Draft, SuffixIndex, draft_budget
from drafter_sdk.tree import TREE_CAPABILITY, DraftTree

CACHE_SCOPES = ("global", "verifier", "request")


@dataclass
class _Metrics:
    drafts: dict[str, Counter]  # by tree: own, global, none
    tokens: dict[str, Counter]  # by tree: own, global
    evicted: Counter

    def count(self, own: bool, tokens: int) -> None:
        tree = "none" if not tokens else "own" if own else "global"
        self.drafts[tree].inc()
        if tokens:
            self.tokens[tree].inc(tokens)


@dataclass
class _Request:
    tree: SuffixIndex  # its whole context, prompt first
    prompt_len: int
    salt: str  # its cache salt's id ("": unsalted): which global tree of its scope it drafts from and feeds
    # Its matches in its own tree and in its global tree, carried from step to step.
    own: Cursor = field(default_factory=Cursor)
    shared: Cursor = field(default_factory=Cursor)
    own_won: bool = False  # whether its own tree drafted last step: that tree is searched first
    trials: deque[Trial] = field(default_factory=pending_trials)  # both trees' drafts, until tokens settle them
    choice_steps: int = 0  # drafting steps that chose between the trees (learn_choice): every 16th rechecks


class SuffixDrafter(Drafter):
    name = "suffix"
    version = "1.0"
    capabilities = ("suffix", LEARNS_FROM_FINISHED, TREE_CAPABILITY, LOOKAHEAD, CACHE_SALT)
    runs_inline = True  # well under a millisecond a sequence

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1, cache_prompts: bool = False,
                 cache_scope: str = "global", own_spec_factor: float = 8.0, prefer_longer_match: bool = True,
                 learn_choice: bool = True, max_cached_mib: float = 256.0) -> None:
        if max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be at least 2, not {max_tree_depth}")
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must not be negative, not {max_cached_requests}")
        if not max_cached_mib > 0:
            raise ValueError(f"max_cached_mib must be positive, not {max_cached_mib}")
        if max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must not be negative, not {max_spec_factor}")
        if own_spec_factor < 0:
            raise ValueError(f"own_spec_factor must not be negative, not {own_spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be within [0, 1], not {min_token_prob}")
        if cache_scope not in CACHE_SCOPES:
            raise ValueError(f"cache_scope must be one of {', '.join(CACHE_SCOPES)}, not {cache_scope!r}")
        self.max_tree_depth = max_tree_depth
        self.max_draft_len = max_tree_depth - 1  # a match of one token leaves that much depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_mib = max_cached_mib  # every scope's global tree together
        self.max_spec_factor = max_spec_factor
        self.own_spec_factor = own_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.cache_prompts = cache_prompts
        self.cache_scope = cache_scope
        self.prefer_longer_match = prefer_longer_match
        self.learn_choice = learn_choice
        self._requests: dict[Key, _Request] = {}
        self._global: dict[str, SuffixIndex] = {}  # by scope: "" for global, the verifier id for verifier
        self._choices: dict[str, ChoiceTable] = {}  # by scope, beside its global tree
        self._rule = ChoiceTable()  # never learns: the longer-match rule alone (learn_choice off)
        self._learned: deque[str] = deque()  # the scope of each cached output, oldest first
        self._metrics: _Metrics | None = None  # where the server exports metrics (register_metrics)

    # --- the Drafter API ---

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Which tree drafts, and what the global trees hold: whether learning from other requests pays."""
        drafts = Counter("splitspec_drafter_suffix_drafts", "Drafts asked for, by the tree that drafted: the "
                         "request's own context (own), other requests' finished outputs (global), or none "
                         "(no match)", ["tree"], registry=registry)
        tokens = Counter("splitspec_drafter_suffix_draft_tokens", "Draft tokens proposed (token-tree nodes), by "
                         "the tree they came from", ["tree"], registry=registry)
        self._metrics = _Metrics({tree: drafts.labels(tree) for tree in ("own", "global", "none")},
                                 {tree: tokens.labels(tree) for tree in ("own", "global")},
                                 Counter("splitspec_drafter_suffix_evicted_outputs", "Finished outputs evicted "
                                         "from the global trees past --max-cached-requests or --max-cached-mib",
                                         registry=registry))
        Gauge("splitspec_drafter_suffix_cached_outputs", "Finished outputs held in the global trees",
              registry=registry).set_function(lambda: len(self._learned))

    def prepare_draft_tokens(self, requests: list[DraftRequest]) -> list[list[int] | DraftTree]:
        drafts: list[list[int] | DraftTree] = []
        for r in requests:
            self._sync(r)
            if not r.draft_len:
                drafts.append([])
                continue
            draft = (self.draft(r.key, r.tokens, r.draft_len) if not r.max_draft_nodes
                     else self.draft_tree(r.key, r.tokens, r.draft_len, r.max_draft_nodes))
            drafts.append(draft)
            if self._metrics is not None:
                self._metrics.count(self._requests[r.key].own_won, len(draft))
        return drafts

    def on_release(self, key: Key, reason: ReleaseReason = ReleaseReason.UNSPECIFIED) -> None:
        state = self._requests.pop(key, None)
        if state is None or reason != ReleaseReason.FINISHED:
            return
        scope = self._scope(key, state.salt)
        if scope is None or self.max_cached_requests == 0:
            return
        tokens = state.tree.tokens()
        learned = tokens if self.cache_prompts else tokens[state.prompt_len:]
        if learned:
            self._learn(scope, learned)

    def state_bytes(self, key: Key) -> int:
        state = self._requests.get(key)
        if state is None:
            return 0
        return (state.tree.nbytes() + state.own.nbytes() + state.shared.nbytes()
                + sum(trial.nbytes() for trial in state.trials))

    def shared_state_bytes(self) -> int:
        return sum(tree.nbytes() for tree in self._global.values())

    def save_learned(self) -> bytes:
        """Every cached output and each scope's learned choice (suffix_snapshot.py)."""
        names = list(self._global)
        index = {name: i for i, name in enumerate(names)}
        scopes = [suffix_snapshot.Scope(name, *self._global[name].packed(), dict(self._choices[name].gains))
                  for name in names]
        return suffix_snapshot.encode(suffix_snapshot.Snapshot(
            self.cache_scope, scopes, array("i", [index[name] for name in self._learned])))

    def restore_learned(self, data: bytes) -> None:
        """What `save_learned` gave, learned again in order under this drafter's caps (the oldest
        evicted past them); ValueError for a snapshot of another cache scope, which would share
        outputs where this drafter's scope keeps them apart, or leave them where none is looked up."""
        snapshot = suffix_snapshot.decode(data)
        if snapshot.cache_scope != self.cache_scope:
            raise ValueError(f"the snapshot's outputs were learned with cache scope {snapshot.cache_scope!r}, "
                             f"this drafter's is {self.cache_scope!r}")
        self._global.clear()
        self._choices.clear()
        self._learned.clear()
        if self.max_cached_requests == 0:
            return
        for scope, tokens in snapshot.outputs():
            self._learn(scope, tokens)
        for scope in snapshot.scopes:
            if scope.name in self._choices:
                self._choices[scope.name] = ChoiceTable(scope.gains)

    # --- drafting ---

    def draft(self, key: Key, tokens: Sequence[int], draft_len: int) -> list[int]:
        """The better of the request's own tree's draft and its global tree's (the own one on a tie)."""
        return self._best(key, tokens, draft_len)[1].tokens

    def draft_tree(self, key: Key, tokens: Sequence[int], max_depth: int, max_nodes: int) -> DraftTree:
        """The speculation tree of the index and match `draft` drafts from, within that match's
        draft length (the spec factor's cap) and `max_depth`."""
        index, best, own = self._best(key, tokens, max_depth)
        if not best.tokens:
            return DraftTree([], [])
        factor = self.own_spec_factor if own else self.max_spec_factor
        depth = draft_budget(best.match_len, max_depth, factor, self.max_spec_offset, self.max_tree_depth)
        state = self._requests[key]
        tree = index.speculate_tree(tokens, best.match_len, depth, max_nodes, self.min_token_prob, own=own,
                                    cursor=state.own if own else state.shared)
        return DraftTree(tree.tokens, tree.parents)

    def _best(self, key: Key, tokens: Sequence[int], draft_len: int) -> tuple[SuffixIndex, Draft, bool]:
        """(index, its best draft, whether it is the request's own) for whichever tree drafts the
        better path (module docstring): the own tree's wins a tie."""
        state = self._requests[key]
        scope = self._scope(key, state.salt)
        shared = self._global.get(scope) if scope is not None else None
        if shared is None:
            index, draft, own = state.tree, self._own(state, tokens, draft_len), True
        elif not self.prefer_longer_match:
            index, draft, own = self._by_score(state, shared, tokens, draft_len)
        else:
            choices = self._choices[scope] if self.learn_choice else None
            index, draft, own = self._by_longer_match(state, shared, choices, tokens, draft_len)
        state.own_won = own and bool(draft.tokens)
        return index, draft, own

    def _by_longer_match(self, state: _Request, shared: SuffixIndex, choices: ChoiceTable | None,
                         tokens: Sequence[int], draft_len: int) -> tuple[SuffixIndex, Draft, bool]:
        """The draft after the longer match wins, corrected by what `choices` learned (suffix_choice.py;
        None: the rule alone). The tree that drafted last step goes first: it likely holds the longer
        match again. The other is searched only where it holds a match the table says could win (under
        the rule alone: one as long as the first one's). A learning table also has the other searched on
        every RECHECK_EVERY-th step, and the own tree after any global match shorter than LONG_MATCH:
        its drafts there are what the table learns to overrule the rule from. Where both trees draft, it
        keeps both as a trial."""
        table = self._rule if choices is None else choices
        recheck, skip_own_from = False, 0
        if choices is not None:
            state.choice_steps += 1
            recheck, skip_own_from = state.choice_steps % RECHECK_EVERY == 0, LONG_MATCH
        longest = min(len(tokens), self.max_tree_depth)
        if state.own_won:
            mine = self._own(state, tokens, draft_len)
            if mine.tokens and not recheck:
                rival = table.shortest_rival(mine.match_len, True, longest)
                if rival > longest or rival >= 2 and not shared.occurs(tokens, rival):
                    return state.tree, mine, True
            theirs = self._theirs(state, shared, tokens, draft_len)
        else:
            theirs = self._theirs(state, shared, tokens, draft_len)
            if theirs.match_len >= skip_own_from and not recheck:
                rival = table.shortest_rival(theirs.match_len, False, longest)
                if rival > longest or rival >= 2 and not state.tree.occurs(tokens, rival, own=True):
                    return shared, theirs, False
            mine = self._own(state, tokens, draft_len)
        if not (mine.tokens and theirs.tokens):
            return (state.tree, mine, True) if mine.tokens or not theirs.tokens else (shared, theirs, False)
        if choices is not None and (not state.trials or state.trials[-1].at != len(tokens)):  # asked again: one
            state.trials.append(Trial(len(tokens), (bucket(mine.match_len), bucket(theirs.match_len)), mine.tokens,
                                      theirs.tokens))
        if table.own_wins(mine.match_len, theirs.match_len, mine.score >= theirs.score):
            return state.tree, mine, True
        return shared, theirs, False

    def _by_score(self, state: _Request, shared: SuffixIndex, tokens: Sequence[int],
                  draft_len: int) -> tuple[SuffixIndex, Draft, bool]:
        """vLLM's rule: the higher score wins. The own draft need only score at least as much as the global
        one: just above the next lower float."""
        theirs = self._theirs(state, shared, tokens, draft_len)
        if not theirs.tokens:
            return state.tree, self._own(state, tokens, draft_len), True
        mine = self._own(state, tokens, draft_len, beat=math.nextafter(theirs.score, -math.inf))
        return (state.tree, mine, True) if mine.tokens else (shared, theirs, False)

    def _own(self, state: _Request, tokens: Sequence[int], draft_len: int, beat: float = 0.0) -> Draft:
        return state.tree.speculate(tokens, draft_len, self.own_spec_factor, self.max_spec_offset, self.min_token_prob,
                                    beat=beat, cursor=state.own, own=True)

    def _theirs(self, state: _Request, shared: SuffixIndex, tokens: Sequence[int], draft_len: int) -> Draft:
        return shared.speculate(tokens, draft_len, self.max_spec_factor, self.max_spec_offset, self.min_token_prob,
                                cursor=state.shared)

    @property
    def cached_requests(self) -> int:
        """Finished requests held in the global trees."""
        return len(self._learned)

    def _sync(self, r: DraftRequest) -> _Request:
        """Bring the request's tree up to its committed tokens (it only grows between releases)."""
        state = self._requests.get(r.key)
        if state is None or state.tree.num_tokens > len(r.tokens) or state.salt != r.cache_salt_id:
            state = self._requests[r.key] = _Request(SuffixIndex(self.max_tree_depth), r.prompt_len, r.cache_salt_id)
            state.tree.add(r.tokens)
        elif state.tree.num_tokens < len(r.tokens):
            state.tree.extend(r.tokens[state.tree.num_tokens:])
            choices = self._choices.get(self._scope(r.key, state.salt)) if state.trials else None
            if choices is not None:
                choices.learn(state.trials, r.tokens)
            else:  # its global tree has gone (all evicted) since they were drafted
                state.trials.clear()
        return state

    def _learn(self, scope: str, tokens: Sequence[int]) -> None:
        """Add a finished output to the scope's global tree, then evict the oldest outputs past the caps
        (one larger than the whole byte cap evicts everything, itself included)."""
        tree = self._global.get(scope)
        if tree is None:
            tree = self._global[scope] = SuffixIndex(self.max_tree_depth)
            self._choices[scope] = ChoiceTable()
        tree.add(tokens)
        self._learned.append(scope)
        while self._learned and (len(self._learned) > self.max_cached_requests
                                 or self.shared_state_bytes() > self.max_cached_mib * (1 << 20)):
            oldest = self._learned.popleft()
            tree = self._global[oldest]
            tree.evict_oldest()
            if self._metrics is not None:
                self._metrics.evicted.inc()
            if not len(tree):
                del self._global[oldest], self._choices[oldest]

    def _scope(self, key: Key, salt: str) -> str | None:
        """Which global tree the request drafts from and feeds; None: none. A salt's tree is its
        scope's name, NUL, the salt's id (the SDK refuses a verifier id that holds a NUL)."""
        if self.cache_scope == "request":
            return None
        scope = "" if self.cache_scope == "global" else key[0]
        return f"{scope}\0{salt}" if salt else scope
