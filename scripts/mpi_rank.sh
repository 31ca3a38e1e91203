#!/usr/bin/env bash
# One rank of a test suite under mpirun or torchrun: rank 0 prints to the terminal, every rank
# keeps a log, and a failing rank other than 0 prints its own log so its message reaches the
# output.
# Usage: scripts/mpi_rank.sh LOG_PREFIX COMMAND...
prefix=$1; shift
rank=${OMPI_COMM_WORLD_RANK:-${RANK:-0}}
log="$prefix-rank$rank.log"
if [ "$rank" = 0 ]; then
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
else
  "$@" >"$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || { echo "--- rank $rank failed (exit $rc), its log:"; tail -n 60 "$log"; } >&2
fi
exit $rc
