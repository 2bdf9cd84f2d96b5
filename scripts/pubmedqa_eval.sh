#!/usr/bin/env bash
# The PubMedQA evaluation behind checkpoints/pubmedqa_270m/README.md, in three parts:
#   curves  held-out accuracy on the 50 train-eval questions at every kept checkpoint (accuracy
#           only: may share the machine with a training run)
#   test    the 500 test questions: the diffusion run's evaluators (steps 8/16/32, with and without
#           early stopping) and the AR baseline's greedy decoding, batch 16, then 20 questions at
#           batch 1 for speed (run this part on an idle machine: it measures tokens/s)
#   report  the table and the curves (scripts/pubmedqa_report.py)
#
#   scripts/pubmedqa_eval.sh curves|test|report [DIFFUSION_DIR] [AR_DIR] [OUT]
set -euo pipefail
part=${1:?curves, test or report}
D=${2:-runs/pubmedqa_270m}
A=${3:-runs/pubmedqa_270m_ar}
OUT=${4:-$D}
steps() { ls "$1/checkpoints" | sed 's/^step_0*//'; }
case $part in
  curves)
    for s in $(steps "$A"); do dgemma eval --cfg.workdir="$A" --step="$s" --eval_names=train_eval_ar_greedy; done
    for s in $(steps "$D"); do
      dgemma eval --cfg.workdir="$D" --step="$s" --eval_names=train_eval_sample_ar_steps16 --ar_max_tokens=0
    done ;;
  test)
    dgemma eval --cfg.workdir="$D" --ar_max_tokens=0
    dgemma eval --cfg.workdir="$A"
    dgemma eval --cfg.workdir="$D" --out="$D/batch1_diffusion" --cfg.eval_ds.batch_size=1 \
      --cfg.aux.eval_num_batches=20 --ar_max_tokens=0
    dgemma eval --cfg.workdir="$A" --out="$A/batch1_ar" --cfg.eval_ds.batch_size=1 --cfg.aux.eval_num_batches=20 ;;
  report)
    python scripts/pubmedqa_report.py --diffusion "$D" --ar "$A" --batch1 "$D/batch1_diffusion" "$A/batch1_ar" \
      --out "$OUT" ;;
  *) echo "unknown part $part: curves, test or report" >&2; exit 2 ;;
esac
