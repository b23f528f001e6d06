'use strict';
// Certificates and the token file, read again when they change: no restart to rotate them, as the
// Python SDK does (drafter_sdk/service/watched_files.py). Kubernetes updates a Secret mounted as a
// volume in place (cert-manager renewing a certificate, an operator rotating a token) by swapping a
// symlink to new files, which changes their device, inode, size and modification time: a stat of
// each, at most once every RECHECK_MS, tells whether to read them again.
//
// A change that does not load (a file caught half-way, a key that is not its certificate's, an
// emptied token file) keeps what is in use, logs once for that version of the files, and is tried
// again at the next change. At start-up the first load throws: a bad file there is the operator's.

const fs = require('fs');

const RECHECK_MS = 1000; // the kubelet takes about a minute to update a Secret volume anyway

function identity(paths) {
  return paths.map((file) => {
    try {
      const st = fs.statSync(file, { bigint: true }); // follows the Secret volume's links
      return `${st.dev}:${st.ino}:${st.size}:${st.mtimeNs}`;
    } catch {
      return 'unreadable';
    }
  }).join('|');
}

class WatchedFiles {
  // `load()` makes the value from the files (and throws where they do not make one).
  constructor(paths, load, what, log, recheckMs = RECHECK_MS) {
    this.recheckMs = recheckMs;
    this.nextLook = Date.now() + recheckMs;
    this.paths = paths;
    this.load = load;
    this.what = what;
    this.log = log;
    const seen = identity(paths);
    this.value = load();
    this.seen = seen;
  }

  get() {
    if (Date.now() < this.nextLook) return this.value;
    this.nextLook = Date.now() + this.recheckMs;
    const now = identity(this.paths);
    if (now === this.seen) return this.value;
    let value;
    try {
      value = this.load();
    } catch (err) {
      this.seen = now;
      this.log.warn(`${this.what}: the changed ${this.paths.join(' and ')} did not load (${err.message}); ` +
        'keeping the one in use until it changes again');
      return this.value;
    }
    if (identity(this.paths) !== now) return this.value; // changed again while it loaded: read it next time
    this.value = value;
    this.seen = now;
    this.log.info(`${this.what}: loaded again from ${this.paths.join(' and ')}, which changed`);
    return this.value;
  }
}

module.exports = { RECHECK_MS, WatchedFiles };
