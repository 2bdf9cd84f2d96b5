"""The shipped Sudoku solver's second stage: ``configs/sudoku_wide.py``'s model, warm-started from
its step-5,000 weights and trained on puzzles with exactly one solution only.

Measured (EMA weights, 768 held-out boards, 81 steps, greedy): step 500 solved 100 / 97.3 / 69.1%
of easy / medium / hard boards, step 1,000 100 / 96.1 / 71.1% (the source: 100 / 98.1 / 65.2%):
hard boards gain, medium ones drift down, which is why ``configs/sudoku_deep.py`` widens the clue
range. Deviations from ``configs/sudoku_wide.py``, each with its reason:

- ``init.weights``: start from the width-128 run's step 5,000 (its held-out curve and its training
  loss are flat from step 3,000, so more of the same recipe does not help);
- every training puzzle has one solution (``data.sudoku_unique=1.0``): a random blanking of fewer
  than ~30 clues has many solutions, and training on one of them as *the* answer teaches the model
  to commit a guess with full confidence, which is how its wrong hard boards go wrong (13-37 wrong
  cells committed at probability ~1.0, checkpoints/sudoku_wide/README.md);
- a pool of 10,000 puzzles (2,000 before) with 22-32 clues (22-35 before): hard-leaning, and five
  times as many distinct puzzles, so the model cannot lean on having seen a board's pattern;
  building the pool takes about 3 minutes at every start;
- a fresh AdamW with warm-up, LR 5e-4 cosine to 5e-5 over 3,000 steps (about an hour on one
  thread), and a weight average (``train.ema=0.998``), evaluated instead of the raw weights.

    dgemma train --cfg=configs/sudoku_hard.py --cfg.workdir=runs/sudoku_hard
    dgemma eval --task=sudoku --cfg.workdir=runs/sudoku_hard
"""

from dgemma.data.sudoku import structure_groups
from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, OptimConfig,
                                    TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=16, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=None,
            layer_types=["full_attention"] * 4, max_position_embeddings=256, rope_local_theta=10_000.0,
            rope_global_theta=10_000.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            attn_implementation="sdpa", canvas_position_groups=structure_groups(),
        ),
        init=InitConfig(base=None, seed=0, weights="checkpoints/sudoku_wide/checkpoints/step_00005000"),
        diffusion=DiffusionConfig(process="absorbing", schedule="linear", t_eps=1e-3, canvas_size=81,
                                  num_canvases=1, selfcond_prob=0.0, ar_loss_weight=0.0, loss_chunk_tokens=4096,
                                  loss_on="noised"),
        data=DataConfig(task="sudoku", path=None, tokenizer="digits", prompt_len=82, batch_size=64, seed=1,
                        pin_clues=True, sudoku_unique=1.0, sudoku_unique_pool=10_000,
                        sudoku_unique_clues=(22, 32)),
        optim=OptimConfig(name="adamw", lr=5e-4, min_lr_ratio=0.1, warmup_steps=100, betas=(0.9, 0.98),
                          weight_decay=0.01, clip_norm=1.0),
        train=TrainConfig(steps=3000, checkpoint_every=250, keep_last=None, log_every=10, threads=1,
                          dtype="float32", ema=0.998),
        eval_ds=EvalConfig(batch_size=128, steps=[81], step_type="commit", temperature=0.0, early_stopping=None,
                           num_examples=768),
    )
