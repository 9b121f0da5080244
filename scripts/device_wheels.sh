#!/usr/bin/env bash
# Run before the GPU check (scripts/device_bench.sh), where the package index is reachable: puts into .whl/
# (git-ignored) the wheels a GPU machine whose Python ships its own CUDA torch lacks or holds in versions older than
# titans_hf needs, at the versions this checkout's .venv holds, for Python 3.12 (DEVICE_PYTHON sets another). Such
# an image (its own CUDA torch, accelerate, tokenizers and safetensors, but transformers 5.17 and huggingface_hub
# 1.33) needs transformers, huggingface_hub and their dependencies; the GPU check needs neither datasets nor the
# training extras.
#
#     bash scripts/device_wheels.sh        # then, on the GPU machine, with .whl/ beside the checkout:
#                                          # OUT=gpu_results bash scripts/device_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(transformers huggingface_hub httpx2 httpcore2 truststore h11 anyio idna click typer annotated-doc regex
          hf-xet typing_extensions)
[ -x .venv/bin/python ] || { echo "device_wheels.sh: no .venv here; run scripts/setup_env.sh first" >&2; exit 1; }
mapfile -t pinned < <(.venv/bin/python - "${packages[@]}" <<'PY'
import importlib.metadata
import sys

for name in sys.argv[1:]:
    print(f"{name}=={importlib.metadata.version(name)}")
PY
)
[ "${#pinned[@]}" -eq "${#packages[@]}" ] || { echo "device_wheels.sh: .venv lacks one of ${packages[*]}" >&2; exit 1; }
rm -rf .whl.tmp
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --dest .whl.tmp \
    --python-version "${DEVICE_PYTHON:-3.12}" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${pinned[@]}"
rm -rf .whl && mv .whl.tmp .whl
du -sh .whl && ls .whl
