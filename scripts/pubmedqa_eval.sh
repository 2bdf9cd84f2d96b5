#!/usr/bin/env bash
# The PubMedQA evaluation behind checkpoints/pubmedqa_270m/README.md. Every setting comes from the
# runs' config.json (32-token canvases, greedy commits in blocks of 4, stop aliases folded).
#   curves  the first 16 train-eval questions at every kept checkpoint, 32 steps (DIR/curve16)
#   test    the first 64 test questions (4 batches of 16): diffusion at 8, 16 and 32 steps per
#           canvas, the AR baseline greedy, on the same questions (DIR/subset_diffusion, AR/subset)
#   verdict (verdict-first data) all 500 test questions, first canvas only (--cfg.eval_ds.max_canvases=1;
#           AR: its first 32 tokens): the verdict is in it, and a block decoder writes canvas 1 the
#           same whether or not later canvases follow, so these accuracies are the full decoder's
#           (DIR/verdict500, AR/verdict500)
#   curves50 (verdict-first data) the 50 train-eval questions, first canvas, 32 steps, every kept
#           checkpoint of both runs (DIR/curve50, AR/curve50)
#   speed   tokens/s at batch 1, 8 questions, both models (an idle machine: nothing else running)
#   report  the table and the curves (scripts/pubmedqa_report.py)
#
#   scripts/pubmedqa_eval.sh curves|curves50|test|verdict|speed|report [DIFFUSION_DIR] [AR_DIR] [OUT]
set -euo pipefail
part=${1:?curves, curves50, test, verdict, speed or report}
D=${2:-runs/pubmedqa_270m}
A=${3:-runs/pubmedqa_270m_ar}
OUT=${4:-$D}
steps() { ls "$1/checkpoints" | sed 's/^step_0*//'; }
case $part in
  curves)
    for s in $(steps "$D"); do
      dgemma eval --cfg.workdir="$D" --step="$s" --eval_names=train_eval_sample_ar_steps32 --out="$D/curve16" \
        --cfg.eval_ds.num_examples=16 --ar_max_tokens=0
    done ;;
  verdict)
    dgemma eval --cfg.workdir="$D" --out="$D/verdict500" --cfg.eval_ds.max_canvases=1 --ar_max_tokens=0 \
      --eval_names="${VERDICT_EVALS:-sample_ar_steps32,sample_ar_steps16,sample_ar_steps8}"
    dgemma eval --cfg.workdir="$A" --out="$A/verdict500" --cfg.eval_ds.max_canvases=1 ;;
  curves50)
    for s in $(steps "$D"); do
      dgemma eval --cfg.workdir="$D" --step="$s" --eval_names=train_eval_sample_ar_steps32 --out="$D/curve50" \
        --cfg.eval_ds.max_canvases=1 --ar_max_tokens=0
    done
    for s in $(steps "$A"); do
      dgemma eval --cfg.workdir="$A" --step="$s" --out="$A/curve50" --cfg.eval_ds.max_canvases=1 \
        --eval_names=train_eval_ar_greedy
    done ;;
  test)
    dgemma eval --cfg.workdir="$D" --out="$D/subset_diffusion" --cfg.aux.eval_num_batches=4 --ar_max_tokens=0 \
      --eval_names=sample_ar_steps32,sample_ar_steps16,sample_ar_steps8
    dgemma eval --cfg.workdir="$A" --out="$A/subset" --cfg.aux.eval_num_batches=4 ;;
  speed)
    dgemma eval --cfg.workdir="$D" --out="$D/batch1_diffusion" --cfg.eval_ds.batch_size=1 --cfg.aux.eval_num_batches=8 \
      --ar_max_tokens=0 --eval_names=sample_ar_steps32,sample_ar_steps8
    dgemma eval --cfg.workdir="$A" --out="$A/batch1_ar" --cfg.eval_ds.batch_size=1 --cfg.aux.eval_num_batches=8 ;;
  report)
    python scripts/pubmedqa_report.py --diffusion "$D/subset_diffusion" --ar "$A/subset" \
      --verdict "$D/verdict500" "$A/verdict500" --curves "$D/curve50" "$A/curve50" \
      --losses "$D" "$A" --batch1 "$D/batch1_diffusion" "$A/batch1_ar" --out "$OUT" ;;
  *) echo "unknown part $part: curves, curves50, test, verdict, speed or report" >&2; exit 2 ;;
esac
