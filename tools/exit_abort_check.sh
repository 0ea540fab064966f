#!/bin/bash
# Launch a short 4-rank GLOB training (int8 + error feedback, a checkpoint, an evaluation) N
# times and count the launches that fail, e.g. with SIGABRT at process exit ("terminate
# called without an active exception": see dept_mega/process_exit.py). Run from the
# repository root after `python tools/prepare_sample.py`:  bash tools/exit_abort_check.sh 40
set -u
N=${1:-10}; ab=0; PY=${PYTHON:-.venv/bin/python}
for i in $(seq 1 "$N"); do
  rm -rf /tmp/exitrun
  $PY -m torch.distributed.run --standalone --nproc-per-node 4 -m dept_mega.train --config examples/tiny/glob.yaml model.num_layers=2 train.steps=8 train.eval_interval=8 train.eval_iters=1 train.save_interval=4 train.log_interval=4 dept.local_steps=4 'data.sources=[{name: en, prefix: examples/data/build/en_global_text_document}, {name: fr, prefix: examples/data/build/fr_global_text_document}, {name: ru, prefix: examples/data/build/ru_global_text_document}, {name: code, prefix: examples/data/build/code_global_text_document}]' dept.outer_comm_dtype=int8 dept.outer_error_feedback=true train.global_batch_size=16 train.run_dir=/tmp/exitrun > /tmp/exitrun.log 2>&1
  rc=$?
  if grep -q "terminate called" /tmp/exitrun.log || [ $rc != 0 ]; then ab=$((ab+1)); echo "run $i: rc $rc"; cp /tmp/exitrun.log "/tmp/exitrun_abort_$i.log"; fi
done
echo "aborted $ab of $N"
