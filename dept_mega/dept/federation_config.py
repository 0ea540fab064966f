"""Federation mode's config side (docs/launching.md, "Federated group jobs"): the checks of the
``federation`` section a group job makes before it contacts anyone (``resolve``; also run by
``--check``), the lighthouse's reachability agreed over the job's ranks, which sources the job
holds, and the keys every group job must agree on, compared as hashes, with the values to name
the field that differs (at each heal: ``check_agree``; at a fresh start: federation_bookkeeping.py)."""
from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Optional

from ..config import ConfigError, source_groups
from ..config_diff import both, check_differing, differences
from ..parallel.agree import agree_errors
from ..variant import variant_of

if TYPE_CHECKING:
    import torch

#: config keys that must be the same in every group job (compared as hashes)
AGREE_KEYS = ("model", "dept.variant", "dept.outer_optimizer", "dept.local_steps", "dept.outer_comm_dtype",
              "dept.outer_quant_block", "dept.outer_fragments",
              "dept.body_optimizer_state", "dept.reset_inner_optimizer", "parallel", "precision", "train.steps",
              "train.seed", "optim", "federation.groups", "data.sources[].group", "data.sources[].summary")
#: the agreed keys of which group job holds each source, and of what each job knows of it
OWNER_KEY, SUMMARY_KEY = "data.sources[].group", "data.sources[].summary"
#: config keys compared where group jobs meet (a fresh start's quorum, a heal) like
#: :data:`AGREE_KEYS`, but not part of the run's identity (``federation_finished.run_key``):
#: every job may change them together across a restart of all of them. ``dept.outer_overlap``
#: sets the exchanges' order at a round end (overlapped: deferred to the next round start's
#: quorum, after a count of who contributes), so jobs that differ in it would pair unlike
#: collectives at every try
MEET_KEYS = ("federation.min_groups", "dept.outer_overlap")
#: every compared key, in the order of :func:`agree_values` and :func:`agree_hashes`
COMPARED_KEYS = AGREE_KEYS + MEET_KEYS


def _get(cfg, dotted: str):
    if dotted == OWNER_KEY:  # which group job holds each source (by name)
        return [[s.name, g] for s, g in zip(cfg.data.sources, source_owners(cfg))]
    if dotted == SUMMARY_KEY:  # each source's tokens and identity: a job's own from its files,
        from ..data.summary import agreed_facts  # the others' from their summaries (a stale summary differs)
        return agreed_facts(cfg)
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def agree_values(cfg) -> list:
    """Each :data:`COMPARED_KEYS` entry of ``cfg`` as plain JSON values (what a healing group is
    sent, to name the field that differs)."""
    return [json.loads(json.dumps(asdict(v) if is_dataclass(v) else v, sort_keys=True, default=str))
            for v in (_get(cfg, key) for key in COMPARED_KEYS)]


def agree_hashes(cfg) -> list[int]:
    """One 60-bit hash per :data:`COMPARED_KEYS` entry of ``cfg``."""
    return _hashes(agree_values(cfg))


def _hashes(values: list) -> list[int]:
    return [int.from_bytes(hashlib.sha256(json.dumps(v, sort_keys=True).encode()).digest()[:8], "little") >> 4
            for v in values]


def check_agree(cfg, peer: dict) -> None:
    """A healing group's agreed keys against its peer's (``peer``: its ``agree`` hashes and,
    from dept_mega versions that send them, its ``agree_values``): one ConfigError naming every
    field that differs with both values (from a peer that sends only hashes: every key that
    differs, and how many)."""
    values, own = peer.get("agree_values"), agree_values(cfg)
    keys = [i for i, (a, b) in enumerate(zip(_hashes(own), peer["agree"])) if a != b]
    if values:  # each field that differs (a key whose hash differs but whose values do not: the key, both values)
        rows = []
        for i in keys:
            facts = (_summary_rows(cfg, own[i], values[i], COMPARED_KEYS.index(OWNER_KEY) in keys)
                     if COMPARED_KEYS[i] == SUMMARY_KEY else None)
            rows += facts if facts is not None else [
                (COMPARED_KEYS[i] + where, both(mine, theirs, ("this job has", "the running groups have")))
                for where, mine, theirs in (differences(own[i], values[i]) or [("", own[i], values[i])])]
    else:
        rows = [(COMPARED_KEYS[i], "") for i in keys]
    check_differing(rows, "from the running groups'", "federation: every group job needs the same value")


def _summary_rows(cfg, mine: list, theirs: list, owners_differ: bool) -> Optional[list]:
    """A healing job's ``data.sources[].summary`` against the running groups', per source by
    name and field, with which copy is stale (``data/summary.py`` ``facts_rows``)."""
    from ..data.summary import facts_rows
    holders = None if owners_differ else ["this job" if g == cfg.federation.group else f"group {g}"
                                          for g in source_owners(cfg)]
    return facts_rows({"this job": mine, "the running groups": theirs}, holders)


