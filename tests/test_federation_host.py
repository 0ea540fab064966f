"""``federation.advertise_host`` reaches what torchft advertises to the other group jobs: rank 0's
manager server address (which the lighthouse hands to the others), the healing checkpoint
server's address, the store address of the quorum and the address its Gloo connections listen
on (one process, an in-process lighthouse: no second site)."""
from __future__ import annotations

import re
import socket
import time
from datetime import timedelta

import pytest

pytest.importorskip("torchft")


def _manager(setting, lighthouse: str, rank: int = 0):
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from dept_mega.dept.federation_host import manager_kwargs, store_host
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=10)
    store_addr = store_host(setting, rank, "127.0.0.1")
    m = Manager(pg=ProcessGroupGloo(timeout), load_state_dict=None, state_dict=None, min_replica_size=1,
                use_async_quorum=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                rank=0, world_size=1, store_addr=store_addr, store_port=store.port, lighthouse_addr=lighthouse,
                replica_id="dept_group_0", init_sync=False, **manager_kwargs(setting, timeout))
    return m, store, store_addr


def _shut(m) -> None:
    """The Manager shut down as a group job's federation does (Federation.shutdown): its healing
    server's thread ends (torchft's own shutdown(wait=False) left it serving and polling)."""
    from dept_mega.dept.federation_outer import stop_checkpoint_server
    m.shutdown(wait=False)
    stop_checkpoint_server(m._checkpoint_transport)
    m._checkpoint_transport._thread.join(5)
    assert not m._checkpoint_transport._thread.is_alive()
    server = m._checkpoint_transport._server
    for _ in range(50):  # its listening socket closed (just after the thread's end)
        if server.socket.fileno() == -1:
            break
        time.sleep(0.02)
    assert server.socket.fileno() == -1


def test_advertise_host_reaches_torchfts_addresses():
    from dept_mega.dept.federation_host import advertised_host, store_host
    from dept_mega.lighthouse import serve
    lh = serve(0, 1)
    lh_port = int(lh.address().rsplit(":", 1)[1])
    addr = f"http://127.0.0.1:{lh_port}"
    try:
        # "localhost" names this host too, so the Manager's own store connection works
        m, store, store_addr = _manager("localhost", addr)
        try:
            assert m._manager.address().startswith("http://localhost:"), m._manager.address()
            assert m._checkpoint_transport.address().startswith("http://localhost:"), m._checkpoint_transport.address()
            assert store_addr == "localhost"
        finally:
            _shut(m)
        # null: torchft's own (the short host name), unchanged
        m, store, store_addr = _manager(None, addr)
        try:
            host = socket.gethostname()
            assert m._manager.address().startswith(f"http://{host}:") and store_addr == "127.0.0.1"
            assert m._checkpoint_transport.address().startswith(f"http://{host}:")
        finally:
            _shut(m)
        # route: this node's address on its route to the lighthouse (here: the loopback's)
        host = advertised_host("route", ("127.0.0.1", lh_port))
        assert host == "127.0.0.1"
        m, store, store_addr = _manager(host, addr)
        try:
            assert m._manager.address().startswith("http://127.0.0.1:"), m._manager.address()
            assert m._checkpoint_transport.address().startswith("http://127.0.0.1:")
        finally:
            _shut(m)
    finally:
        lh.shutdown()
    # fqdn: each node's own full name; only rank 0 advertises the store (it runs where it is)
    assert advertised_host("fqdn") == socket.getfqdn()
    assert store_host("site2.example.org", 0, "node01") == "site2.example.org"
    assert store_host("site2.example.org", 3, "node01") == "node01"


def test_empty_advertise_host_is_refused(tmp_path):
    from dept_mega.config import ConfigError, load_config
    from dept_mega.dept.federation_config import resolve
    from tests.federation_utils import write_config
    cfg = load_config(write_config(str(tmp_path)), ["federation.lighthouse=127.0.0.1:1", "federation.group=0",
                                                     "federation.groups=3"])
    cfg.federation.advertise_host = " "
    with pytest.raises(ConfigError, match=r"'federation.advertise_host': empty"):
        resolve(cfg)
    cfg.federation.advertise_host = "fqdn"
    assert resolve(cfg)[0] == 0


