#!/usr/bin/env bash
# Runs tests/ in one process, then mpi_tests/ under mpirun -np 2 and -np 4 (every rank runs every
# test) and the collective's suites under -np 8, torchrun_tests/ (DDP, FSDP2) under torchrun on 2
# and 4 ranks (FSDP across nodes on 4 and 8), then the robustness campaign. Fails if any suite or any rank fails; every test
# runs under a timeout, and a suite that hangs anyway is killed and named.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
which=${1:-all}
MPI_SUITE_TIMEOUT=${MPI_SUITE_TIMEOUT:-900}
MPI_TEST_TIMEOUT=${MPI_TEST_TIMEOUT:-120}   # per test; the longest takes about 15 s on 4 ranks here
# at 8 ranks (oversubscribed 4x here) the FSDP-across-nodes tests that differ from 4 ranks' in
# what they exercise: training and replicas, residual bytes, resume, refusals
FSDP_HOPS_AT_8="training_follows or replicas or residuals or resume or refused"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TRITON_INTERPRET=1   # kernels run in Triton's CPU interpreter here; a GPU run uses benchmarks/gpu_check.py
mkdir -p .build
failed=()
timings=()      # "seconds  suite", printed at the end: where make test's time goes

if [ "$which" = all ] || [ "$which" = unit ]; then
  echo "=== ruff check (pyflakes and pycodestyle at 100 columns; pyproject.toml) ==="
  .venv/bin/ruff check . || failed+=("ruff check")
  echo "=== mypy (horovod_gift's annotations; pyproject.toml) ==="
  .venv/bin/mypy || failed+=("mypy")
  echo "=== tests/ (single process) ==="
  # two workers of one thread each: most of the time is the Triton interpreter, one core each
  start=$SECONDS
  OMP_NUM_THREADS=1 "$PY" -m pytest tests -q -n 2
  rc=$?
  timings+=("$((SECONDS - start))s  tests/")
  # pytest exit 5 means no test was collected: that is a failure of the suite, not a pass.
  [ $rc -eq 0 ] || failed+=("tests/ (pytest exit $rc)")
fi

# run_suite NAME LOG_PREFIX COMMAND...: one multi-process suite; a suite that hangs is killed and
# its ranks' logs (LOG_PREFIX-rank*.log, written by scripts/mpi_rank.sh) shown.
run_suite() {
  local name=$1 prefix=$2; shift 2
  rm -f "$prefix"-rank*.log
  local start=$SECONDS
  timeout --kill-after=30 "$MPI_SUITE_TIMEOUT" "$@"
  local rc=$?
  timings+=("$((SECONDS - start))s  $name")
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "HUNG: $name did not finish within ${MPI_SUITE_TIMEOUT}s and was killed."
    for f in "$prefix"-rank*.log; do echo "--- last lines of $f"; tail -n 5 "$f"; done
    failed+=("$name (hung)")
  elif [ $rc -ne 0 ]; then
    failed+=("$name (exit $rc)")
  fi
}

# run_mpi NP PYTEST_ARGS...: mpi_tests/ (or some of it) under mpirun -np NP.
run_mpi() {
  local np=$1; shift
  run_suite "mpi_tests np=$np" ".build/mpi_tests-np$np" bash scripts/mpirun.sh "$np" \
    bash scripts/mpi_rank.sh ".build/mpi_tests-np$np" "$PY" -m pytest "$@" -q --timeout "$MPI_TEST_TIMEOUT"
}

# run_torchrun NP PYTEST_ARGS...: torchrun_tests/ (or some of it) under torchrun on NP ranks
# (gloo on the CPU, no Horovod).
run_torchrun() {
  local np=$1; shift
  run_suite "torchrun_tests np=$np" ".build/torchrun_tests-np$np" \
    .venv/bin/torchrun --standalone --nproc-per-node "$np" --no-python \
    bash scripts/mpi_rank.sh ".build/torchrun_tests-np$np" "$PY" -m pytest "$@" -q \
    --timeout "$MPI_TEST_TIMEOUT"
}

