#!/bin/bash
# The short tuning runs behind the table in training/README.md (1 thread each, one after another,
# each invocation <= 6 minutes; a run cut by --stop-after-minutes is resumed once). ~50 min in all.
# Then: python -m training.tuning_table runs/tune-*
set -u
cd "$(dirname "$0")/.." && PY=${PYTHON:-.venv/bin/python}
COMMON="--no-export --eval-every-s 1e9 --eval-windows 64 --final-eval-windows 64 --stop-after-minutes 6
        --log-every 20 --threads 1 --batch-size 8 --seq-len 128"
run() {  # run NAME ARGS...: up to two invocations (the second resumes the first's checkpoint)
  local name=$1; shift
  for _ in 1 2; do
    $PY -m training.train_target $COMMON --name "$name" "$@" | tee "runs/$name.out"
    grep -q FINAL "runs/$name.out" && break
  done
}
mkdir -p runs
P="--preset proxy --warmup-steps 10 --tokens 1.2e5"
run tune-A-lr3e-3-cos   $P --lr 3e-3
run tune-D-lr3e-3-const $P --lr 3e-3 --min-lr-ratio 1.0
run tune-B-lr1e-3-cos   $P --lr 1e-3
run tune-C-lr1e-2-cos   $P --lr 1e-2
run tune-E-lr3e-3-cos-nomtp $P --lr 3e-3 --no-mtp
T="--preset target --warmup-steps 10 --tokens 5e4"
run tune-G1-target-lr1e-3 $T --lr 1e-3
run tune-G2-target-lr3e-3 $T --lr 3e-3
L="--preset proxy --warmup-steps 20 --tokens 3e5"
run tune-H-3e5-lr3e-3-cos   $L --lr 3e-3
run tune-I-3e5-lr3e-3-wsd   $L --lr 3e-3 --decay-frac 0.2
run tune-J-3e5-lr3e-3-const $L --lr 3e-3 --min-lr-ratio 1.0
