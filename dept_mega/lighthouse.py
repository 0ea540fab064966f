"""The lighthouse of federated source groups: ``python -m dept_mega.lighthouse --port PORT --min-groups N``.

A thin wrapper over torchft's ``LighthouseServer`` (its Rust quorum service): every group
job's torchft Manager heartbeats to it and asks it for a quorum at each round boundary.
It prints its address (``lighthouse: http://HOST:PORT``) and runs until killed.

``--join-timeout-s``: how long a quorum waits for a live group that has not reached the
boundary yet before it forms without it (a round start, or the survivors' new quorum after an
exchange timed out on a slow group: they then wait ``federation.timeout_s`` + this; torchft
forms it only when the groups asking are more than half of those that heartbeat, so with 2
groups a slow one is always waited for: docs/launching.md §12). It waits only while a group
of the previous quorum has not asked: once all of those ask, torchft forms the quorum at once
from the groups that asked, so a group that heartbeats but has not asked yet (a relaunched job
still loading its checkpoint) joins at the first boundary after its request; ``--heartbeat-timeout-s``:
after how long without a heartbeat a group counts as gone (a killed job, a cut network).
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from .log_lines import write_line


def serve(port: int, min_groups: int, bind: str = "[::]", join_timeout_s: float = 60.0,
          heartbeat_timeout_s: float = 5.0):
    """Start torchft's ``LighthouseServer`` with this CLI's settings and return it (serving on its
    own threads until ``shutdown()``); ``main`` below is the command around it. Raises ImportError
    without torchft, and what torchft raises when the address cannot be listened on."""
    from torchft.coordination import LighthouseServer
    return LighthouseServer(bind=f"{bind}:{port}", min_replicas=min_groups,
                            join_timeout_ms=int(join_timeout_s * 1000),
                            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dept_mega.lighthouse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True, help="TCP port to listen on (0: any free port)")
    ap.add_argument("--min-groups", type=int, required=True, help="fewest group jobs that form a quorum")
    ap.add_argument("--bind", default="[::]",
                    help="address to listen on: a private or VPN interface's (nothing is authenticated, and the "
                         "/status page can kill a group job); an IPv6 address in brackets (default [::]: all)")
    ap.add_argument("--join-timeout-s", type=float, default=60.0,
                    help="seconds a quorum waits for a live group that has not joined yet (default 60)")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=5.0,
                    help="seconds without a heartbeat after which a group counts as gone (default 5, for one "
                         "cluster; between sites 30, as examples/1b/lighthouse.sh: docs/launching.md §12)")
    args = ap.parse_args(argv)
    if args.min_groups < 1:
        print("error: --min-groups must be >= 1", file=sys.stderr)
        return 2
    try:
        import torchft.coordination  # noqa: F401
    except ImportError as exc:
        print(f"error: the lighthouse needs torchft (pip install 'dept_mega[federation]'): {exc}", file=sys.stderr)
        return 2
    try:
        server = serve(args.port, args.min_groups, args.bind, args.join_timeout_s, args.heartbeat_timeout_s)
    except Exception as exc:  # noqa: BLE001 - the port is taken or the address invalid
        print(f"error: --port {args.port}: the lighthouse cannot listen: {exc}", file=sys.stderr)
        return 2
    write_line(f"lighthouse: {server.address()}", sys.stdout)  # one write: torchft logs from its threads meanwhile
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
