"""Credentials read from files, and read again when the files change: no restart to rotate them.

Kubernetes updates a Secret mounted as a volume in place: cert-manager renews a certificate weeks
before it expires, an operator rotates a token. A server that read its certificate once at start
goes on presenting the old one, and once that expires every new connection fails until the pod is
restarted. So a use (a TLS handshake, a call's token check) looks at its files' identity (device,
inode, size, modification time; a Secret volume swaps a symlink to a new file, which changes them all)
and reads them again when it changed. It looks at most once every RECHECK_S: a look through a Secret
volume's links took 5 us a file on a 2-core VM, 20 us for a drafter connection's three TLS files and its
token, which every decoding step would pay; the kubelet takes about a minute to update the files anyway.

A change that does not read cleanly (a file written in place and caught half-way, a key that does
not match its certificate, an emptied token file) keeps what is in use, logs one warning for that
version of the files, and is tried again at the next change: rotation must not take a working
service down. At start-up, by contrast, the first read raises: a bad file there is the operator's to
fix before the service serves.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
RECHECK_S = 1.0  # a change is taken at the first use this long after the last look, or later
# os.stat's identity of a file (st_dev, st_ino, st_size, st_mtime_ns), or None where it cannot be read.
Identity = tuple[int, int, int, int] | None


class WatchedFiles(Generic[T_co]):
    """The value `load` makes of `paths`, made again at a `get` that finds any of them changed (it looks at
    most once every `recheck_s`, RECHECK_S unless given).

    `get` is safe from any thread (gRPC calls the TLS credentials' fetcher on its own threads)."""

    def __init__(self, load: Callable[[], T_co], paths: Sequence[PathLike], what: str,
                 recheck_s: float | None = None) -> None:
        self._load = load
        self._paths = [os.fspath(p) for p in paths]
        self._what = what
        self._lock = threading.Lock()
        self._recheck_s = RECHECK_S if recheck_s is None else recheck_s
        self._next_look = time.monotonic() + self._recheck_s
        identity = self._identity()
        self._value = load()  # raises: a bad file at start-up is an error, not a warning
        self._seen = identity  # the files' identity `_value` was made from, or the last one that failed

    def get(self) -> T_co:
        if time.monotonic() < self._next_look:
            return self._value
        self._next_look = time.monotonic() + self._recheck_s
        identity = self._identity()
        if identity == self._seen:
            return self._value
        with self._lock:
            if identity != self._seen:
                self._reload(identity)
            return self._value

    def _reload(self, identity: tuple[Identity, ...]) -> None:
        try:
            value = self._load()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            self._seen = identity
            log.warning("%s: the changed %s did not load (%s); keeping the one in use until it changes again",
                        self._what, " and ".join(self._paths), exc)
            return
        if self._identity() != identity:
            return  # changed again while it loaded: what it read may mix two versions, so the next get reads again
        self._value, self._seen = value, identity
        log.info("%s: loaded again from %s, which changed", self._what, " and ".join(self._paths))

    def _identity(self) -> tuple[Identity, ...]:
        return tuple(_identity(path) for path in self._paths)


def current(value: T | WatchedFiles[T]) -> T:
    """`value` as given, or what its watched files make now."""
    return value.get() if isinstance(value, WatchedFiles) else value


def _identity(path: str) -> Identity:
    try:
        st = os.stat(path)  # follows symlinks: a Secret volume's file is a link into its current version
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
