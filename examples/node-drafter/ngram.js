'use strict';
// Prompt-lookup n-gram drafting over one sequence's committed tokens.
//
// Rule: for n from maxNgram down to 1, take the last n tokens (the suffix),
// find its most recent EARLIER occurrence, and propose the tokens that
// followed that occurrence (up to k of them, never past the end of the
// context). The first n that matches wins; no match means an empty draft.
//
// A token tree (when the verifier's node budget allows one) holds the
// continuations after several earlier occurrences, merged as a trie: longest
// n-gram first, then latest occurrence first, so its first branch begins with
// the chain above. Siblings differ, parents come before children, and the
// budget cuts the latest-first order, as protos/PROTOCOL.md's tree rules ask.
//
// The lookup is O(maxNgram) per step: an index maps every n-gram to the start
// positions, in order, that have at least one follower. It is maintained
// incrementally as deltas arrive, which is why drafters keep state and the
// wire carries deltas.

// Occurrences kept per n-gram, latest first: a tree reads at most this many, each adding at most one
// branch, so memory stays bounded however often an n-gram recurs.
const OCCURRENCES_KEPT = 64;

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
    // index[n]: n-gram key -> start positions followed by a token, oldest first (the latest
    // OCCURRENCES_KEPT at least).
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
      const key = ngramKey(this.tokens, len - n, n);
      const starts = this.index[n].get(key);
      if (!starts) {
        this.index[n].set(key, [len - n]);
        continue;
      }
      if (starts.length === 2 * OCCURRENCES_KEPT) starts.splice(0, OCCURRENCES_KEPT); // amortised O(1)
      starts.push(len - n);
    }
    this.tokens.push(token);
  }

  // Up to k draft tokens continuing the context (possibly fewer, or none).
  draft(k) {
    const len = this.tokens.length;
    if (k <= 0 || len < 2) return [];
    for (let n = Math.min(this.maxNgram, len - 1); n >= 1; n--) {
      const starts = this.index[n].get(ngramKey(this.tokens, len - n, n));
      if (starts) {
        const start = starts[starts.length - 1];
        return this.tokens.slice(start + n, Math.min(start + n + k, len));
      }
    }
    return [];
  }

  // A token tree of at most maxNodes nodes and depth k: { tokens, parents }, parents[i] the index
  // of node i's parent, -1 for a child of the last token. Each n-gram length reads at most
  // maxNodes (and OCCURRENCES_KEPT) occurrences, so a frequent n-gram costs no more than the budget.
  tree(k, maxNodes) {
    const tokens = [];
    const parents = [];
    const len = this.tokens.length;
    if (k <= 0 || maxNodes <= 0 || len < 2) return { tokens, parents };
    const children = [new Map()]; // children[node + 1]: token -> child node (children[0]: the root's)
    for (let n = Math.min(this.maxNgram, len - 1); n >= 1; n--) {
      const starts = this.index[n].get(ngramKey(this.tokens, len - n, n)) || [];
      const oldest = Math.max(0, starts.length - Math.min(maxNodes, OCCURRENCES_KEPT));
      for (let j = starts.length - 1; j >= oldest; j--) {
        let node = -1;
        for (let at = starts[j] + n; at < Math.min(starts[j] + n + k, len); at++) {
          const token = this.tokens[at];
          let child = children[node + 1].get(token);
          if (child === undefined) {
            if (tokens.length === maxNodes) return { tokens, parents };
            child = tokens.length;
            tokens.push(token);
            parents.push(node);
            children[node + 1].set(token, child);
            children.push(new Map());
          }
          node = child;
        }
      }
    }
    return { tokens, parents };
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