def resolve(cfg) -> Optional[tuple[int, str, int]]:
    """Check the ``federation`` section; None for the single job, else (group, host, port).
    ``federation.group`` null is read from the environment variable DEPT_GROUP."""
    f = cfg.federation
    if f.lighthouse is None:
        return None
    group = f.group
    if group is None:
        env = os.environ.get("DEPT_GROUP")
        if env is None:
            raise ConfigError("config key 'federation.group': null and DEPT_GROUP is not set (this job's group index)")
        try:
            group = int(env)
        except ValueError:
            raise ConfigError(f"config key 'federation.group': DEPT_GROUP={env!r} is not an integer") from None
        f.group = group
    if f.groups < 1:
        raise ConfigError(f"config key 'federation.groups': must be >= 1, got {f.groups}")
    if not 0 <= group < f.groups:
        raise ConfigError(f"config key 'federation.group': {group} is not a group index in [0, {f.groups}) "
                          f"(federation.groups = {f.groups})")
    if not 1 <= f.min_groups <= f.groups:
        raise ConfigError(f"config key 'federation.min_groups': {f.min_groups} is not in [1, {f.groups}]")
    if not f.timeout_s > 0:
        raise ConfigError(f"config key 'federation.timeout_s': must be > 0, got {f.timeout_s}")
    if f.quorum_give_up_s is not None and not f.quorum_give_up_s > 0:
        raise ConfigError(f"config key 'federation.quorum_give_up_s': must be > 0 or null (wait forever), got "
                          f"{f.quorum_give_up_s}")
    addr = str(f.lighthouse)
    if addr.startswith("http://"):  # the URL the lighthouse prints (and torchft's TORCHFT_LIGHTHOUSE) is fine too
        addr = addr[len("http://"):].rstrip("/")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"config key 'federation.lighthouse': {f.lighthouse!r} is not host:port (e.g. "
                          "lh-host:29510, or the http://host:port that python -m dept_mega.lighthouse prints)")
    d = cfg.dept
    refusals = [("dept.variant", not variant_of(cfg).rounds,
                 "std (no outer sync; federation supports glob, trim, spec, spec_opt)"),
                ("dept.outer_delay", d.outer_overlap and d.outer_fragments > 1
                 and (d.outer_fragments - 1) * (d.local_steps // d.outer_fragments) + d.outer_delay > d.local_steps,
                 f"{d.outer_delay} lands fragment {d.outer_fragments - 2}'s overlapped sync in the next round "
                 f"(federation: only the round-end sync may be in flight across a round start's quorum; "
                 f"needs (outer_fragments - 1) * (local_steps // outer_fragments) + outer_delay <= local_steps)"),
                ("federation.advertise_host", f.advertise_host is not None and not str(f.advertise_host).strip(),
                 "empty (null: torchft's host name; fqdn; route; or a host name / IP address the other sites reach)"),
                ("data.sources", len(cfg.data.sources) < f.groups,
                 f"{len(cfg.data.sources)} sources for federation.groups = {f.groups} (each group job trains "
                 f"its own sources: at least one per group)")]
    for key, bad, what in refusals:
        if bad:
            raise ConfigError(f"config key '{key}': {what}")
    source_groups(cfg, f.groups)  # which sources each group job holds (their data stays at its site)
    return group, host, int(port)


def own_sources(cfg) -> list[str]:
    """The names of the sources this group job holds and trains (``data.sources[i].group``,
    null: i mod ``federation.groups``); the others' data and state are in other jobs."""
    return [s.name for s, g in zip(cfg.data.sources, source_owners(cfg)) if g == cfg.federation.group]


def source_owners(cfg) -> list[int]:
    """The group job of each source: ``config.source_groups``, or (K = G, no ``group`` keys)
    source i in job i."""
    return source_groups(cfg, cfg.federation.groups) or list(range(len(cfg.data.sources)))


def check_reachable(host: str, port: int, timeout_s: float, groups: int) -> Optional[int]:
    """Before the Manager starts (whose quorum request would wait without end on a wrong
    address): ``host:port`` accepts TCP and answers as a torchft lighthouse (its ``/status``
    page: a proxy, a firewall or another service on that port accepts the connection but does
    not), and its ``--min-groups`` (when its status shows it) is at most ``groups`` (else no
    quorum could ever form). Returns the lighthouse's ``--min-groups``, None when not shown."""
    import re

    from .federation_log import lighthouse_status
    wait = min(timeout_s, 10.0)
    try:
        with socket.create_connection((host, port), timeout=wait):
            pass
    except OSError as exc:
        raise ConfigError(f"config key 'federation.lighthouse': cannot reach {host}:{port} ({exc}); start python -m "
                          "dept_mega.lighthouse there before the group jobs, or give the host:port it prints "
                          "('lighthouse: http://HOST:PORT')") from None
    status = lighthouse_status(f"{host}:{port}", timeout=wait)
    if status is None:
        raise ConfigError(f"config key 'federation.lighthouse': {host}:{port} accepts connections but is not a torchft "
                          f"lighthouse (no quorum status at http://{host}:{port}/status within {wait:g} s): give the "
                          "host:port that python -m dept_mega.lighthouse prints ('lighthouse: http://HOST:PORT')")
    m = re.search(r"need min_replicas (\d+)", status)
    least = int(m.group(1)) if m else None
    if least is not None and least > groups:
        raise ConfigError(f"config key 'federation.groups': {groups}, but the lighthouse {host}:{port} forms quorums of "
                          f"at least {least} groups (its --min-groups): no round could start; set federation.groups "
                          f"to the number of group jobs (the same in every job; default 1), or restart the lighthouse "
                          f"with --min-groups <= {groups}")
    return least


def lighthouse_reachable(host: str, port: int, timeout_s: float, groups: int, device: torch.device) -> Optional[int]:
    """``check_reachable`` on every rank of this job, its verdict agreed: a lighthouse that one
    rank cannot reach (or whose ``/status`` times out there alone) stops every rank with that
    rank's line, instead of that rank alone while the others go on to the quorum and wait.
    Returns this rank's reading of the lighthouse's ``--min-groups`` (for the log)."""
    return agree_errors(lambda: check_reachable(host, port, timeout_s, groups), (ConfigError,), device)
