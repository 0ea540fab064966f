"""The host name a federated group job advertises to the other sites (``federation.advertise_host``).

torchft advertises ``socket.gethostname()`` — often a short name such as ``node017`` that the
other clusters cannot resolve — in three places: rank 0's manager server (which the lighthouse
hands to the other jobs), every rank's checkpoint HTTP server (which a healing peer fetches
from), and the store where the cross-group process group meets (``MASTER_ADDR``, or this
host's name for a one-process job without torchrun). ``federation.advertise_host`` replaces the
name in all three: ``fqdn`` (each rank's ``socket.getfqdn()``, for jobs of several nodes), or a
host name / IP address the other sites reach (for a group job of one node, e.g. its VPN
address). null keeps torchft's own (a job on one site, or names every site resolves).

A literal names one node, while every rank advertises its own healing server: on a group job of
several nodes the ranks of the other nodes would be advertised at the first node's address, where
a healing peer's fetch fails (or reaches another rank's server). Such a job is refused at start
(:func:`check_literal`): ``fqdn`` names each node by its own name.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Optional


def advertised_host(setting: Optional[str]) -> Optional[str]:
    """The host ``federation.advertise_host`` names on this rank's node (None: torchft's own)."""
    if setting is None:
        return None
    return socket.getfqdn() if setting == "fqdn" else str(setting)


def check_literal(setting: Optional[str], world_size: int, local_world_size: Optional[int] = None) -> None:
    """A literal ``federation.advertise_host`` (not null, not ``fqdn``) on a group job of several
    nodes (its ``world_size`` ranks more than the ``local_world_size`` torchrun starts on one node,
    ``LOCAL_WORLD_SIZE``): a ConfigError naming the key (module docstring)."""
    if setting is None or setting == "fqdn":
        return
    if local_world_size is None:
        try:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        except ValueError:
            return  # (not torchrun's: nothing known of the nodes)
    if local_world_size <= 0 or world_size <= local_world_size:
        return
    from ..config import ConfigError
    nodes = -(-world_size // local_world_size)
    raise ConfigError(f"config key 'federation.advertise_host': {setting!r} is one node's address, but this group "
                      f"job runs on {nodes} nodes ({world_size} ranks, {local_world_size} per node: "
                      "LOCAL_WORLD_SIZE): every rank advertises its healing server at it, and the ranks of the other "
                      "nodes are not there; set fqdn (each node advertises its own full name), null (torchft's host "
                      "names, when every site resolves them), or run the group job on one node")


def store_host(setting: Optional[str], rank: int, store_addr: str) -> str:
    """The store address rank ``rank`` gives torchft's Manager. Rank 0's manager server passes it
    on to the other jobs, and rank 0 runs where the job's store does (torchrun's ``MASTER_ADDR``,
    or its own store): it advertises its own name. The other ranks only connect to the store
    themselves, by the name their job knows."""
    host = advertised_host(setting)
    return host if host is not None and rank == 0 else store_addr


def manager_kwargs(setting: Optional[str], timeout: timedelta) -> dict[str, Any]:
    """The Manager's arguments that advertise ``federation.advertise_host``: ``hostname`` (rank 0's
    manager server) and a checkpoint transport whose address names it (every rank's healing
    server); {} without the setting (torchft's defaults)."""
    host = advertised_host(setting)
    if host is None:
        return {}
    from torchft.checkpointing.http_transport import HTTPTransport

    class AdvertisedHTTPTransport(HTTPTransport):
        """torchft's healing transport, giving peers ``host`` instead of ``socket.gethostname()``."""

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return {"hostname": host, "checkpoint_transport": AdvertisedHTTPTransport(timeout=timeout, num_chunks=0)}
