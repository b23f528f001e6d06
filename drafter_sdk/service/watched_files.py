"""Credentials read from files, and read again when the files change: no restart to rotate them.

Kubernetes updates a Secret mounted as a volume in place: cert-manager renews a certificate weeks
before it expires, an operator rotates a token. A server that read its certificate once at start
goes on presenting the old one, and once that expires every new connection fails until the pod is
restarted. So each use (a TLS handshake, a call's token check) looks at its files' identity (device,
inode, size, modification time; a Secret volume swaps a symlink to a new file, which changes them all),
a few microseconds, and reads them again when it changed.

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
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
# os.stat's identity of a file (st_dev, st_ino, st_size, st_mtime_ns), or None where it cannot be read.
Identity = tuple[int, int, int, int] | None


class WatchedFiles(Generic[T]):
    """The value `load` makes of `paths`, made again at the first `get` after any of them changes.

    `get` is safe from any thread (gRPC calls the TLS credentials' fetcher on its own threads)."""

    def __init__(self, load: Callable[[], T], paths: Sequence[PathLike], what: str) -> None:
        self._load = load
        self._paths = [os.fspath(p) for p in paths]
        self._what = what
        self._lock = threading.Lock()
        identity = self._identity()
        self._value = load()  # raises: a bad file at start-up is an error, not a warning
        self._seen = identity  # the files' identity `_value` was made from, or the last one that failed

    def get(self) -> T:
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


def _identity(path: str) -> Identity:
    try:
        st = os.stat(path)  # follows symlinks: a Secret volume's file is a link into its current version
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
