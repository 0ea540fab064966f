import os

import pytest
import torch

# Tests run on 2-core machines with several processes: one thread per process keeps
# multi-process tests from oversubscribing the cores and makes CPU results repeatable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The files with a test marked ``slow`` first (in their order; the others after them, in
    theirs): pytest-xdist hands files out in this order (tools/test.sh passes
    --no-loadscope-reorder, else it orders them by their number of tests), and a long file
    started last keeps one worker busy while the others idle.

    Tests marked ``gpu`` need CUDA and are skipped without it. DEPT_MEGA_GPU_TESTS_ON_CPU=1
    runs tests/test_gpu.py on the CPU instead (a dry run of their logic for developers without a
    GPU; their CUDA-only assertions are skipped then)."""
    slow_files = {item.fspath for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.fspath not in slow_files)  # (stable: a file's tests stay together, in order)
    if torch.cuda.is_available() or os.environ.get("DEPT_MEGA_GPU_TESTS_ON_CPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """What collection leaves (torch, the project, every test module and item) moves to the
    collector's permanent generation: the full collections during the tests then skip it instead
    of walking it each time (~3% of a worker's CPU). Later objects are collected as before."""
    import gc
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def dp2_reference(tmp_path_factory):
    """The uninterrupted run that tests/test_restart.py's restarted job and tests/test_preemption.py's
    relaunched job must end equal to: examples/tiny/std.yaml on 2 data-parallel ranks,
    REFERENCE_STEPS steps, no checkpoint; {step: loss}. Its ranks are forked (tests/test_restart.py's
    _forked: the job torchrun launches there, without torchrun's start, which is not what the
    reference is for). One run for the session: under pytest-xdist the two files usually run in
    different workers, so the first one to ask runs it and leaves the losses beside the workers'
    temporary directories, under a lock the other waits on (pytest-xdist's recipe for a session
    fixture that runs once)."""
    import fcntl
    import json

    from tests.test_restart import REFERENCE_STEPS, _forked
    from tests.trainer_utils import ensure_sample_corpus, read_jsonl
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this session's, every worker's
    path = shared / f"dp2_reference_{REFERENCE_STEPS}.json"
    with open(shared / "dp2_reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            ensure_sample_corpus()
            ref = str(tmp_path_factory.mktemp("dp2_reference") / "ref")
            _forked(ref, REFERENCE_STEPS, "train.save_interval=0")
            losses = {r["step"]: r["loss"] for r in read_jsonl(os.path.join(ref, "metrics.jsonl")) if r["kind"] == "train"}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(losses))  # floats round-trip exactly
            tmp.replace(path)
        return {int(step): loss for step, loss in json.loads(path.read_text()).items()}
