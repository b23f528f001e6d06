"""WatchedFiles: credentials read again when their files change, and kept when a change does not load."""

from __future__ import annotations

import logging
import ssl
import time

import pytest
from certs import SecretVolume, make_pki, tls_files

from drafter_sdk.service import watched_files
from drafter_sdk.service.security import check_tls_files, watch_channel_credentials, watch_named_tokens, watch_token
from drafter_sdk.service.watched_files import WatchedFiles


@pytest.fixture(autouse=True)
def look_at_every_get(monkeypatch):
    """These tests change files and read them at once: every get looks (but test_it_looks_once_a_second)."""
    monkeypatch.setattr(watched_files, "RECHECK_S", 0.0)


def test_it_looks_once_a_second(tmp_path, monkeypatch):
    """A step that checks its drafter connection's files pays for a look once a second, not every time."""
    monkeypatch.setattr(watched_files, "RECHECK_S", 0.3)
    path = tmp_path / "token"
    path.write_text("first")
    token = watch_token(path)
    path.write_text("second")
    assert token.get() == "first"  # looked at when it was made, under 0.3 s ago
    time.sleep(0.35)
    assert token.get() == "second"


def test_a_file_changed_in_place_is_read_again_at_the_next_get(tmp_path):
    path = tmp_path / "token"
    path.write_text("first\n")
    token = watch_token(path)
    assert token.get() == "first"
    assert token.get() is token.get()  # unchanged: no read
    path.write_text("second-one\n")
    assert token.get() == "second-one"


def test_a_secret_volume_update_is_read_again(tmp_path):
    """The kubelet swaps a link to a new file: same size, new inode."""
    volume = SecretVolume(tmp_path / "secret", {"tokens": b"a aaaa\nb bbbb\n"})
    tokens = watch_named_tokens(volume / "tokens")
    assert tokens.get() == {"a": ("aaaa",), "b": ("bbbb",)}
    volume.update({"tokens": b"a cccc\nb dddd\n"})
    assert tokens.get() == {"a": ("cccc",), "b": ("dddd",)}


def test_a_change_that_does_not_load_keeps_what_is_in_use_and_warns_once(tmp_path, caplog):
    volume = SecretVolume(tmp_path / "secret", {"token": b"first"})
    token = watch_token(volume / "token")
    volume.update({"token": b"  \n"})  # emptied
    with caplog.at_level(logging.WARNING):
        assert [token.get() for _ in range(3)] == ["first"] * 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is empty" in warnings[0].getMessage(), caplog.text
    assert "keeping the one in use" in warnings[0].getMessage()
    volume.update({"token": b"second"})
    assert token.get() == "second"
    (volume / "..data").unlink()  # the files gone altogether
    assert token.get() == "second"


def test_a_bad_file_at_start_up_raises(tmp_path):
    path = tmp_path / "token"
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        watch_token(path)
    with pytest.raises(FileNotFoundError):
        watch_token(tmp_path / "missing")


def test_files_that_change_while_they_load_are_read_again(tmp_path):
    """What a load read may mix two versions of the files: it is not kept, and the next get reads again."""
    path = tmp_path / "value"
    path.write_text("1")
    loads = []

    def load() -> str:
        text = path.read_text()
        loads.append(text)
        if text == "22":
            path.write_text("333")  # the rest of the change lands while this load runs
        return text

    watched = WatchedFiles(load, [path], "value")
    path.write_text("22")
    assert watched.get() == "1"  # the load of "22" raced with the write of "333"
    assert watched.get() == "333"
    assert loads == ["1", "22", "333"]


def test_tls_files_that_do_not_make_a_server_are_refused(tmp_path):
    """A key that is not the certificate's: gRPC would take it and fail every handshake."""
    a, b = make_pki(tmp_path, "a-"), make_pki(tmp_path, "b-")
    check_tls_files(a.server_cert, a.server_key, a.ca_cert)
    with pytest.raises(ssl.SSLError):
        check_tls_files(a.server_cert, b.server_key)
    with pytest.raises(ssl.SSLError):
        watch_channel_credentials(a.ca_cert, a.client_cert, b.client_key)
    volume = SecretVolume(tmp_path / "tls", tls_files(a))
    credentials = watch_channel_credentials(volume / "ca.crt")
    first = credentials.get()
    volume.update({**tls_files(b), "ca.crt": b"not a certificate"})
    assert credentials.get() is first
    volume.update(tls_files(b))
    assert credentials.get() is not first
