"""One rank of a group job that tests/federation_utils.py launches with torchrun's own
launcher (``torch.distributed.run.main``) in a process forked from the test's forkserver:
``torchrun --run-path tests/torchrun_rank.py ARGV`` runs this file in each worker, forked from
the launcher (``--start-method fork``), so that neither the launcher nor its workers import
torch and the trainer again. What each worker runs is ``python -m dept_mega.train ARGV``'s
``main``, in the environment torchrun's agent gives it (its store, restart count, ranks)."""
import sys

import torch

from dept_mega.train import main

torch.set_num_threads(1)
status = main(sys.argv[1:])
sys.stdout.flush()
sys.stderr.flush()
sys.exit(status)  # (torchrun's record(): 0 is the worker's success, anything else its failure)
