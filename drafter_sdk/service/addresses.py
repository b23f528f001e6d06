"""gRPC targets, and the addresses behind them: every replica of a Service, one by one.

A channel to a target spreads calls over its addresses (round_robin) without saying which; what must
reach each replica (PROTOCOL.md section 7: a verifier's announcements of finished requests, a starting
replica's question to its peers) needs the addresses themselves. They are what gRPC's own resolver finds: a `dns:`
name's records, an `ipv4:` or `ipv6:` list; a kind not resolved here (`unix:`, `xds:`) has none.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

log = logging.getLogger(__name__)

DEFAULT_PORT = "443"  # gRPC's, for a target without one


def parse_target(target: str) -> tuple[str, str, list[str]]:
    """(host to resolve, port, addresses already given) of a gRPC target: ("", "", [host:port, ...]) for an
    `ipv4:`/`ipv6:` list, (host, port, []) for a `dns:` name or a bare host:port, ("", "", []) for a kind
    not resolved here."""
    scheme, sep, rest = target.partition(":")
    if sep and scheme in ("ipv4", "ipv6"):
        return "", "", [address for address in rest.split(",") if address]
    if sep and scheme == "dns":
        rest = rest.removeprefix("//")
        rest = rest.partition("/")[2] if "/" in rest else rest  # dns://authority/host:port
    elif sep and not rest[:1].isdigit() and not target.startswith("["):
        return "", "", []  # unix:, xds:, ... (a bare host:port has digits after its colon)
    else:
        rest = target
    if rest.startswith("["):  # [v6 address]:port
        host, _, port = rest[1:].partition("]")
        return host, port.removeprefix(":") or DEFAULT_PORT, []
    host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    return host, port or DEFAULT_PORT, []


def lookup(host: str, port: str, given: list[str]) -> list[str]:
    """Every address of a target parsed by `parse_target`: those it gave, else what its host resolves to."""
    return given or (resolve(host, port) if host else [])


def resolve(host: str, port: str) -> list[str]:
    """host:port of every TCP address `host` resolves to, sorted; [] where it does not resolve. Loopback
    addresses count once: `localhost` names 127.0.0.1 and ::1, one server listening on both."""
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        log.debug("cannot resolve %s: %s", host, exc)
        return []
    ips = sorted({info[4][0] for info in infos})
    remote = [ip for ip in ips if not ipaddress.ip_address(ip.partition("%")[0]).is_loopback]
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in (remote if remote else ips[:1])]
