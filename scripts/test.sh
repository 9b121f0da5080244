#!/usr/bin/env bash
# Installs what the tests need into .venv, then runs pytest offline (nothing may download).
set -euo pipefail
source "$(dirname "$0")/setup_env.sh" test
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
