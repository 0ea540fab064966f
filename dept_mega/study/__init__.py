"""Reproduction studies: a grid of runs at equal compute, run sequentially or in parallel,
resumable, summarised as the paper's Table 3 with figures (``tools/study.py``)."""
from .grid import GridError, RunSpec, Study, load_study
from .results import RunReadError, RunResult, read_run

__all__ = ["GridError", "RunSpec", "Study", "load_study", "RunReadError", "RunResult", "read_run"]