def test_a_literal_advertise_host_is_refused_on_a_job_of_several_nodes(tmp_path, monkeypatch):
    """A literal address names one node, but every rank advertises its healing server at it: a
    group job of several nodes (WORLD_SIZE > LOCAL_WORLD_SIZE) with one is refused at start,
    before the lighthouse is contacted, naming the key; fqdn and null are not, nor is a literal on
    one node (or without torchrun)."""
    from types import SimpleNamespace

    import torch

    from dept_mega.config import ConfigError, load_config
    from dept_mega.dept.federation import Federation
    from dept_mega.dept.federation_host import check_literal
    from tests.federation_utils import write_config
    with pytest.raises(ConfigError, match=r"'federation.advertise_host': '10.8.0.3' is one node's address, but this "
                                          r"group job runs on 2 nodes \(16 ranks, 8 per node"):
        check_literal("10.8.0.3", 16, 8)
    for setting, world, local in (("fqdn", 16, 8), ("route", 16, 8), (None, 16, 8), ("10.8.0.3", 8, 8),
                                  ("10.8.0.3", 1, None)):
        check_literal(setting, world, local)
    cfg = load_config(write_config(str(tmp_path)), ["federation.lighthouse=127.0.0.1:1", "federation.group=0",
                                                     "federation.groups=3", "federation.advertise_host=10.8.0.3"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"runs on 2 nodes \(4 ranks, 2 per node"):  # (the lighthouse: nothing there)
        Federation(cfg, SimpleNamespace(group_size=4, rank=0), torch.device("cpu"), 0, "127.0.0.1", 1)


def test_route_finds_the_source_address_or_names_the_key(monkeypatch):
    """``route``: the address the kernel picks to reach the lighthouse (a host name resolves to
    its IPv4 address first); a lighthouse that does not resolve, or that this node has no route
    to, is a ConfigError naming the key and the lighthouse."""
    from dept_mega.config import ConfigError
    from dept_mega.dept.federation_host import advertised_host, is_loopback
    assert advertised_host("route", ("localhost", 29510)) == "127.0.0.1"
    assert advertised_host("route", ("127.0.0.2", 29510)) == "127.0.0.1"  # (the loopback's own address)
    assert is_loopback("127.0.0.1") and not is_loopback("10.8.0.3") and not is_loopback("node017.example.org")
    with pytest.raises(ConfigError, match=r"'federation.advertise_host': route: on " + re.escape(socket.gethostname())
                   + r", the lighthouse's host 'no-such-host.invalid' does not resolve"):
        advertised_host("route", ("no-such-host.invalid", 29510))

    def unreachable(self, address):
        raise OSError(101, "Network is unreachable")
    monkeypatch.setattr(socket.socket, "connect", unreachable)
    with pytest.raises(ConfigError, match=r"'federation.advertise_host': route: no route from "
                   + re.escape(socket.gethostname()) + r" to the lighthouse 10.8.0.1:29510 \(10.8.0.1: \[Errno 101\] "
                   r"Network is unreachable\)"):
        advertised_host("route", ("10.8.0.1", 29510))


def _listening_here() -> set:
    """The IPv4 addresses (dotted) this process's TCP sockets listen on (from /proc)."""
    import os
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    out = set()
    with open("/proc/net/tcp", encoding="ascii") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:  # LISTEN, our inode
                out.add(socket.inet_ntoa(bytes.fromhex(fields[1].split(":")[0])[::-1]))
    return out


@pytest.mark.skipif(not __import__("os").path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_the_cross_group_gloo_connections_listen_on_the_advertised_address(monkeypatch):
    """With ``advertise_host``, the quorum's Gloo process group listens on the advertised address
    (here 127.0.0.2, one of the loopback's), not on the address the host name resolves to, which
    another site cannot reach (tests/test_federation_rejoin.py cuts a real link between two
    network namespaces with it); without it, or with ``GLOO_SOCKET_IFNAME`` set, torchft's own."""
    import torch
    from torch.distributed import AllreduceOptions, TCPStore
    from torchft.process_group import ProcessGroupGloo

    from dept_mega.dept.federation_host import bound_to
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert bound_to(ProcessGroupGloo, None) is ProcessGroupGloo
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = bound_to(ProcessGroupGloo, "127.0.0.2")(timedelta(seconds=10))
    before = _listening_here()
    assert "127.0.0.2" not in before, before
    pg.configure(f"127.0.0.1:{store.port}/q", "dept_group_0", 0, 1, quorum_id=1, group_rank=0, group_world_size=1,
                 global_ranks=[0])
    assert "127.0.0.2" in _listening_here(), _listening_here()
    t = torch.ones(3)
    pg.allreduce([t], AllreduceOptions()).wait()
    assert torch.equal(t, torch.ones(3))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert bound_to(ProcessGroupGloo, "127.0.0.2") is ProcessGroupGloo


def test_the_advertise_line_names_the_interface_nccl_should_take(monkeypatch):
    """A GPU group job (the cross-group process group is NCCL's, which picks its own interface)
    that advertises an address and has no NCCL_SOCKET_IFNAME: its start line names the interface
    of that address to set it to; a CPU job (Gloo listens on the address itself), one with
    NCCL_SOCKET_IFNAME set and a loopback address get no such advice."""
    from dept_mega.dept import federation_host
    from dept_mega.dept.federation_host import advertise_line, interface_of
    assert interface_of("127.0.0.1") == "lo" and interface_of("localhost") == "lo"
    assert interface_of("no-such-host.invalid") is None and interface_of("192.0.2.254") is None
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(federation_host, "interface_of", lambda host: "wg0" if host == "10.8.0.3" else None)
    line = advertise_line(0, "10.8.0.3", "route", nccl=True)
    assert line.startswith("federation: rank 0's node advertises 10.8.0.3 to the other group jobs "
                           "(federation.advertise_host route); NCCL picks its own interface"), line
    assert line.endswith("export NCCL_SOCKET_IFNAME=wg0"), line
    assert "NCCL" not in advertise_line(0, "10.8.0.3", "route", nccl=False)
    assert advertise_line(0, "127.0.0.1", "route", nccl=True).endswith("which only jobs on this host reach")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "wg0")
    assert "NCCL" not in advertise_line(3, "10.8.0.3", "fqdn", nccl=True)


def test_a_federations_shutdown_closes_what_it_listens_on():
    """``Federation.shutdown`` leaves nothing listening: the healing server (above, ``_shut``) and,
    in a one-process job, the store it made for the quorum's process group (it stayed bound
    for the life of the process: a leak for a process that builds federations one after
    another, as the tests do)."""
    from types import SimpleNamespace

    from torch.distributed import TCPStore

    from dept_mega.dept.federation import Federation
    fed = object.__new__(Federation)
    fed._own_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = fed._own_store.port
    fed.manager = SimpleNamespace(shutdown=lambda wait: None)
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    fed.shutdown()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
