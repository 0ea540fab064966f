"""tests/mp_utils.free_port: ports below the kernel's ephemeral range, one slice per
pytest-xdist worker, never the same twice in a row, never one in use."""
import socket

from tests import mp_utils


def test_free_ports_are_per_worker_below_the_ephemeral_range_and_skip_ports_in_use(monkeypatch):
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = {}
    for w in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", w)
        slices[w] = mp_utils._port_slice()
    assert not set(slices["gw0"]) & set(slices["gw1"])
    assert max(slices["gw1"]) < low and min(slices["gw0"]) >= 1024
    monkeypatch.setattr(mp_utils, "_NEXT_PORT", [])
    a, b = mp_utils.free_port(), mp_utils.free_port()
    assert a != b and a in slices["gw1"] and b in slices["gw1"]
    # the next candidate in use (a listener): skipped
    nxt = slices["gw1"][mp_utils._NEXT_PORT[0] % len(slices["gw1"])]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", nxt))
        s.listen()
        assert mp_utils.free_port() not in (nxt, a, b)
