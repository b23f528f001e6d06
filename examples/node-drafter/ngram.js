'use strict';
// Prompt-lookup n-gram drafting over one sequence's committed tokens.
//
// Rule: for n from maxNgram down to 1, take the last n tokens (the suffix),
// find its most recent EARLIER occurrence, and propose the tokens that
// followed that occurrence (up to k of them, never past the end of the
// context). The first n that matches wins; no match means an empty draft.
//
// The lookup is O(maxNgram) per step: an index maps every n-gram to the
// latest start position that has at least one follower. It is maintained
// incrementally as deltas arrive, which is why drafters keep state and the
// wire carries deltas.

function ngramKey(tokens, start, n) {
  if (n === 1) return String(tokens[start]);
  let key = String(tokens[start]);
  for (let i = 1; i < n; i++) key += ',' + tokens[start + i];
  return key;
}

class NgramSequence {
  constructor(maxNgram) {
    if (!Number.isInteger(maxNgram) || maxNgram < 1) {
      throw new RangeError(`maxNgram must be a positive integer, got ${maxNgram}`);
    }
    this.maxNgram = maxNgram;
    this.tokens = [];
    // index[n]: n-gram key -> latest start position followed by a token.
    this.index = [null];
    for (let n = 1; n <= maxNgram; n++) this.index.push(new Map());
  }

  get length() {
    return this.tokens.length;
  }

  append(newTokens) {
    for (const t of newTokens) this.push(t);
  }

  push(token) {
    const len = this.tokens.length;
    // The n-grams ending at the current last token gain a follower now.
    for (let n = 1; n <= this.maxNgram && n <= len; n++) {
      this.index[n].set(ngramKey(this.tokens, len - n, n), len - n);
    }
    this.tokens.push(token);
  }

  // Up to k draft tokens continuing the context (possibly fewer, or none).
  draft(k) {
    const len = this.tokens.length;
    if (k <= 0 || len < 2) return [];
    for (let n = Math.min(this.maxNgram, len - 1); n >= 1; n--) {
      const start = this.index[n].get(ngramKey(this.tokens, len - n, n));
      if (start !== undefined) {
        return this.tokens.slice(start + n, Math.min(start + n + k, len));
      }
    }
    return [];
  }
}

// Reference implementation (quadratic, no index), handy for tests.
function promptLookup(tokens, maxNgram, k) {
  const len = tokens.length;
  if (k <= 0 || len < 2) return [];
  for (let n = Math.min(maxNgram, len - 1); n >= 1; n--) {
    for (let start = len - n - 1; start >= 0; start--) {
      let match = true;
      for (let i = 0; i < n; i++) {
        if (tokens[start + i] !== tokens[len - n + i]) { match = false; break; }
      }
      if (match) return tokens.slice(start + n, Math.min(start + n + k, len));
    }
  }
  return [];
}

module.exports = { NgramSequence, promptLookup };
