"""``python -m dept_mega.lighthouse --bind ADDRESS`` listens on that address only (a private or VPN
interface: nothing on the federation network is authenticated, docs/launching.md §12 Security)."""
from __future__ import annotations

import socket

import pytest

pytest.importorskip("torchft")


def _reaches(family: int, host: str, port: int) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect((host, port))
        return True
    except OSError:
        return False


def test_bind_listens_on_the_given_address_only():
    from dept_mega.lighthouse import serve
    if not socket.has_ipv6 or not _can_bind_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    everywhere = serve(0, 1)  # the default, [::]: IPv4 and IPv6 loopback both reach it
    port = int(everywhere.address().rsplit(":", 1)[1].strip("/"))
    try:
        assert _reaches(socket.AF_INET, "127.0.0.1", port) and _reaches(socket.AF_INET6, "::1", port)
    finally:
        everywhere.shutdown()
    private = serve(0, 1, bind="127.0.0.1")
    port = int(private.address().rsplit(":", 1)[1].strip("/"))
    try:
        assert _reaches(socket.AF_INET, "127.0.0.1", port)
        assert not _reaches(socket.AF_INET6, "::1", port)  # another interface: not listened on
    finally:
        private.shutdown()


def _can_bind_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False
