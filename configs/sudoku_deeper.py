"""The Sudoku solver made deeper again: ``configs/sudoku_deep.py``'s 8-layer model, warm-started
from its step-3,000 weights into 16 layers, on the same unique puzzles.

Deviations from ``configs/sudoku_deep.py``, each with its reason:

- 16 layers instead of 8 (``init.layer_map=[0..7, 0..7]``): going from 4 to 8 layers lifted hard
  boards from 65.2% to 80-82%, after which the held-out curve was nearly flat from step 1,500
  while the training loss still fell: depth, not steps, was the lever that moved. Layers 8-15
  start as copies of layers 0-7 with their residual outputs switched off, so at step 0 the model
  solves exactly what its source solves;
- a 1,200-step schedule on two threads (the source climbed most of its way within its first
  1,500 steps; a 16-layer step costs twice an 8-layer one), to fit one session.

Measured, not shipped (2026-12-03, 2 threads, 3.3 s a step, 72 min): hard held-out boards solved
model only (81 steps, weight average, the 256 hard ones of the 768) at steps 400 / 600 / 1,000 /
1,200: 74.6 / 81.6 / 79.3 / 80.1%, against 82.4% for the source at step 0. The doubled depth did
not pay within this schedule, so ``checkpoints/sudoku_deep`` (step 3,000) stayed the shipped solver.

    dgemma train --cfg=configs/sudoku_deeper.py --cfg.workdir=runs/sudoku_deeper
    dgemma eval --task=sudoku --cfg.workdir=runs/sudoku_deeper
"""

from dgemma.data.sudoku import structure_groups
from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, OptimConfig,
                                    TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=16, hidden_size=128, intermediate_size=512, num_hidden_layers=16, num_attention_heads=4,
            num_key_value_heads=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=None,
            layer_types=["full_attention"] * 16, max_position_embeddings=256, rope_local_theta=10_000.0,
            rope_global_theta=10_000.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            attn_implementation="sdpa", canvas_position_groups=structure_groups(),
        ),
        init=InitConfig(base=None, seed=0, weights="checkpoints/sudoku_deep/checkpoints/step_00003000",
                        layer_map=[*range(8), *range(8)]),
        diffusion=DiffusionConfig(process="absorbing", schedule="linear", t_eps=1e-3, canvas_size=81,
                                  num_canvases=1, selfcond_prob=0.0, ar_loss_weight=0.0, loss_chunk_tokens=4096,
                                  loss_on="noised"),
        data=DataConfig(task="sudoku", path=None, tokenizer="digits", prompt_len=82, batch_size=64, seed=1,
                        pin_clues=True, sudoku_unique=1.0, sudoku_unique_pool=10_000,
                        sudoku_unique_clues=(22, 36)),
        optim=OptimConfig(name="adamw", lr=5e-4, min_lr_ratio=0.1, warmup_steps=100, betas=(0.9, 0.98),
                          weight_decay=0.01, clip_norm=1.0),
        train=TrainConfig(steps=1200, checkpoint_every=200, keep_last=None, log_every=10, threads=2,
                          dtype="float32", ema=0.998),
        eval_ds=EvalConfig(batch_size=128, steps=[81], step_type="commit", temperature=0.0, early_stopping=None,
                           num_examples=768),
    )
