"""Sudoku from scratch on a laptop CPU: a small Gemma-style model, digit tokens, one canvas.

The adapter machinery unchanged: the puzzle is the prompt, prefilled by the causal encoder into
the KV cache; the 81-digit solution is denoised as one canvas. Absorbing (masked) noise, as
docs/design.md §11 found that uniform noise needs far more compute from scratch. Training puzzles are
generated on the fly (data.path unset); evaluation uses held-out unique puzzles. The clues are
pinned in the canvas (infilling: never noised, scored or resampled) and the loss is on masked
cells only (MDLM), the two choices docs/design.md §11 found mattered most after the noise process. Every
canvas cell also gets learned row, column and box embeddings (``model.canvas_position_groups``
from ``dgemma.data.sudoku.structure_groups``): rotary positions alone cannot tell a cell where
it sits on the board, and this was docs/design.md §11's largest single gain. 3,000 steps of batch
64 took 14 min 29 s on the idle 2-core CPU (2 threads, measured end to end, 2026-12-04; 14 min 24 s
on 2026-12-02) and solve 82.4% of 768 held-out boards (99.6% easy, 94.9% medium, 52.7% hard; 84.1%
in an earlier run: README.md). The shipped solver is wider and deeper (checkpoints/sudoku_avg).

    dgemma prepare sudoku --out data/sudoku --n 768 --seed 1
    dgemma train --cfg=configs/sudoku_small.py --cfg.workdir=runs/sudoku_small
"""

from dgemma.data.sudoku import structure_groups
from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, OptimConfig,
                                    TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=16, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=None,
            layer_types=["full_attention"] * 4, max_position_embeddings=256, rope_local_theta=10_000.0,
            rope_global_theta=10_000.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            attn_implementation="sdpa", canvas_position_groups=structure_groups(),
        ),
        init=InitConfig(base=None, seed=0),
        diffusion=DiffusionConfig(process="absorbing", schedule="linear", t_eps=1e-3, canvas_size=81,
                                  num_canvases=1, selfcond_prob=0.0, ar_loss_weight=0.0, loss_chunk_tokens=4096,
                                  loss_on="noised"),
        data=DataConfig(task="sudoku", path=None, tokenizer="digits", prompt_len=82, batch_size=64, seed=0,
                        pin_clues=True),
        optim=OptimConfig(name="adamw", lr=2e-3, min_lr_ratio=0.1, warmup_steps=100, betas=(0.9, 0.98),
                          weight_decay=0.01, clip_norm=1.0),
        # fp32: a model this small gains nothing from bf16 units, and its measured numbers are fp32
        train=TrainConfig(steps=3000, checkpoint_every=500, keep_last=2, log_every=10, threads=2, dtype="float32"),
        eval_ds=EvalConfig(batch_size=128, steps=[81], step_type="commit", temperature=0.0, early_stopping=None,
                           num_examples=768),
    )
