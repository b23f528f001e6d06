#!/usr/bin/env node
'use strict';
// splitspec drafter in Node.js: prompt-lookup n-gram drafts served over gRPC.
//
//   node index.js --port 50052
//   node index.js --port 0 --port-file /tmp/port   # pick a free port
//
// The contract is loaded at runtime from the same .proto files the verifier
// uses (../../protos by default); see protos/PROTOCOL.md for the semantics.

const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const tls = require('tls');
const { parseArgs } = require('util');

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { HealthImplementation } = require('grpc-health-check');

const { SequenceStore, StatusError } = require('./store');
const { RECHECK_MS, WatchedFiles } = require('./watched_files');

const NAME = 'node-ngram-drafter';
const VERSION = require('./package.json').version;
const SERVICE = 'splitspec.v1.DrafterService';

const USAGE = `usage: node index.js [options]
  --host HOST               interface to bind (default 0.0.0.0)
  --port PORT               port to bind; 0 picks a free one (default 50052)
  --port-file PATH          write the bound port to PATH once listening
  --max-ngram N             longest suffix n-gram looked up (default 3)
  --max-draft-len N         most draft tokens per sequence, 0 = no cap (default 32)
  --no-trees                answer chains only (no token-tree capability)
  --vocab-size N            reject token ids >= N, 0 = any (default 0)
  --max-sequences N         sequences held before LRU eviction (default 100000)
  --idle-timeout-s S        drop sequences idle this long (default 600)
  --grace-s S               graceful shutdown period on SIGTERM (default 5)
  --max-message-mb N        largest request accepted (default 64)
  --auth-token-file PATH    require "authorization: Bearer <token>", one token
                            a line, any taken (also env SPLITSPEC_DRAFTER_AUTH_TOKEN)
  --tls-cert-file PATH      serve TLS with this certificate chain ...
  --tls-key-file PATH       ... and this private key
  --tls-ca-file PATH        require client certificates signed by this CA (mTLS)
                            (the token and TLS files are read again within a second
                            of a change: a renewed certificate needs no restart)
  --proto-dir DIR           root of the splitspec .proto files (default ../../protos)
  --quiet                   log only errors
  -h, --help                show this help`;

function parseCli(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      host: { type: 'string', default: '0.0.0.0' },
      port: { type: 'string', default: '50052' },
      'port-file': { type: 'string' },
      'max-ngram': { type: 'string', default: '3' },
      'max-draft-len': { type: 'string', default: '32' },
      'no-trees': { type: 'boolean', default: false },
      'vocab-size': { type: 'string', default: '0' },
      'max-sequences': { type: 'string', default: '100000' },
      'idle-timeout-s': { type: 'string', default: '600' },
      'grace-s': { type: 'string', default: '5' },
      'max-message-mb': { type: 'string', default: '64' },
      'auth-token-file': { type: 'string' },
      'tls-cert-file': { type: 'string' },
      'tls-key-file': { type: 'string' },
      'tls-ca-file': { type: 'string' },
      'proto-dir': { type: 'string', default: path.resolve(__dirname, '..', '..', 'protos') },
      quiet: { type: 'boolean', default: false },
      help: { type: 'boolean', short: 'h', default: false },
    },
    strict: true,
  });
  const int = (name, min) => {
    const v = Number(values[name]);
    if (!Number.isInteger(v) || v < min) throw new Error(`--${name} must be an integer >= ${min}, got ${values[name]}`);
    return v;
  };
  const num = (name, min) => {
    const v = Number(values[name]);
    if (!Number.isFinite(v) || v < min) throw new Error(`--${name} must be a number >= ${min}, got ${values[name]}`);
    return v;
  };
  return {
    help: values.help,
    host: values.host,
    port: int('port', 0),
    portFile: values['port-file'],
    maxNgram: int('max-ngram', 1),
    maxDraftLen: int('max-draft-len', 0),
    trees: !values['no-trees'],
    vocabSize: int('vocab-size', 0),
    maxSequences: int('max-sequences', 1),
    idleTimeoutS: num('idle-timeout-s', 0.01),
    graceS: num('grace-s', 0),
    maxMessageMb: num('max-message-mb', 1),
    authTokenFile: values['auth-token-file'],
    tlsCertFile: values['tls-cert-file'],
    tlsKeyFile: values['tls-key-file'],
    tlsCaFile: values['tls-ca-file'],
    protoDir: values['proto-dir'],
    quiet: values.quiet,
  };
}

