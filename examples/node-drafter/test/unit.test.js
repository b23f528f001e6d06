'use strict';
// Unit tests without a server: `npm test` (node's built-in test runner).
const test = require('node:test');
const assert = require('node:assert/strict');

const { NgramSequence, promptLookup } = require('../ngram');
const { SequenceStore, OK, RESYNC_REQUIRED } = require('../store');

test('indexed lookup agrees with the reference on random sequences', () => {
  let seed = 12345;
  const rand = (m) => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed % m; };
  for (let trial = 0; trial < 200; trial++) {
    const maxNgram = 1 + rand(4);
    const vocab = 2 + rand(6);
    const seq = new NgramSequence(maxNgram);
    const tokens = [];
    const len = rand(60);
    for (let i = 0; i < len; i++) {
      const t = rand(vocab);
      tokens.push(t);
      seq.push(t);
      const k = rand(6);
      assert.deepEqual(seq.draft(k), promptLookup(tokens, maxNgram, k), `tokens=${tokens} n=${maxNgram} k=${k}`);
    }
  }
});

test('hand-worked drafts', () => {
  assert.deepEqual(promptLookup([5, 6, 7, 8, 5, 6, 7], 3, 4), [8, 5, 6, 7]);
  assert.deepEqual(promptLookup([5, 6, 7, 8, 5, 6, 7, 8, 5, 9], 3, 4), []);
  assert.deepEqual(promptLookup([5, 6, 7, 8, 5, 6, 7, 8, 5, 9, 5], 3, 4), [9, 5]);
  assert.deepEqual(promptLookup([1, 2, 3, 1, 2, 3], 3, 2), [1, 2]);
  assert.deepEqual(promptLookup([4, 4, 4, 4], 3, 8), [4]);
  assert.deepEqual(promptLookup([1], 3, 8), []);
});

test('delta, resync and namespacing', () => {
  const store = new SequenceStore({ maxNgram: 3, maxDraftLen: 8 });
  const call = (verifier_id, sequences) => store.prepare({ verifier_id, sequences });
  let [r] = call('a', [{ request_id: 'r', context_len: 0, new_tokens: [1, 2, 3, 1, 2], draft_len: 4 }]);
  assert.equal(r.status, OK);
  assert.deepEqual(r.draft_tokens, [3, 1, 2]);
  [r] = call('b', [{ request_id: 'r', context_len: 5, new_tokens: [3], draft_len: 4 }]);
  assert.equal(r.status, RESYNC_REQUIRED);
  [r] = call('a', [{ request_id: 'r', context_len: 4, new_tokens: [3], draft_len: 4 }]);
  assert.equal(r.status, RESYNC_REQUIRED); // mismatch drops the state ...
  [r] = call('a', [{ request_id: 'r', context_len: 5, new_tokens: [3], draft_len: 4 }]);
  assert.equal(r.status, RESYNC_REQUIRED); // ... so even the right length now resyncs
  assert.equal(store.size, 0);
});

test('LRU capacity and idle eviction', () => {
  const store = new SequenceStore({ maxSequences: 2, idleTimeoutMs: 1000 });
  for (const id of ['x', 'y', 'z']) {
    store.prepare({ verifier_id: 'v', sequences: [{ request_id: id, context_len: 0, new_tokens: [1], draft_len: 0 }] }, 0);
  }
  assert.equal(store.size, 2);
  assert.equal(store.release('v', ['x', 'y', 'z']), 2);
  store.prepare({ verifier_id: 'v', sequences: [{ request_id: 'x', context_len: 0, new_tokens: [1], draft_len: 0 }] }, 0);
  store.prepare({ verifier_id: 'v', sequences: [{ request_id: 'y', context_len: 0, new_tokens: [1], draft_len: 0 }] }, 900);
  assert.equal(store.evictIdle(1500), 1);
  assert.equal(store.size, 1);
});
