import os

import torch

# Tests run on 2-core machines with several processes: one thread per process keeps
# multi-process tests from oversubscribing the cores and makes CPU results repeatable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
