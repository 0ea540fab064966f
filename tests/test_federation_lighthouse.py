"""The lighthouse check a federated group job makes before its torchft Manager starts
(``federation_config.check_reachable``): a wrong address fails in seconds with one error naming
the key, instead of a quorum request that waits without end (docs/launching.md §12, "Checks")."""
from __future__ import annotations

import http.server
import threading
import time

import pytest

pytest.importorskip("torchft")

from dept_mega.config import ConfigError  # noqa: E402
from dept_mega.dept.federation_config import check_reachable  # noqa: E402
from tests.federation_utils import ROOT, Lighthouse, wait_for  # noqa: E402
from tests.mp_utils import free_port  # noqa: E402


def test_an_address_that_is_not_a_lighthouse_is_refused():
    """A port where another service answers (here a plain HTTP server; a proxy or firewall that
    accepts every connection looks the same to TCP) is refused by name, as is a closed port."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match=r"'federation\.lighthouse': 127\.0\.0\.1:\d+ accepts connections but "
                                              r"is not a torchft lighthouse"):
            check_reachable("127.0.0.1", server.server_address[1], 5.0, groups=2)
    finally:
        server.shutdown()
    with pytest.raises(ConfigError, match=r"'federation\.lighthouse': cannot reach 127\.0\.0\.1:\d+ \(.*\); start "
                                          r"python -m dept_mega\.lighthouse there before the group jobs"):
        check_reachable("127.0.0.1", free_port(), 5.0, groups=2)


def test_a_lighthouse_that_needs_more_groups_than_the_run_has_is_refused():
    """A lighthouse started with --min-groups 3 for a run of 2 groups could never form a quorum:
    refused, naming both numbers; one with --min-groups 2 is fine and its minimum is returned
    (the job's start line says a round needs that many)."""
    lh = Lighthouse(min_groups=3)
    try:
        host, port = lh.addr.split(":")
        with pytest.raises(ConfigError, match=r"'federation\.groups': 2, but the lighthouse .* forms quorums of at "
                                              r"least 3 groups \(its --min-groups\): no round could start; set "
                                              r"federation\.groups to the number of group jobs .* or restart the "
                                              r"lighthouse with --min-groups <= 2"):
            check_reachable(host, int(port), 5.0, groups=2)
        assert check_reachable(host, int(port), 5.0, groups=3) == 3
    finally:
        lh.stop()


def test_a_lighthouse_is_asked_directly_not_through_the_environments_proxy(monkeypatch):
    """A cluster's http_proxy (for the internet) cannot reach a lighthouse on an internal
    address, and torchft's own client does not use it: the check reads /status directly, so a
    real lighthouse is not refused where the proxy variables are set."""
    dead = f"http://127.0.0.1:{free_port()}"  # a proxy that refuses every connection
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, dead)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    lh = Lighthouse(min_groups=2)
    try:
        host, port = lh.addr.split(":")
        assert check_reachable(host, int(port), 5.0, groups=2) == 2
    finally:
        lh.stop()


def test_lighthouse_counts_the_quorum_requests_it_holds():
    """The rejoin tests' sync point (wait_for_requests): the lighthouse's count of groups that
    asked for a quorum not formed yet — a group that only heartbeats is not counted, and a
    quorum formed clears it (torchft's LighthouseClient playing two groups; 2 heartbeat, 1 asks:
    torchft holds the quorum, one group is not more than half of two)."""
    import threading
    from datetime import timedelta

    from torchft.coordination import LighthouseClient
    lh = Lighthouse(min_groups=1)
    stop = threading.Event()
    try:
        client = LighthouseClient(f"http://{lh.addr}", timedelta(seconds=10))

        def heartbeat():  # group 0 is alive throughout (as a job's Manager, every 100 ms)
            while not stop.is_set():
                client.heartbeat("dept_group_0")
                stop.wait(0.1)

        threading.Thread(target=heartbeat, daemon=True).start()
        client.heartbeat("dept_group_1")
        assert lh.waiting() == 0, lh.status()
        done = []

        def ask(g):
            done.append(client.quorum(f"dept_group_{g}", timedelta(seconds=60), address="a", store_address="s",
                                      step=0, world_size=1))

        t = threading.Thread(target=ask, args=(1,), daemon=True)
        t.start()
        wait_for(lambda: lh.waiting() == 1, "the lighthouse does not count group 1's request", 30)
        time.sleep(0.3)  # (a few of the lighthouse's 100 ms quorum ticks)
        assert t.is_alive() and not done and lh.waiting() == 1, lh.status()  # held: group 0 has not asked
        ask(0)
        t.join(30)
        assert len(done) == 2 and sorted(m.replica_id for m in done[0].participants) == ["dept_group_0", "dept_group_1"]
        assert lh.waiting() == 0, lh.status()
    finally:
        stop.set()
        lh.stop()


def test_quorum_ranks_from_torchft_configure():
    """Which group each rank of an exchange is comes from the ``global_ranks`` argument that
    torchft's Manager passes to the process group's ``configure`` (a public argument):
    recorded by federation.recording(); a torchft whose configure lost it fails loudly."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    from dept_mega.dept.federation import recording
    for cls in (ProcessGroupGloo, ProcessGroupNCCL):
        assert "global_ranks" in __import__("inspect").signature(cls.configure).parameters, cls
        recording(cls)
    # the Manager passes it by keyword or by position: both recorded
    seen = []

    class Base:
        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                      group_world_size=None, global_ranks=None):
            seen.append(global_ranks)

    pg = recording(Base)()
    pg.configure("a", "r", 0, 2, 1, 0, 1, [3, 1])
    assert pg.quorum_ranks == [3, 1] and seen == [[3, 1]]
    pg.configure("a", "r", 0, 2, quorum_id=2, global_ranks=[1])
    assert pg.quorum_ranks == [1]

    class Old:
        def configure(self, store_addr, replica_id, rank, world_size):
            pass

    with pytest.raises(RuntimeError, match="no global_ranks argument"):
        recording(Old)


def test_the_command_starts_as_documented_and_refuses_a_bad_minimum():
    """``python -m dept_mega.lighthouse`` as a command (the other tests run its ``main`` in a
    forked process): a minimum below 1 is refused before torchft is imported (~0.1 s)."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-m", "dept_mega.lighthouse", "--port", "0", "--min-groups", "0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 2 and res.stderr.strip() == "error: --min-groups must be >= 1", res.stderr
