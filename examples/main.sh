#!/usr/bin/env bash
# The main job, from a fresh clone: set up, build the sample corpus's tokenizers and Megatron
# indexed binaries, train a tiny STD baseline and a tiny SPEC-OPT run on CPU (gloo), and print
# per-source validation bits per byte, outer bytes per round and parameters per rank.
#
#   bash examples/main.sh            # a few minutes on a 2-core machine
#
# Runs go to runs/main_std and runs/main_spec_opt (replaced on each call). Both runs see the
# same number of tokens per inner step: STD one group with a global batch of 5 x 16 sequences
# mixed over the 5 sources, SPEC-OPT 5 groups (one per source, each with its own tokenizer and
# embeddings) of 16 sequences each.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
PY=.venv/bin/python
export OMP_NUM_THREADS=1

echo "== 1/4 sample corpus: tokenizers and indexed binaries"
$PY tools/prepare_sample.py

echo "== 2/4 STD baseline: 1 process, 5 sources mixed in every batch"
rm -rf runs/main_std
$PY -m torch.distributed.run --standalone --nproc-per-node 1 -m dept_mega.train \
    --config examples/tiny/std.yaml train.run_dir=runs/main_std train.global_batch_size=80

echo "== 3/4 SPEC-OPT: 5 source groups (gloo), one tokenizer and embedding per source"
rm -rf runs/main_spec_opt
$PY -m torch.distributed.run --standalone --nproc-per-node 5 -m dept_mega.train \
    --config examples/tiny/spec_opt.yaml train.run_dir=runs/main_spec_opt

echo "== 4/4 results"
$PY tools/summarize_runs.py runs/main_std runs/main_spec_opt --json runs/main_summary.json
