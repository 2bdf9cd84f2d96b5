"""A stronger Sudoku solver: ``configs/sudoku_small.py`` made wider and fed unique puzzles.

Deviations from the quickstart recipe, each for a reason measured here (docs/design.md §11 and
checkpoints/sudoku_wide/README.md):

- width 128 (4 heads of 32, GeGLU 512): at width 64 the hard-board accuracy plateaus after
  about 20 CPU-minutes (53.9% after 5,000 steps), width 128 was still climbing;
- LR 1.5e-3 (2e-3 at width 64), the rate design.md §11 used for width 128;
- half of the training puzzles have exactly one solution (``data.sudoku_unique=0.5``, a pool of
  2,000 with 22-35 clues, each seen as a fresh transformed image): a random blanking below ~30
  clues has many solutions, so its loss is a guess the model cannot learn; the other half stay
  random blanks with 17-50 clues, as in the quickstart;
- long: 5,000 steps (about 2 hours on one thread here), a checkpoint every 500, all kept (the
  curve, and resuming).

    dgemma train --cfg=configs/sudoku_wide.py --cfg.workdir=runs/sudoku_wide
    dgemma eval --task=sudoku --cfg.workdir=runs/sudoku_wide
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
        init=InitConfig(base=None, seed=0),
        diffusion=DiffusionConfig(process="absorbing", schedule="linear", t_eps=1e-3, canvas_size=81,
                                  num_canvases=1, selfcond_prob=0.0, ar_loss_weight=0.0, loss_chunk_tokens=4096,
                                  loss_on="noised"),
        data=DataConfig(task="sudoku", path=None, tokenizer="digits", prompt_len=82, batch_size=64, seed=0,
                        pin_clues=True, sudoku_unique=0.5, sudoku_unique_pool=2000),
        optim=OptimConfig(name="adamw", lr=1.5e-3, min_lr_ratio=0.1, warmup_steps=100, betas=(0.9, 0.98),
                          weight_decay=0.01, clip_norm=1.0),
        train=TrainConfig(steps=5000, checkpoint_every=500, keep_last=None, log_every=10, threads=1,
                          dtype="float32"),
        eval_ds=EvalConfig(batch_size=128, steps=[81], step_type="commit", temperature=0.0, early_stopping=None,
                           num_examples=768),
    )
