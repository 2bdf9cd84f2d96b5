"""Evaluation: the harness that samples a run on a task's records and writes metrics
(:mod:`dgemma.eval.harness`), the generic text metrics (:mod:`dgemma.eval.generic`), Lite's
language-model evaluation, verified Sudoku solving and the denoising visualiser. Each task's own
scoring lives with the task (:mod:`dgemma.tasks`)."""
