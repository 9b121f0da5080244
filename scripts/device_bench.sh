#!/usr/bin/env bash
# The GPU check: run on a GPU machine whose Python ships its own CUDA torch, in a checkout that holds .whl/ (filled
# beforehand by scripts/device_wheels.sh), with OUT naming the folder the results go to:
#
#     OUT=gpu_results bash scripts/device_bench.sh
#
# Installs the wheels of .whl/ in front of the machine's packages, prints the versions and the GPU, then runs
# `bench_model.py --gpu` twice: eager only (a few minutes at most), then with compile_chunks() on inductor, whose
# compile unrolls the 64 update chunks of each 4096-token chunk and may take minutes. Each run writes its table and
# JSON to $OUT as it ends, so the eager figures are there even if the compiled run outlasts its time limit.
# `bash scripts/device_bench.sh eager` stops after the eager run.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:?device_bench.sh: OUT (the folder the device tool returns) is not set}"
python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 - <<'PY' 2>&1 | tee "$out/versions.txt" || exit 1
import huggingface_hub
import torch
import transformers

import titans_hf.modeling  # noqa: F401

print(f"torch {torch.__version__}, transformers {transformers.__version__}, huggingface_hub "
      f"{huggingface_hub.__version__}, device {torch.cuda.get_device_name() if torch.cuda.is_available() else None}")
PY
timeout 200 python3 scripts/bench_model.py --gpu --compile-backend none --json "$out/bench_gpu_eager.json" 2>&1 \
    | tee "$out/bench_gpu_eager.log"
[ "${1:-}" = eager ] && exit 0
timeout 330 python3 scripts/bench_model.py --gpu --json "$out/bench_gpu.json" 2>&1 | tee "$out/bench_gpu.log"
