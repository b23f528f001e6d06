'use strict';
// Unit tests without a server: `npm test` (node's built-in test runner).
const test = require('node:test');
const assert = require('node:assert/strict');

const { NgramSequence, promptLookup } = require('../ngram');
const { SequenceStore, OK, RESYNC_REQUIRED, stateKey } = require('../store');

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

test('overlapping deltas: overlap skipped, gap, inconsistent, full replace', () => {
  const store = new SequenceStore({ maxNgram: 3, maxDraftLen: 8 });
  const call = (context_len, new_tokens, draft_len = 4) =>
    store.prepare({ verifier_id: 'v', sequences: [{ request_id: 'r', context_len, new_tokens, draft_len }] })[0];
  const held = () => store.entries.get(stateKey('v', 'r'));
  assert.equal(call(0, [1, 2, 3, 4]).status, OK);
  // new_tokens[0] sits at offset 2: [3, 4] are held, [1, 2] are appended.
  let r = call(2, [3, 4, 1, 2]);
  assert.equal(r.status, OK);
  assert.deepEqual(r.draft_tokens, [3, 4, 1, 2]);
  assert.deepEqual(held().seq.tokens, [1, 2, 3, 4, 1, 2]);
  // An overlap covering exactly what is held appends nothing.
  assert.equal(call(5, [2]).status, OK);
  assert.equal(held().seq.length, 6);
  // A gap (position 6 missing): resync, the held prefix is kept ...
  assert.equal(call(7, [9]).status, RESYNC_REQUIRED);
  assert.equal(held().seq.length, 6);
  // ... and a full context extending it keeps the index built so far.
  const seq = held().seq;
  r = call(0, [1, 2, 3, 4, 1, 2, 3]);
  assert.equal(r.status, OK);
  assert.deepEqual(r.draft_tokens, [4, 1, 2, 3]);
  assert.equal(held().seq, seq);
  // Ending before what is held (7 tokens) is inconsistent: dropped.
  assert.equal(call(2, [3, 4]).status, RESYNC_REQUIRED);
  assert.equal(held(), undefined);
  assert.equal(call(7, [4]).status, RESYNC_REQUIRED);
  // Re-sent tokens that differ from the held ones are inconsistent too.
  call(0, [1, 2, 3, 4]);
  assert.equal(call(2, [3, 9, 5]).status, RESYNC_REQUIRED);
  assert.equal(held(), undefined);
  // A different full context replaces.
  call(0, [1, 2, 3, 4]);
  assert.equal(call(0, [7, 8, 7]).status, OK);
  assert.deepEqual(held().seq.tokens, [7, 8, 7]);
});

test('two round-robin replicas stay in sync from an overlap of two steps', () => {
  const replicas = [new SequenceStore(), new SequenceStore()];
  const committed = [5, 6, 7];
  const ends = [0, 0]; // committed length after the last two calls
  for (let step = 0; step < 20; step++) {
    const ctx = ends[0];
    const [r] = replicas[step % 2].prepare({ verifier_id: 'v',
      sequences: [{ request_id: 'r', context_len: ctx, new_tokens: committed.slice(ctx), draft_len: 2 }] });
    assert.equal(r.status, OK, `step ${step}`);
    ends.shift();
    ends.push(committed.length);
    committed.push(step, step + 1, step + 2);
  }
  for (const store of replicas) {
    const tokens = store.entries.get(stateKey('v', 'r')).seq.tokens;
    assert.deepEqual(tokens, committed.slice(0, tokens.length));
  }
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
