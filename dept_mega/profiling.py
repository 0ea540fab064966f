"""``train.profile: {start: S, stop: E, ranks: [...]}``: a torch.profiler trace of inner steps
S+1 … E on the selected global ranks.

Each selected rank writes ``RUN/profile/rank{r}_steps{F}-{E}.json``, a Chrome trace (open it in
chrome://tracing or https://ui.perfetto.dev), with CPU activities and, when CUDA is available,
CUDA kernels; a ``ProfilerStep#N`` range marks each step N. Step N is the step after which N inner
steps are done, as in the metrics records: the trace starts when S steps are done (or at once when
a run resumes between S and E) and stops when E are done or the run ends, whichever comes first.
The file name and the log line name the steps the trace holds, first and last: ``F`` = S + 1 (the
resumed step + 1 after a resume), ``E`` the last one traced (``start: 1, stop: 2`` writes
``rank0_steps2-2.json``, holding ``ProfilerStep#2`` only). Other ranks do nothing.

The trace records each operator's input shapes and strides (``record_shapes``), so that
``benchmarks/kernel_breakdown.py`` can say which operator, on which shapes, launched each kernel.
That costs about 0.4 µs of host time per operator (measured on a CPU: 1.9 µs per small operator
under the profiler without shapes, 2.3 with them, 1.35 without a profiler) and makes the file
1.5-1.6 times larger (a CPU trace of the trainer; kernels and launches carry no shapes); only
the profiled steps pay it. Not recorded: Python stacks (``with_stack``: the Python tracer slows
the host, whose time the trace measures) and module names (``with_modules`` fills them only for
TorchScript models).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch


class StepProfiler:
    def __init__(self, cfg, run_dir: str, rank: int, device: torch.device | str,
                 log: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.rank = rank
        self.device = torch.device(device)
        self.log = log
        self.enabled = cfg is not None and rank in cfg.ranks
        self._prof: Optional[torch.profiler.profile] = None
        self._step_range = None
        self._first: Optional[int] = None
        self.paths: list[str] = []

    def _activities(self) -> list:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda" and torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        return acts

    def starts_or_stops(self, steps_done: int, before: bool) -> bool:
        """Whether :meth:`before_step` (``before``) or :meth:`after_step` with this count starts
        the profiler or stops it and writes the trace: the caller keeps that time (seconds for
        a large GPU trace) out of its throughput."""
        return self._starts(steps_done) if before else self._stops(steps_done)

    def _starts(self, steps_done: int) -> bool:
        return (self.enabled and self._prof is None and self._first is None
                and self.cfg.start <= steps_done < self.cfg.stop)

    def _stops(self, steps_done: int) -> bool:
        return self._prof is not None and steps_done >= self.cfg.stop

    def before_step(self, steps_done: int) -> None:
        """Call before each training step with the number of inner steps done."""
        if not self.enabled:
            return
        if self._starts(steps_done):
            self._prof = torch.profiler.profile(activities=self._activities(), record_shapes=True)
            self._prof.start()
            self._first = steps_done
        if self._prof is not None:
            self._step_range = torch.profiler.record_function(f"ProfilerStep#{steps_done + 1}")
            self._step_range.__enter__()

    def after_step(self, steps_done: int) -> None:
        """Call after each training step with the number of inner steps done."""
        if self._prof is None:
            return
        self._end_step()
        if self._stops(steps_done):
            self._finish(steps_done)

    def close(self, steps_done: int) -> None:
        """End of the run (or an exception): write what was recorded."""
        if self._prof is not None:
            self._finish(steps_done)

    def _end_step(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _finish(self, steps_done: int) -> None:
        self._end_step()
        prof, self._prof = self._prof, None
        prof.stop()
        out = os.path.join(self.run_dir, "profile")
        os.makedirs(out, exist_ok=True)
        first = self._first + 1  # the first step traced: ProfilerStep#{first}
        path = os.path.join(out, f"rank{self.rank}_steps{first}-{steps_done}.json")
        prof.export_chrome_trace(path)
        self.paths.append(path)
        held = f"step {first}" if first == steps_done else f"steps {first}-{steps_done}"
        self.log(f"profile: rank {self.rank} wrote {path} ({held})")


class PhaseTimer:
    """Seconds of one phase of work on ``device`` (a DEPT round end, its outer step).

    On CUDA: two events on the current stream, i.e. the GPU's time from where the phase was
    queued to where it ended, resolved by ``seconds()`` (which waits for the end event: call
    it where the record is written, at a point that waits anyway). Host wall-clock timing
    there would only measure how long the host took to queue the work. Elsewhere: wall clock.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._end = None
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> "PhaseTimer":
        if self.cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._end = time.perf_counter()
        return self

    @property
    def stopped(self) -> bool:
        return self._end is not None

    def seconds(self) -> float:
        if self._end is None:
            raise RuntimeError("PhaseTimer.seconds() before stop()")
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._end - self._start
