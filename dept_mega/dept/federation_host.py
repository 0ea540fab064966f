"""The host name a federated group job advertises to the other sites (``federation.advertise_host``).

torchft advertises ``socket.gethostname()`` — often a short name such as ``node017`` that the
other clusters cannot resolve — in three places: rank 0's manager server (which the lighthouse
hands to the other jobs), every rank's checkpoint HTTP server (which a healing peer fetches
from), and the store where the cross-group process group meets (``MASTER_ADDR``, or this
host's name for a one-process job without torchrun); and Gloo's cross-group connections listen
on, and are advertised at, the address the host name resolves to. ``federation.advertise_host``
replaces the name in all four (:func:`bound_to` for Gloo; NCCL picks its interface itself:
``NCCL_SOCKET_IFNAME``): ``fqdn`` (each rank's ``socket.getfqdn()``, for jobs of several nodes whose
full names the other sites resolve), ``route`` (each rank's IP address on its route to the
lighthouse: the source address the kernel picks to reach it, e.g. the node's VPN address when the
lighthouse is reached through the VPN; for jobs of several nodes known to the other sites only by
address), or a host name / IP address the other sites reach (for a group job of one node). null
keeps torchft's own (a job on one site, or names every site resolves).

A literal names one node, while every rank advertises its own healing server: on a group job of
several nodes the ranks of the other nodes would be advertised at the first node's address, where
a healing peer's fetch fails (or reaches another rank's server). Such a job is refused at start
(:func:`check_literal`): ``fqdn`` and ``route`` name each node by its own name or address.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Optional


#: the settings that name each node by its own name or address (not literals)
PER_NODE = ("fqdn", "route")


def advertised_host(setting: Optional[str], lighthouse: Optional[tuple[str, int]] = None) -> Optional[str]:
    """The host ``federation.advertise_host`` names on this rank's node (None: torchft's own);
    ``lighthouse`` (host, port) is what ``route`` finds the route to."""
    if setting is None:
        return None
    if setting == "fqdn":
        return socket.getfqdn()
    if setting == "route":
        if lighthouse is None:
            raise ValueError("advertise_host 'route' needs the lighthouse's address")
        return route_address(*lighthouse)
    return str(setting)


def is_loopback(address: str) -> bool:
    """Whether ``address`` is an IP address of the loopback network (only this host reaches it)."""
    import ipaddress
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def interface_of(host: str) -> Optional[str]:
    """The name of this node's network interface that holds the IPv4 address ``host`` is or
    resolves to (None: none of this node's, or not an IPv4 host)."""
    import fcntl
    import struct
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return None
    siocgifaddr = 0x8915  # Linux's ioctl: an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # (an interface without an IPv4 address)
                continue
            if socket.inet_ntoa(got[20:24]) == address:
                return name
    return None


def advertise_line(rank: int, host: str, setting: str, nccl: bool) -> str:
    """The line a node's first rank logs about what it advertises (``host``, from ``setting``);
    ``nccl``: the cross-group process group is NCCL's, which picks its own network interface
    (``NCCL_SOCKET_IFNAME``): where that is not set, the line names the advertised address's."""
    line = (f"federation: rank {rank}'s node advertises {host} to the other group jobs "
            f"(federation.advertise_host {setting})")
    if is_loopback(host):
        line += ": a loopback address, which only jobs on this host reach"
    elif nccl and not os.environ.get("NCCL_SOCKET_IFNAME"):
        iface = interface_of(host)
        line += ("; NCCL picks its own interface for the cross-group connections (NCCL_SOCKET_IFNAME is not set)"
                 + (f": if the other sites reach this node only at {host}, export NCCL_SOCKET_IFNAME={iface}"
                    if iface else ""))
    return line


def route_address(host: str, port: int) -> str:
    """This node's IPv4 address on its route to ``host``: the source address the kernel picks for
    a UDP socket connected there (a connect sends nothing). A ConfigError naming the key when
    ``host`` does not resolve to an IPv4 address or has no route (torchft writes the advertised
    host into ``http://HOST:PORT`` addresses, which an IPv6 address would need brackets in)."""
    from ..config import ConfigError
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except OSError as exc:
        raise ConfigError(f"config key 'federation.advertise_host': route: on {socket.gethostname()}, the "
                          f"lighthouse's host {host!r} does not resolve to an IPv4 address ({exc}); set fqdn or "
                          "this node's address") from None
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.connect(sockaddr)
            except OSError as exc:
                errors.append(f"{sockaddr[0]}: {exc}")
                continue
            return s.getsockname()[0]
    raise ConfigError(f"config key 'federation.advertise_host': route: no route from {socket.gethostname()} to the "
                      f"lighthouse {host}:{port} ({'; '.join(errors)})")


def check_literal(setting: Optional[str], world_size: int, local_world_size: Optional[int] = None) -> None:
    """A literal ``federation.advertise_host`` (not null, ``fqdn`` or ``route``) on a group job of several
    nodes (its ``world_size`` ranks more than the ``local_world_size`` torchrun starts on one node,
    ``LOCAL_WORLD_SIZE``): a ConfigError naming the key (module docstring)."""
    if setting is None or setting in PER_NODE:
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
                      "nodes are not there; set fqdn (each node advertises its own full name), route (each node its "
                      "address on its route to the lighthouse), null (torchft's host names, when every site "
                      "resolves them), or run the group job on one node")


