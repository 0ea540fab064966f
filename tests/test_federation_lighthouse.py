"""The lighthouse check a federated group job makes before its torchft Manager starts
(``federation_config.check_reachable``): a wrong address fails in seconds with one error naming
the key, instead of a quorum request that waits without end (docs/launching.md §12, "Checks")."""
from __future__ import annotations

import http.server
import threading

import pytest

pytest.importorskip("torchft")

from dept_mega.config import ConfigError  # noqa: E402
from dept_mega.dept.federation_config import check_reachable  # noqa: E402
from tests.federation_utils import Lighthouse  # noqa: E402
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
    with pytest.raises(ConfigError, match=r"'federation\.lighthouse': cannot reach 127\.0\.0\.1:"):
        check_reachable("127.0.0.1", free_port(), 5.0, groups=2)


def test_a_lighthouse_that_needs_more_groups_than_the_run_has_is_refused():
    """A lighthouse started with --min-groups 3 for a run of 2 groups could never form a quorum:
    refused, naming both numbers; one with --min-groups 2 is fine and its minimum is returned
    (the job's start line says a round needs that many)."""
    lh = Lighthouse(min_groups=3)
    try:
        host, port = lh.addr.split(":")
        with pytest.raises(ConfigError, match=r"'federation\.groups': 2, but the lighthouse .* forms quorums of at "
                                              r"least 3 groups \(its --min-groups\)"):
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
