"""Two "sites" on one machine for the federation tests: network namespaces A and B, each with
one interface on a bridge in a third namespace (the network between them), so that the test
can cut the network between the sites and bring it back while the jobs run (root and
``ip`` needed: :func:`sites` skips the test otherwise).

A cut takes B's port off the bridge (the bridge's end of B's link down): packets between the
sites vanish without an answer in both directions — no reset, no "network unreachable" — as
when a WAN link between two clusters fails, so the jobs' TCP connections stay open, half-open,
and retransmit until the link is back. (Setting a site's own interface down would not do: its
routes go with it, and its sends fail at once.) The neighbours' link addresses are fixed
(``nud permanent``), so address resolution does not fail during a cut either.

A process enters a site with :func:`enter` (``setns``), before it starts threads: the forked
group jobs and lighthouse of tests/federation_utils.py do it when their environment names a
site (``DEPT_TEST_NETNS``). The test itself reaches a site's servers with :func:`in_site`."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import pytest

T = TypeVar("T")
NETNS_ENV = "DEPT_TEST_NETNS"  # a namespace's path (/run/netns/NAME) the forked process enters
_CLONE_NEWNET = 0x40000000


def enter(path: str) -> None:
    """This process (its calling thread, and the threads it starts after) into the network
    namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def in_site(path: str, fn: Callable[[], T]) -> T:
    """``fn()`` run in the network namespace at ``path`` (by a thread of its own: a namespace
    entered is the entering thread's), its result or its exception returned here."""
    out: dict = {}

    def run() -> None:
        try:
            enter(path)
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            out["error"] = exc
    thread = threading.Thread(target=run, name="in-site")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


class Sites:
    """Sites A and B (``addr[s]``: each one's IPv4 address; ``env(s, env)``: a job's environment
    that puts it there) and the network between them (``cut()``, ``restore()``)."""

    def __init__(self, tag: str, subnet: int) -> None:
        self.ns = {s: f"{tag}{s}" for s in ("A", "B", "N")}  # N: the network between the sites
        self.addr = {"A": f"10.213.{subnet}.1", "B": f"10.213.{subnet}.2"}
        self.made: list[str] = []

    def path(self, site: str) -> str:
        return f"/run/netns/{self.ns[site]}"

    def env(self, site: str, env: dict) -> dict:
        return dict(env, **{NETNS_ENV: self.path(site)})

    def make(self) -> None:
        for name in self.ns.values():
            _ip("netns", "add", name)
            self.made.append(name)
        net = self.ns["N"]
        _ip("-n", net, "link", "add", "br0", "type", "bridge")
        _ip("-n", net, "link", "set", "br0", "up")
        mac = {}
        for s in ("A", "B"):
            _ip("-n", net, "link", "add", f"p{s}", "type", "veth", "peer", "name", "eth0", "netns", self.ns[s])
            _ip("-n", net, "link", "set", f"p{s}", "master", "br0", "up")
            _ip("-n", self.ns[s], "addr", "add", f"{self.addr[s]}/24", "dev", "eth0")
            _ip("-n", self.ns[s], "link", "set", "eth0", "up")
            _ip("-n", self.ns[s], "link", "set", "lo", "up")
            mac[s] = _ip("-n", self.ns[s], "-br", "link", "show", "eth0").split()[2]
        for s, other in (("A", "B"), ("B", "A")):
            _ip("-n", self.ns[s], "neigh", "replace", self.addr[other], "lladdr", mac[other], "dev", "eth0",
                "nud", "permanent")

    def cut(self) -> None:
        _ip("-n", self.ns["N"], "link", "set", "pB", "down")

    def restore(self) -> None:
        _ip("-n", self.ns["N"], "link", "set", "pB", "up")

    def remove(self) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.made.clear()


_made = [0]


@contextmanager
def sites() -> Iterator[Sites]:
    """Sites A and B, removed on leaving; skips the test where this machine cannot make them."""
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two sites need root and iproute2's ip (network namespaces)")
    _made[0] += 1  # (a name of its own for each test of a process: the last one's may still be going)
    s = Sites(f"dm{os.getpid()}x{_made[0]}", subnet=os.getpid() % 250 + 1)
    try:
        try:
            s.make()
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"cannot make two sites here: {exc}")
        yield s
    finally:
        s.remove()
