#!/usr/bin/env bash
# The PubMedQA evaluation behind checkpoints/pubmedqa_270m/README.md, in three parts:
#   curves  held-out accuracy on the 50 train-eval questions at every kept checkpoint (accuracy
#           only: may share the machine with a training run)
#   test    the 500 test questions: the diffusion run's main evaluator (16 steps, early stopping) and
#           the AR baseline's greedy decoding at batch 16; the other diffusion evaluators (8/32
#           steps, with and without early stopping, 16 without) on the first 112 questions (7
#           batches: each evaluator re-encodes every prompt, ~12 min per 500 on this CPU)
#   speed   tokens/s on an idle machine: 16 questions at batch 1, 2 batches of 16 (both models)
#   report  the table and the curves (scripts/pubmedqa_report.py)
#
#   scripts/pubmedqa_eval.sh curves|test|speed|report [DIFFUSION_DIR] [AR_DIR] [OUT]
set -euo pipefail
part=${1:?curves, test, speed or report}
D=${2:-runs/pubmedqa_270m}
A=${3:-runs/pubmedqa_270m_ar}
OUT=${4:-$D}
steps() { ls "$1/checkpoints" | sed 's/^step_0*//'; }
case $part in
  curves)
    for s in $(steps "$A"); do dgemma eval --cfg.workdir="$A" --step="$s" --eval_names=train_eval_ar_greedy; done
    for s in $(steps "$D"); do
      dgemma eval --cfg.workdir="$D" --step="$s" --eval_names=train_eval_sample_ar_steps16_early_stopping --ar_max_tokens=0
    done ;;
  test)
    dgemma eval --cfg.workdir="$D" --eval_names=sample_ar_steps16_early_stopping --ar_max_tokens=0
    dgemma eval --cfg.workdir="$A"
    dgemma eval --cfg.workdir="$D" --out="$D/subset_diffusion" --cfg.aux.eval_num_batches=7 --ar_max_tokens=0 \
      --eval_names=sample_ar_steps8,sample_ar_steps8_early_stopping,sample_ar_steps16,sample_ar_steps32,sample_ar_steps32_early_stopping ;;
  speed)
    for b in 1 16; do
      n=$((b == 1 ? 16 : 2))
      dgemma eval --cfg.workdir="$D" --out="$D/batch${b}_diffusion" --cfg.eval_ds.batch_size=$b \
        --cfg.aux.eval_num_batches=$n --ar_max_tokens=0 --eval_names=sample_ar_steps16_early_stopping,sample_ar_steps8_early_stopping
      dgemma eval --cfg.workdir="$A" --out="$A/batch${b}_ar" --cfg.eval_ds.batch_size=$b --cfg.aux.eval_num_batches=$n
    done ;;
  report)
    python scripts/pubmedqa_report.py --diffusion "$D" --ar "$A" --subset "$D/subset_diffusion" \
      --batch1 "$D/batch1_diffusion" "$A/batch1_ar" --batch16 "$D/batch16_diffusion" "$A/batch16_ar" --out "$OUT" ;;
  *) echo "unknown part $part: curves, test, speed or report" >&2; exit 2 ;;
esac
