#!/usr/bin/env bash
# Installs what the tests need into .venv, then runs pytest offline (nothing may download), on two workers with one
# OpenMP thread each (the suite's models are tiny: a second thread per process only adds contention on 2 cores).
set -euo pipefail
source "$(dirname "$0")/setup_env.sh" test
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"
