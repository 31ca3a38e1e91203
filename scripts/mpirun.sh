#!/usr/bin/env bash
# mpirun with the flags this kind of machine needs: root, more ranks than cores, no core binding.
# Usage: scripts/mpirun.sh NP COMMAND...
np=$1; shift
flags=(--oversubscribe --bind-to none)
for v in PATH PYTHONPATH TRITON_INTERPRET OMP_NUM_THREADS MALLOC_MMAP_THRESHOLD_ GIFT_TEST_NODE_SIZE; do [ -n "${!v:-}" ] && flags+=(-x "$v"); done
[ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
exec mpirun -np "$np" "${flags[@]}" "$@"