def store_host(host: Optional[str], rank: int, store_addr: str) -> str:
    """The store address rank ``rank`` gives torchft's Manager, ``host`` the one this node
    advertises (:func:`advertised_host`). Rank 0's manager server passes it on to the other jobs,
    and rank 0 runs where the job's store does (torchrun's ``MASTER_ADDR``, or its own store): it
    advertises its own name. The other ranks only connect to the store themselves, by the name
    their job knows."""
    return host if host is not None and rank == 0 else store_addr


def manager_kwargs(host: Optional[str], timeout: timedelta) -> dict[str, Any]:
    """The Manager's arguments that advertise ``host`` (:func:`advertised_host`): ``hostname``
    (rank 0's manager server) and a checkpoint transport whose address names it (every rank's
    healing server); {} for None (torchft's defaults)."""
    if host is None:
        return {}
    from torchft.checkpointing.http_transport import HTTPTransport

    class AdvertisedHTTPTransport(HTTPTransport):
        """torchft's healing transport, giving peers ``host`` instead of ``socket.gethostname()``."""

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return {"hostname": host, "checkpoint_transport": AdvertisedHTTPTransport(timeout=timeout, num_chunks=0)}


def bound_to(cls, host: Optional[str]):
    """``cls`` (torchft's reconfigurable Gloo process group, or a subclass) whose Gloo device
    listens on ``host`` (:func:`advertised_host`), the address it gives the other jobs for the
    cross-group connections. Without this, Gloo takes the address ``socket.gethostname()``
    resolves to (or the loopback address, where that is not this node's), which another site
    cannot reach any more than the name torchft advertises: the quorum's process group fails to
    connect (``Gloo connectFullMesh failed ... Connect timeout``). ``GLOO_SOCKET_IFNAME``, when
    set, still wins (the user named the interface); None: ``cls`` as it is."""
    if host is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        return cls

    class BoundGloo(cls):
        def _create_pg(self, store, rank: int, world_size: int):
            # torchft's own _create_pg, with one Gloo device on `host` instead of the default one
            import torch
            from torch.distributed import ProcessGroup
            from torch.distributed import ProcessGroupGloo as Gloo
            pg = ProcessGroup(store, rank, world_size)
            pg._set_default_backend(ProcessGroup.BackendType.GLOO)
            options = Gloo._Options()
            options._timeout = self._timeout
            options._devices = [Gloo.create_device(hostname=host)]
            backend = Gloo(store, rank, world_size, options)
            backend._set_sequence_number_for_group()
            if self._global_ranks:
                backend.options.global_ranks_in_group = self._global_ranks
            if self._group_rank and self._group_world_size:
                backend.options.group_name = (f"torchft_quorum_{self._quorum_id}_rank_"
                                              f"{self._group_rank % self._group_world_size}")
            pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
            if torch.cuda.is_available():
                pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.GLOO, backend)
            return pg

    BoundGloo.__name__ = BoundGloo.__qualname__ = f"Bound{cls.__name__}"
    return BoundGloo
