import os

import pytest
import torch

# Tests run on 2-core machines with several processes: one thread per process keeps
# multi-process tests from oversubscribing the cores and makes CPU results repeatable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA and are skipped without it. DEPT_MEGA_GPU_TESTS_ON_CPU=1
    runs tests/test_gpu.py on the CPU instead (a dry run of their logic for developers without a
    GPU; their CUDA-only assertions are skipped then)."""
    if torch.cuda.is_available() or os.environ.get("DEPT_MEGA_GPU_TESTS_ON_CPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