function loadDrafterService(protoDir) {
  const definition = protoLoader.loadSync('splitspec/v1/drafter.proto', {
    includeDirs: [protoDir],
    keepCase: true, // request_id, not requestId
    longs: Number, // context_len is uint64; lengths stay far below 2^53
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).splitspec.v1.DrafterService.service;
}

// The server's credentials, and `follow()`: hands the server the TLS files' latest certificate, key and
// CA, for the handshakes after it (grpc-js's secure context update).
function serverCredentials(opts, log) {
  if (!opts.tlsCertFile && !opts.tlsKeyFile && !opts.tlsCaFile) {
    return { credentials: grpc.ServerCredentials.createInsecure(), follow: () => {} };
  }
  if (!opts.tlsCertFile || !opts.tlsKeyFile) throw new Error('TLS needs both --tls-cert-file and --tls-key-file');
  const load = () => {
    const files = {
      cert: fs.readFileSync(opts.tlsCertFile),
      key: fs.readFileSync(opts.tlsKeyFile),
      ca: opts.tlsCaFile ? fs.readFileSync(opts.tlsCaFile) : undefined,
    };
    tls.createSecureContext(files); // throws for a key that is not the certificate's
    return files;
  };
  const paths = [opts.tlsCertFile, opts.tlsKeyFile, ...(opts.tlsCaFile ? [opts.tlsCaFile] : [])];
  const watched = new WatchedFiles(paths, load, 'TLS certificate', log);
  let given = watched.get();
  const credentials = grpc.ServerCredentials.createSsl(
    given.ca || null,
    [{ cert_chain: given.cert, private_key: given.key }],
    Boolean(opts.tlsCaFile), // a CA means mutual TLS: client certificates are required
  );
  const follow = () => {
    const latest = watched.get();
    if (latest === given) return;
    given = latest;
    credentials.updateSecureContextOptions({ cert: [latest.cert], key: [latest.key], ca: latest.ca });
  };
  return { credentials, follow };
}

// The tokens a token file lists, one a line (blank lines and # comments skipped); a call may carry any of
// them, so a token is rotated without refusing a call: the new one listed second, then first, then alone.
function readTokens(file) {
  const tokens = [];
  fs.readFileSync(file, 'utf8').split(/\r?\n/).forEach((line, i) => {
    const fields = line.trim().split(/\s+/).filter(Boolean);
    if (!fields.length || fields[0].startsWith('#')) return;
    if (fields.length !== 1) throw new Error(`${file}:${i + 1}: expected one token a line`);
    tokens.push(fields[0]);
  });
  if (!tokens.length) throw new Error(`auth token file ${file} is empty`);
  return tokens;
}

// The bearer tokens a call may carry, as they are now (none: no auth): a token file is read again when it
// changes.
function authTokens(opts, log) {
  if (opts.authTokenFile) {
    const watched = new WatchedFiles([opts.authTokenFile], () => readTokens(opts.authTokenFile), 'auth token file',
      log);
    return () => watched.get();
  }
  const token = (process.env.SPLITSPEC_DRAFTER_AUTH_TOKEN || '').trim();
  const tokens = token ? [token] : [];
  return () => tokens;
}

// Bearer auth: true when the call may go on (a call without a token it takes is answered here).
function authorized(call, tokens, fail) {
  const accepted = tokens();
  if (!accepted.length) return true;
  const got = Buffer.from(String(call.metadata.get('authorization')[0] || ''));
  let found = false;
  for (const token of accepted) {  // every token compared, each in constant time
    const expected = Buffer.from(`Bearer ${token}`);
    if (got.length === expected.length && crypto.timingSafeEqual(got, expected)) found = true;
  }
  if (found) return true;
  fail({ code: grpc.status.UNAUTHENTICATED, details: 'missing or wrong bearer token' });
  return false;
}

// StatusError / bugs -> a gRPC status.
function statusOf(err, log) {
  if (err instanceof StatusError) return { code: err.code, details: err.message };
  log.error(`internal error: ${err && err.stack ? err.stack : err}`);
  return { code: grpc.status.INTERNAL, details: String(err && err.message ? err.message : err) };
}

// Wraps a unary handler: bearer auth, errors -> gRPC status.
function unary(handler, { tokens, log }) {
  return (call, callback) => {
    if (!authorized(call, tokens, callback)) return;
    let response;
    try {
      response = handler(call.request);
    } catch (err) {
      callback(statusOf(err, log));
      return;
    }
    callback(null, response);
  };
}

// PrepareDraftTokensStream: per message, the unary handler of its kind (`prepare` for `request`,
// `release` for `release`), answered in order; a message that fails ends the stream with its
// status, as the unary call would have failed. `open` holds the streams: a stream lasts as long
// as its verifier, so shutdown ends them (OK) itself.
function stream({ prepare, release }, { tokens, log }, open) {
  return (call) => {
    let failed = false;
    const fail = (status) => {
      failed = true;
      call.emit('error', status); // grpc-js: ends the call with this status
    };
    if (!authorized(call, tokens, fail)) return;
    open.add(call);
    call.on('close', () => open.delete(call));
    call.on('data', (message) => {
      if (failed) return;
      try {
        if (message.message === 'release') call.write({ released: release(message.release) });
        else call.write({ response: prepare(message.request || {}) });
      } catch (err) {
        fail(statusOf(err, log));
      }
    });
    call.on('end', () => { if (!failed) call.end(); });
  };
}

function makeLogger(quiet) {
  const line = (level, msg) => process.stderr.write(`${new Date().toISOString()} ${level} ${NAME}: ${msg}\n`);
  return {
    info: (msg) => { if (!quiet) line('INFO', msg); },
    warn: (msg) => line('WARNING', msg),
    error: (msg) => line('ERROR', msg),
  };
}

function writePortFile(file, port) {
  // Write then rename, so a reader never sees a half-written file.
  const tmp = `${file}.${process.pid}.tmp`;
  fs.writeFileSync(tmp, `${port}\n`);
  fs.renameSync(tmp, file);
}

function main(argv) {
  let opts;
  try {
    opts = parseCli(argv);
  } catch (err) {
    process.stderr.write(`${err.message}\n${USAGE}\n`);
    return 2;
  }
  if (opts.help) {
    process.stdout.write(`${USAGE}\n`);
    return 0;
  }
  const log = makeLogger(opts.quiet);
  let tokens;
  let tlsFiles;
  try {
    tokens = authTokens(opts, log);
    tlsFiles = serverCredentials(opts, log);
  } catch (err) {
    process.stderr.write(`${err.message}\n`);
    return 2;
  }
  const store = new SequenceStore({
    maxNgram: opts.maxNgram,
    maxDraftLen: opts.maxDraftLen,
    vocabSize: opts.vocabSize,
    maxSequences: opts.maxSequences,
    idleTimeoutMs: opts.idleTimeoutS * 1000,
    trees: opts.trees,
  });

  const maxBytes = Math.floor(opts.maxMessageMb * 1024 * 1024);
  const server = new grpc.Server({
    'grpc.max_receive_message_length': maxBytes,
    'grpc.max_send_message_length': maxBytes,
  });

  // Health: NOT_SERVING until the port is bound, SERVING after, NOT_SERVING
  // again while shutting down. Probes and the verifier read it.
  const health = new HealthImplementation({ '': 'NOT_SERVING', [SERVICE]: 'NOT_SERVING' });
  health.addToServer(server);
  const setHealth = (status) => {
    health.setStatus('', status);
    health.setStatus(SERVICE, status);
  };

  const ctx = { tokens, log };
  const streams = new Set(); // open PrepareDraftTokensStream calls
  const prepare = (request) => {
    store.validate(request, grpc.status.INVALID_ARGUMENT);
    return { results: store.prepare(request) };
  };
  const release = (request) => {
    if (!request.verifier_id) throw new StatusError(grpc.status.INVALID_ARGUMENT, 'verifier_id must not be empty');
    return { released: store.release(request.verifier_id, request.request_ids) };
  };
  server.addService(loadDrafterService(opts.protoDir), {
    GetDrafterInfo: unary(() => ({
      name: NAME,
      version: VERSION,
      max_draft_len: opts.maxDraftLen,
      vocab_size: opts.vocabSize,
      tokenizer: '',
      // stream-releases: releases on PrepareDraftTokensStream reach the replica holding the state.
      // lookahead: a longer draft costs a lookup nothing, so the verifier may ask for about twice what it
      // verifies and verify the rest at the next step without waiting for a call (PROTOCOL.md section 2b).
      // token-tree: it answers a tree where a sequence's max_draft_nodes allows one.
      // cache-salt: it learns nothing across requests, so nothing of a salted request (DraftSequence.cache_salt_id)
      // reaches another: the verifier may send it salted requests too.
      capabilities: ['ngram', 'prompt-lookup', 'stream-releases', 'lookahead', 'cache-salt',
        ...(opts.trees ? ['token-tree'] : [])],
    }), ctx),
    PrepareDraftTokens: unary(prepare, ctx),
    PrepareDraftTokensStream: stream({ prepare, release }, ctx, streams),
    ReleaseRequests: unary(release, ctx),
  });

  // Idle eviction: a verifier that died without ReleaseRequests leaks nothing.
  const sweepMs = Math.max(50, Math.min(opts.idleTimeoutS * 1000 / 2, 30000));
  const sweeper = setInterval(() => {
    const n = store.evictIdle();
    if (n > 0) log.info(`evicted ${n} idle sequence(s); ${store.size} held`);
  }, sweepMs);
  sweeper.unref();
  const follower = setInterval(tlsFiles.follow, RECHECK_MS);
  follower.unref();

  let shuttingDown = false;
  const shutdown = (signal) => {
    if (shuttingDown) {
      log.info(`${signal} again: forcing shutdown`);
      server.forceShutdown();
      process.exit(0);
    }
    shuttingDown = true;
    log.info(`${signal}: shutting down (grace ${opts.graceS}s)`);
    setHealth('NOT_SERVING');
    clearInterval(sweeper);
    clearInterval(follower);
    // Handlers run to completion, so no stream is mid-answer: end them all, and the verifiers
    // open their next stream on another replica.
    for (const call of streams) call.end();
    const timer = setTimeout(() => {
      log.info('grace period over: forcing shutdown');
      server.forceShutdown();
      process.exit(0);
    }, opts.graceS * 1000);
    server.tryShutdown(() => {
      clearTimeout(timer);
      log.info('stopped');
      process.exit(0);
    });
  };
  process.on('SIGTERM', () => shutdown('SIGTERM'));
  process.on('SIGINT', () => shutdown('SIGINT'));

  const address = opts.host.includes(':') ? `[${opts.host}]:${opts.port}` : `${opts.host}:${opts.port}`;
  server.bindAsync(address, tlsFiles.credentials, (err, port) => {
    if (err) {
      log.error(`cannot bind ${address}: ${err.message}`);
      process.exit(1);
    }
    if (opts.portFile) writePortFile(opts.portFile, port);
    setHealth('SERVING');
    // Always logged (even with --quiet): callers parse it to find the port.
    process.stderr.write(`${NAME} ${VERSION} listening on ${opts.host}:${port} ` +
      `(max_ngram=${opts.maxNgram}, max_draft_len=${opts.maxDraftLen}, trees=${opts.trees ? 'on' : 'off'}, ` +
      `auth=${tokens().length ? 'bearer' : 'off'}, tls=${opts.tlsCertFile ? (opts.tlsCaFile ? 'mtls' : 'tls') : 'off'})\n`);
  });
  return null; // keep running
}

if (require.main === module) {
  const code = main(process.argv.slice(2));
  if (code !== null) process.exitCode = code;
}

module.exports = { main, parseCli };