if [ "$which" = all ] || [ "$which" = mpi ]; then
  for np in 2 4; do
    echo "=== mpi_tests/ under mpirun -np $np (every rank runs every test; rank 0 reports) ==="
    run_mpi "$np" mpi_tests
  done
  # Horovod's options and training again with nodes of 2 ranks (GIFT's auto topology: two-hop),
  # less what only the flat reduction has (its byte count, the rotation's fold)
  echo "=== mpi_tests/ (options and training) under mpirun -np 4 as 2 nodes x 2 ranks ==="
  GIFT_TEST_NODE_SIZE=2 run_mpi 4 mpi_tests/test_gift.py mpi_tests/test_horovod_options.py \
    -k "not bytes_on_the_wire and not native_kernels"
  # the collective at 8 ranks (oversubscribed here): the tests that run it end to end, and
  # two hops as 2 nodes x 4 ranks and 4 x 2
  echo "=== mpi_tests/ (the collective's tests) under mpirun -np 8 ==="
  run_mpi 8 mpi_tests/test_allreduce.py mpi_tests/test_scale.py mpi_tests/test_two_hop.py \
    mpi_tests/test_distributed_optimizer.py \
    mpi_tests/test_gift.py::test_training_matches_fp32_and_parameters_stay_identical \
    mpi_tests/test_gift.py::test_horovod_options_keep_ranks_identical \
    mpi_tests/test_gift.py::test_checkpoint_resume_is_bit_identical
fi

if [ "$which" = all ] || [ "$which" = torch ]; then
  # FSDP across nodes (test_fsdp_hops.py) needs 2 nodes of 2 ranks or more: 4 ranks as 2 x 2
  echo "=== torchrun_tests/ under torchrun --nproc-per-node 2 (DDP, FSDP2 and the trainers on gloo) ==="
  run_torchrun 2 torchrun_tests --ignore=torchrun_tests/test_fsdp_hops.py
  echo "=== torchrun_tests/ under torchrun --nproc-per-node 4 (and FSDP2 across 2 x 2 nodes) ==="
  # the trainers' integrations run on 2 ranks only: what they add is the trainer's glue
  run_torchrun 4 torchrun_tests --ignore=torchrun_tests/test_integrations.py
  echo "=== torchrun_tests/test_fsdp_hops.py under torchrun --nproc-per-node 8 (2 x 4 nodes) ==="
  run_torchrun 8 torchrun_tests/test_fsdp_hops.py -k "$FSDP_HOPS_AT_8"
fi

if [ "$which" = all ] || [ "$which" = robustness ]; then
  # The fault campaign on 2 ranks of Horovod, DDP and FSDP2 (about 3 minutes);
  # `python benchmarks/robustness.py` also runs 4 ranks, flat and as 2 nodes x 2, and HSDP.
  echo "=== benchmarks/robustness.py --configs horovod:2,ddp:2,fsdp:2 (bad input, rank disagreement, crashes; each case under a watchdog) ==="
  start=$SECONDS
  "$PY" benchmarks/robustness.py --configs horovod:2,ddp:2,fsdp:2 || failed+=("robustness campaign")
  timings+=("$((SECONDS - start))s  robustness campaign")
fi

if [ "$which" = faults ]; then
  # What make test leaves out for time (about 25 minutes here): every engine's rank killed every
  # way and resumed, and the campaign over every configuration (4 ranks, 2 nodes x 2, HSDP).
  echo "=== tests/test_launch.py -k killed, GIFT_FAULTS=all (SIGKILL, SIGTERM, exit 1 x DDP, FSDP2, HSDP, Horovod) ==="
  start=$SECONDS
  GIFT_FAULTS=all "$PY" -m pytest tests/test_launch.py -k killed -q || failed+=("process faults")
  timings+=("$((SECONDS - start))s  process faults")
  echo "=== benchmarks/robustness.py, every configuration ==="
  start=$SECONDS
  "$PY" benchmarks/robustness.py || failed+=("robustness campaign, every configuration")
  timings+=("$((SECONDS - start))s  robustness campaign, every configuration")
fi

echo "=== time per suite ==="
printf '  %s\n' "${timings[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all suites passed"
