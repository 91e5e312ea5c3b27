#!/usr/bin/env bash
# The GPU check, prepared as one command (docs/performance.md, "On a GPU"). Run it from the
# repository root on a machine with a GPU and JAX's CUDA plugin; fuseloop needs no install
# (PYTHONPATH=src). Reports go under $OUT (default ./gpu-out).
#
#   bash tools/gpu_check.sh                      # every part, at most 9.5 minutes
#   bash tools/gpu_check.sh loop_form bench      # only those parts
#
# Parts, with what each took on an H200 in 2026-12 and its limit here: loop_form (11 s;
# 40), engine_costs (34 s, both loop forms; 80), bench (70 s; 90), zoo (84 s, and over
# 95 s once; 150), population (48 s; 75), whole_run (17 s; 40), tests (65 s; 100). Each
# runs under its own limit, so a slow part cannot take the others' time.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/bench${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false # the test workers share one GPU

loop_form() { timeout 40 python3 bench/loop_form.py --rounds 5; }
engine_costs() {
    timeout 40 python3 bench/engine_costs.py --rounds 15
    FUSELOOP_DEVICE_LOOP=while timeout 40 python3 bench/engine_costs.py --rounds 15
}
bench() { timeout 90 python3 -m fuseloop.cli bench --quick --json "$OUT/bench.json"; }
zoo() { timeout 150 python3 -m fuseloop.cli bench --quick --zoo --no-peers --json "$OUT/zoo.json"; }
population() { timeout 75 python3 -m fuseloop.cli bench --population --quick --json "$OUT/population.json"; }
whole_run() { timeout 40 python3 -m fuseloop.cli bench --whole-run --quick --json "$OUT/whole.json"; }
tests() {
    timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts="" -n 12 -rfE --tb=line \
        tests/test_loop_form.py tests/test_trainer.py tests/test_fusion_events.py \
        tests/test_fusion_consumption.py tests/test_reliability_faults.py \
        tests/test_population_members.py tests/test_data_arrays.py tests/test_halting.py \
        tests/test_metrics.py tests/test_whole_run.py tests/test_epoch_open.py
}

parts=("$@")
((${#parts[@]})) || parts=(loop_form engine_costs bench zoo population whole_run tests)
T0=$(date +%s)
{
    nvidia-smi -L
    python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
    for part in "${parts[@]}"; do
        echo "=== $part at +$(($(date +%s) - T0))s"
        "$part"
    done
    echo "=== done at +$(($(date +%s) - T0))s"
} 2>&1 | tee "$OUT/gpu_check.log"
