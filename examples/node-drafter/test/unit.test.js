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

// Every root-to-leaf path of a tree as token lists.
function paths(tree) {
  const leaves = tree.tokens.map((_, i) => i).filter((i) => !tree.parents.includes(i));
  return leaves.map((leaf) => {
    const path = [];
    for (let node = leaf; node !== -1; node = tree.parents[node]) path.unshift(tree.tokens[node]);
    return path;
  });
}

// Whether `path` follows some earlier occurrence of the context's last n tokens (1 <= n <= maxNgram).
function followsAnOccurrence(tokens, maxNgram, path) {
  const len = tokens.length;
  for (let n = 1; n <= Math.min(maxNgram, len - 1); n++) {
    for (let start = n; start + path.length <= len; start++) {
      let ok = start <= len - 1;
      for (let i = 0; ok && i < n; i++) ok = tokens[start - n + i] === tokens[len - n + i];
      for (let i = 0; ok && i < path.length; i++) ok = tokens[start + i] === path[i];
      if (ok) return true;
    }
  }
  return false;
}

test('trees keep the contract\'s rules, begin with the chain and hold only seen continuations', () => {
  let seed = 777;
  // The high bits: an LCG's low bits repeat with a short period, which made every context periodic.
  const rand = (m) => { seed = (seed * 1103515245 + 12345) % 2147483648; return Math.floor(seed / 65536) % m; };
  let branched = 0;
  for (let trial = 0; trial < 300; trial++) {
    const maxNgram = 1 + rand(3);
    const seq = new NgramSequence(maxNgram);
    const len = 2 + rand(60);
    for (let i = 0; i < len; i++) seq.push(rand(2 + rand(5)));
    const k = 1 + rand(6);
    const budget = 1 + rand(16);
    const tree = seq.tree(k, budget);
    const where = `tokens=${seq.tokens} n=${maxNgram} k=${k} budget=${budget}`;
    assert.equal(tree.tokens.length, tree.parents.length, where);
    assert.ok(tree.tokens.length <= budget, where);
    const depth = [];
    const siblings = new Set();
    tree.parents.forEach((parent, i) => {
      assert.ok(parent >= -1 && parent < i, `parent after its child: ${where}`);
      depth.push(parent === -1 ? 1 : depth[parent] + 1);
      assert.ok(depth[i] <= k, `deeper than k: ${where}`);
      const sibling = `${parent}:${tree.tokens[i]}`;
      assert.ok(!siblings.has(sibling), `two siblings carry one token: ${where}`);
      siblings.add(sibling);
    });
    // The first branch (nodes 0, 1, 2, ... while each is the previous one's child) begins with the chain, cut
    // to the budget (where the chain stops at the context's end, an earlier occurrence may go on).
    let first = 0;
    while (first < tree.parents.length && tree.parents[first] === first - 1) first++;
    const chain = seq.draft(k).slice(0, budget);
    assert.deepEqual(tree.tokens.slice(0, Math.min(first, chain.length)), chain, where);
    assert.ok(first >= chain.length, where);
    for (const path of paths(tree)) assert.ok(followsAnOccurrence(seq.tokens, maxNgram, path), `${where} path=${path}`);
    if (tree.parents.some((parent, i) => parent !== i - 1)) branched++;
  }
  assert.ok(branched > 30, `only ${branched} trees branched`);
});

test('hand-worked tree', () => {
  const seq = new NgramSequence(3);
  seq.append([1, 2, 3, 1, 2, 4, 1, 2, 5, 9, 1, 2]);
  // [1, 2] came before 5 9 1 2, 4 1 2 5 and 3 1 2 4: latest first, merged where they agree.
  assert.deepEqual(seq.tree(4, 16), { tokens: [5, 9, 1, 2, 4, 1, 2, 5, 3, 1, 2, 4],
    parents: [-1, 0, 1, 2, -1, 4, 5, 6, -1, 8, 9, 10] });
  assert.deepEqual(seq.tree(2, 5), { tokens: [5, 9, 4, 1, 3], parents: [-1, 0, -1, 2, -1] });
  assert.deepEqual(seq.tree(0, 5), { tokens: [], parents: [] });
});

test('a recurring n-gram keeps a bounded list of occurrences, and its trees the latest', () => {
  const seq = new NgramSequence(2);
  for (let i = 0; i < 10000; i++) seq.push(i % 5 === 0 ? 1 : 2 + (i % 3)); // 1 recurs 2,000 times
  for (let n = 1; n <= 2; n++) for (const starts of seq.index[n].values()) assert.ok(starts.length <= 128);
  const tree = seq.tree(3, 64);
  assert.ok(tree.tokens.length > 1 && tree.tokens.length <= 64);
  assert.deepEqual(tree.tokens.slice(0, 3), seq.draft(3));
});

test('the store answers a tree only where the node budget allows one, and a chain as a chain', () => {
  const request = (max_draft_nodes, new_tokens) => ({ verifier_id: 'v', sequences: [
    { request_id: 'r', context_len: 0, new_tokens, draft_len: 2, max_draft_nodes }] });
  const branching = [1, 2, 3, 1, 2, 4, 1, 2];
  let [r] = new SequenceStore().prepare(request(8, branching));
  assert.deepEqual([r.draft_tokens, r.draft_parents], [[4, 1, 3, 1], [-1, 0, -1, 2]]);
  [r] = new SequenceStore().prepare(request(0, branching));
  assert.deepEqual([r.draft_tokens, r.draft_parents], [[4, 1], undefined]);
  [r] = new SequenceStore({ trees: false }).prepare(request(8, branching));
  assert.deepEqual([r.draft_tokens, r.draft_parents], [[4, 1], undefined]);
  [r] = new SequenceStore().prepare(request(8, [1, 2, 3, 1, 2]));
  assert.deepEqual([r.draft_tokens, r.draft_parents], [[3, 1], []]);
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

test('watched files are read again when they change, and kept when a change does not load', () => {
  const fs = require('fs');
  const os = require('os');
  const path = require('path');
  const { WatchedFiles } = require('../watched_files');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'watched-'));
  const file = path.join(dir, 'token');
  const said = [];
  const log = { info: () => {}, warn: (msg) => said.push(msg) };
  const load = () => {
    const text = fs.readFileSync(file, 'utf8').trim();
    if (!text) throw new Error('empty');
    return text;
  };
  fs.writeFileSync(file, 'first');
  const watched = new WatchedFiles([file], load, 'token', log, 0); // every get looks
  assert.equal(watched.get(), 'first');
  fs.writeFileSync(file, 'the second');
  assert.equal(watched.get(), 'the second');
  fs.writeFileSync(file, '');
  assert.deepEqual([watched.get(), watched.get()], ['the second', 'the second']);
  assert.equal(said.length, 1);
  assert.match(said[0], /did not load \(empty\); keeping the one in use/);
  fs.rmSync(file);
  assert.equal(watched.get(), 'the second');
  fs.writeFileSync(file, 'third');
  assert.equal(watched.get(), 'third');
  fs.rmSync(dir, { recursive: true });
});
