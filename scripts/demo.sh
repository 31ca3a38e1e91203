#!/usr/bin/env bash
# The main job: a real 2-rank horovodrun training of the example Llama.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1
mkdir -p runs
flags=(-np 2 -H localhost:2)
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# horovodrun tags every line with [rank,slot]<stdout>:, which only rank 0 prints here
horovodrun "${flags[@]}" python examples/train_llama.py --steps "${DEMO_STEPS:-150}" --quiet \
  --compression "${DEMO_COMPRESSION:-gift-nvfp4}" --csv runs/demo.csv \
  | sed -u -e 's/\[[0-9]*,[0-9]*\]<std\(out\|err\)>://g'
