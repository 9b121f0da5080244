#!/usr/bin/env bash
# The recall recipe on your-own-documents tooling, offline on a CPU: a toy Qwen3 base pretrained on short recall
# text (stage a), long recall documents generated and prepared into token stores, the memory trained on the frozen
# base with titans-hf train --dataset titans_tokens (stage b), then titans-hf eval --lm on held-out documents, on
# every token and on the recalled values only, memory on and off; scripts/recall_report.py prints and draws it.
#
#   scripts/recall.sh                                  # writes outputs/recall/{base,data,memory}
#   RUN=window scripts/recall.sh --attend_previous_chunk true   # same base and data, another memory
#
# Environment: OUT (default outputs/recall), RUN (the memory's folder below OUT, default memory), BASE_STEPS,
# NUM_TRAIN, NUM_EVAL, MAX_STEPS (smaller values for a quick try). Extra arguments go to titans-hf train. The base
# and data are made once and reused while complete; a RUN folder holding an earlier run's checkpoints is never
# trained over (choose another RUN, or pass --resume_from_checkpoint last).
set -euo pipefail
started=$SECONDS
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" test
echo "environment ready in $((SECONDS - started))s"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
out="${OUT:-outputs/recall}"
run="$out/${RUN:-memory}"
window=256
titans=.venv/bin/titans-hf

if [ ! -f "$out/base/pretraining.json" ]; then  # the folder appears only whole
  $titans recall toy-base --output-dir "$out/base" --steps "${BASE_STEPS:-1200}" --overwrite
fi
if [ ! -f "$out/data/eval_seq/meta.json" ]; then  # the last of the data to be written
  $titans recall generate --output-dir "$out/data" --tokenizer "$out/base" --window-size $window \
    --num-train "${NUM_TRAIN:-19200}" --num-eval "${NUM_EVAL:-128}" --overwrite
  $titans prepare "$out/data/train.jsonl" --output "$out/data/train_seq" --tokenizer "$out/base" --overwrite
  $titans prepare "$out/data/eval.jsonl" --output "$out/data/eval_seq" --tokenizer "$out/base" --overwrite
fi
echo "toy base and data ready at $((SECONDS - started))s"

# one window per document (each is at most 255 tokens and its EOS), chunks of 32 tokens: 8 chunks a window
$titans train --model_name_or_path "$out/base" --dataset titans_tokens \
  --data_files "$out/data/train_seq" --eval_data_files "$out/data/eval_seq" \
  --window_size $window --respect_document_boundaries --pad_tail \
  --chunk_size 32 --memory_num_heads 4 --memory_head_dim 16 --conv_kernel 6 --memory_chunk_size 8 \
  --update_rule gradient --max_lr 1.0 --forget_bias_init -4 \
  --checkpoint_chunks false \
  --per_device_train_batch_size 16 --gradient_accumulation_steps 1 --max_steps "${MAX_STEPS:-1200}" \
  --learning_rate 1e-2 --lr_scheduler_type constant_with_warmup --warmup_steps 20 --weight_decay 0 \
  --logging_steps 100 --save_steps 400 --save_total_limit 1 --report_to none --seed 0 \
  --output_dir "$run" "$@"
echo "memory trained at $((SECONDS - started))s"

lm_eval=(eval --lm --model "$run" --window-size $window --respect-document-boundaries --pad-tail --batch-size 16)
$titans "${lm_eval[@]}" --data "$out/data/eval_seq" --output "$run/lm_all_tokens"
$titans "${lm_eval[@]}" --data "$out/data/eval_dependent" --train-type sft --output "$run/lm_recalled_values"
.venv/bin/python scripts/recall_report.py "$out"
echo "recall.sh finished in $((SECONDS - started))s (install included)"
