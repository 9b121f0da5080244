#!/usr/bin/env bash
# Sourced by test.sh and demo.sh: creates or reuses .venv and installs the package.
# torch==2.13.0 goes first, so that the package's own torch requirement finds it installed. It comes from the index
# pip is configured with (on public PyPI, for Linux, the multi-GB CUDA build); TORCH_INDEX_URL names another index
# for torch alone, e.g. TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU build.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
extras="${1-test}"  # the extras to install ("" for the package alone)
torch_index="${TORCH_INDEX_URL-}"
if [ -n "$torch_index" ] && [[ ! "$torch_index" =~ ^(https?|file)://[^[:space:]]+$ ]]; then
  echo "setup_env.sh: TORCH_INDEX_URL='$torch_index' is not an index URL (http://, https:// or file://, no spaces)" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# What was installed last, as a digest of the package's metadata, the extras and the torch index: when it has not
# changed, pip is not run again (the package is installed editable, so code changes need no reinstall). Delete
# .venv/setup.sha256 to reinstall anyway.
stamp=.venv/setup.sha256
wanted="$({ cat setup.cfg pyproject.toml 2>/dev/null || true; echo "extras=$extras index=$torch_index"; } \
  | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  return 0 2>/dev/null || exit 0
fi
rm -f "$stamp"
if [ -z "$torch_index" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
elif ! .venv/bin/python -m pip install --quiet --disable-pip-version-check --index-url "$torch_index" \
    torch==2.13.0; then
  echo "setup_env.sh: pip could not install torch==2.13.0 from TORCH_INDEX_URL=$torch_index" >&2
  exit 1
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"
echo "$wanted" > "$stamp"
