#!/usr/bin/env bash
# Idempotent set-up of everything `make demo` and `make test` need: OpenMPI, the project venv
# (torch CPU wheel, triton, numpy, mpi4py, pytest), Horovod 0.28.1 built from its sdist with the
# C++17 fix, and the project itself. Each step prints one line; compiler output goes to .build/.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
LOG_DIR=.build
mkdir -p "$LOG_DIR"
step() { printf '[setup] %-52s' "$1"; }

step "OpenMPI (libopenmpi-dev, openmpi-bin)"
if dpkg -s libopenmpi-dev openmpi-bin >/dev/null 2>&1 && command -v mpirun >/dev/null; then
  echo "present"
else
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  { $SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends \
      libopenmpi-dev openmpi-bin; } >"$LOG_DIR/apt.log" 2>&1 || { echo "FAILED (see $LOG_DIR/apt.log)"; exit 1; }
  echo "installed"
fi

step "virtualenv $VENV"
if [ -x "$PY" ]; then echo "present"; else python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"; echo "created"; fi

step "python packages (torch, triton, mpi4py, ...)"
if "$PY" scripts/check_requirements.py >/dev/null 2>&1; then
  echo "present"
else
  "$PY" -m pip install -q --upgrade pip setuptools wheel packaging >"$LOG_DIR/pip.log" 2>&1
  "$PY" -m pip install -r requirements.txt >>"$LOG_DIR/pip.log" 2>&1 \
    || { echo "FAILED (see $LOG_DIR/pip.log)"; exit 1; }
  "$PY" scripts/check_requirements.py >>"$LOG_DIR/pip.log" 2>&1 \
    || { echo "FAILED: installed versions differ (see $LOG_DIR/pip.log)"; exit 1; }
  echo "installed"
fi

step "horovod 0.28.1 (PyTorch + MPI)"
horovod_ok() { "$PY" -c "import horovod, horovod.torch as hvd; assert horovod.__version__ == '0.28.1' and hvd.mpi_built()" >/dev/null 2>&1; }
if horovod_ok; then
  echo "present"
else
  echo "building (about 6-10 min, log: $LOG_DIR/horovod.log)"
  src=$LOG_DIR/horovod-src
  rm -rf "$src" && mkdir -p "$src"
  {
    "$PY" -m pip download --no-deps --no-binary :all: -d "$src" horovod==0.28.1
    tar -xzf "$src"/horovod-0.28.1.tar.gz -C "$src"
    # torch >= 2.1 headers require C++17; Horovod 0.28.1 pins C++14 (fixed on its master, unreleased).
    grep -rl 'CMAKE_CXX_STANDARD 14' "$src/horovod-0.28.1" --include=CMakeLists.txt \
      | xargs sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/'
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS=-j"$(nproc)" \
      "$PY" -m pip install -v --no-build-isolation --no-deps "$src/horovod-0.28.1"
  } >"$LOG_DIR/horovod.log" 2>&1 || { echo "[setup] horovod build FAILED; last lines of $LOG_DIR/horovod.log:"; tail -n 30 "$LOG_DIR/horovod.log"; exit 1; }
  horovod_ok || { echo "[setup] horovod installed but horovod.torch does not import with MPI"; exit 1; }
  step "horovod 0.28.1 (PyTorch + MPI)"; echo "built"
fi

step "horovod-gift (editable)"
if "$PY" -c "import horovod_gift.kernels" >/dev/null 2>&1; then
  echo "present"
else
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$LOG_DIR/project.log" 2>&1 \
    || { echo "FAILED (see $LOG_DIR/project.log)"; exit 1; }
  echo "installed"
fi
