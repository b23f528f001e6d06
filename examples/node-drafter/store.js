'use strict';
// Per-sequence drafter state and the overlapping-delta/resync protocol of
// splitspec.v1.DrafterService (see protos/PROTOCOL.md, section 4).
//
// A delta (context_len, new_tokens) places new_tokens[0] at offset
// context_len of the committed context, which never changes. Holding H
// tokens, a delta with context_len <= H <= context_len + new_tokens.length
// fits: its first H - context_len tokens repeat what is held and are skipped,
// the rest is appended. Verifiers re-send the last few steps in every call,
// so a replica behind a round-robin balancer that missed a few steps catches
// up without a resync.
//
// State is keyed by (verifier_id, request_id): request ids are unique only
// within one verifier. Map iteration order doubles as an LRU list (entries
// are re-inserted when used), which makes both the capacity bound and idle
// eviction cheap.

const { NgramSequence } = require('./ngram');

const OK = 'DRAFT_STATUS_OK';
const RESYNC_REQUIRED = 'DRAFT_STATUS_RESYNC_REQUIRED';

// Error carrying a gRPC status code, thrown for malformed requests.
class StatusError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

function stateKey(verifierId, requestId) {
  // Length-prefixed, so no (verifier_id, request_id) pair can collide.
  return `${verifierId.length}:${verifierId}/${requestId}`;
}

class SequenceStore {
  constructor({ maxNgram = 3, maxDraftLen = 8, maxSequences = 100000, idleTimeoutMs = 600000, vocabSize = 0,
    trees = true } = {}) {
    this.maxNgram = maxNgram;
    this.trees = trees; // answer a token tree where a sequence's max_draft_nodes allows one
    this.maxDraftLen = maxDraftLen; // 0: no limit
    this.maxSequences = maxSequences;
    this.idleTimeoutMs = idleTimeoutMs;
    this.vocabSize = vocabSize; // 0: any
    this.entries = new Map(); // key -> { seq: NgramSequence, lastUsed: ms }
  }

  get size() {
    return this.entries.size;
  }

  // Throws StatusError(INVALID_ARGUMENT) before touching any state, so a
  // malformed call changes nothing.
  validate(request, invalidArgument) {
    if (!request.verifier_id) throw new StatusError(invalidArgument, 'verifier_id must not be empty');
    const seen = new Set();
    for (const [i, s] of request.sequences.entries()) {
      if (!s.request_id) throw new StatusError(invalidArgument, `sequences[${i}]: empty request_id`);
      if (seen.has(s.request_id)) {
        throw new StatusError(invalidArgument, `sequences[${i}]: duplicate request_id ${JSON.stringify(s.request_id)}`);
      }
      seen.add(s.request_id);
      const ctx = Number(s.context_len);
      if (!Number.isSafeInteger(ctx) || ctx < 0) {
        throw new StatusError(invalidArgument, `sequences[${i}]: context_len ${s.context_len} out of range`);
      }
      for (const t of s.new_tokens) {
        if (t < 0 || (this.vocabSize > 0 && t >= this.vocabSize)) {
          throw new StatusError(invalidArgument, `sequences[${i}]: token id ${t} outside the vocabulary`);
        }
      }
      if (s.prompt_len > ctx + s.new_tokens.length) {
        throw new StatusError(invalidArgument,
          `sequences[${i}]: prompt_len ${s.prompt_len} exceeds the context length ${ctx + s.new_tokens.length}`);
      }
    }
  }

  // One DraftResult per DraftSequence, in order.
  prepare(request, now = Date.now()) {
    const verifierId = request.verifier_id || '';
    return request.sequences.map((s) => this.prepareOne(verifierId, s, now));
  }

  prepareOne(verifierId, s, now) {
    const key = stateKey(verifierId, s.request_id);
    const contextLen = Number(s.context_len);
    const newTokens = s.new_tokens;
    let entry = this.entries.get(key);
    let skip = 0; // leading new tokens already held
    if (contextLen === 0) {
      // Full context. When it merely extends what is held, keep the index built so far;
      // otherwise start over, whatever was held before.
      if (entry && overlapMatches(entry.seq.tokens, 0, newTokens)) {
        skip = entry.seq.length;
      } else {
        entry = { seq: new NgramSequence(this.maxNgram), lastUsed: now };
      }
    } else {
      const held = entry ? entry.seq.length : -1;
      if (!entry || held < contextLen) {
        // Never had it, lost it (restart, eviction), or a gap (missed more steps than the
        // overlap covers): ask for the whole context. What is held is still a true prefix.
        if (entry) {
          entry.lastUsed = now;
          this.entries.delete(key); // re-insert: most recently used goes last
          this.entries.set(key, entry);
        }
        return { request_id: s.request_id, status: RESYNC_REQUIRED, draft_tokens: [] };
      }
      if (held > contextLen + newTokens.length || !overlapMatches(entry.seq.tokens, contextLen, newTokens)) {
        // Ends before what is held, or re-sent tokens differ: committed context never
        // changes, so this state is inconsistent. Drop it and ask for the whole context.
        this.entries.delete(key);
        return { request_id: s.request_id, status: RESYNC_REQUIRED, draft_tokens: [] };
      }
      skip = held - contextLen;
    }
    entry.seq.append(skip > 0 ? newTokens.slice(skip) : newTokens);
    entry.lastUsed = now;
    this.entries.delete(key); // re-insert: most recently used goes last
    this.entries.set(key, entry);
    this.enforceCapacity();
    let k = s.draft_len;
    if (this.maxDraftLen > 0) k = Math.min(k, this.maxDraftLen);
    const nodes = this.trees ? s.max_draft_nodes || 0 : 0;
    if (nodes === 0) return { request_id: s.request_id, status: OK, draft_tokens: entry.seq.draft(k) };
    const tree = entry.seq.tree(k, nodes);
    // A tree without a branch goes as a chain: empty parents (PROTOCOL.md).
    const chain = tree.parents.every((parent, i) => parent === i - 1);
    return { request_id: s.request_id, status: OK, draft_tokens: tree.tokens, draft_parents: chain ? [] : tree.parents };
  }

  release(verifierId, requestIds) {
    let released = 0;
    for (const id of requestIds) {
      if (this.entries.delete(stateKey(verifierId || '', id))) released++;
    }
    return released;
  }

  enforceCapacity() {
    while (this.entries.size > this.maxSequences) {
      // Least recently used first; it will simply resync if it comes back.
      this.entries.delete(this.entries.keys().next().value);
    }
  }

  evictIdle(now = Date.now()) {
    let evicted = 0;
    for (const [key, entry] of this.entries) {
      if (now - entry.lastUsed < this.idleTimeoutMs) break; // LRU order: the rest are newer
      this.entries.delete(key);
      evicted++;
    }
    return evicted;
  }
}

// Whether newTokens begins with held.slice(offset), the part of held it overlaps.
function overlapMatches(held, offset, newTokens) {
  const overlap = held.length - offset;
  if (overlap > newTokens.length) return false;
  for (let i = 0; i < overlap; i++) {
    if (held[offset + i] !== newTokens[i]) return false;
  }
  return true;
}

module.exports = { SequenceStore, StatusError, stateKey, OK, RESYNC_REQUIRED };
