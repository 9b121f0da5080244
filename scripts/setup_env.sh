#!/usr/bin/env bash
# Sourced by test.sh and demo.sh: creates or reuses .venv and installs the package.
# torch==2.13.0 goes first: it is a CPU wheel on disk, while a bare torch requirement
# resolved by pip would pull a multi-GB CUDA build.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
extras="${1-test}"  # the extras to install ("" for the package alone)
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"
