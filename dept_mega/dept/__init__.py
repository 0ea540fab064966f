"""DEPT: rounds, outer synchronisation, TRIM's global table, per-source state (docs/dept.md).

``build_round_hooks(cfg, pg, trainer, device)`` returns the ``RoundHooks`` the training loop
calls for ``dept.variant`` in glob | trim | spec | spec_opt (std uses the loop's StdHooks).
"""
from .driver import DeptHooks, build_round_hooks
from .source_info import SourceInfo, sources_from_config

__all__ = ["DeptHooks", "SourceInfo", "build_round_hooks", "sources_from_config"]
