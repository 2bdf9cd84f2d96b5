"""SFT recipe (docs/design.md §6): Gemma 3 270M -> Sudoku diffusion solver, all weights trained.

As ``sft_sudoku.py`` but without LoRA: full weights with activation checkpointing, Adafactor
(factored second moments: optimiser state is a small fraction of the weights) and a 1,000-step
warmup.

    dgemma prepare gemma3-270m
    dgemma prepare sudoku --out data/sudoku --n 20000
    dgemma train --cfg=configs/sft_sudoku_full.py --cfg.workdir=runs/sft_sudoku_full
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, LoraConfig,
                                    OptimConfig, TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(self_conditioning=True, selfcond_variant="zero_init", attn_implementation="sdpa"),
        init=InitConfig(base="gemma3-270m"),
        lora=LoraConfig(enabled=False),
        diffusion=DiffusionConfig(process="uniform", schedule="linear", t_eps=1e-4, canvas_size=256, num_canvases=1,
                                  selfcond_prob=0.5, ar_loss_weight=1.0, decode="one", loss_chunk_tokens=1024),
        data=DataConfig(task="sudoku", path="data/sudoku", prompt_len=256, batch_size=8, seed=0),
        optim=OptimConfig(name="adafactor", lr=1.5e-4, min_lr_ratio=0.1, warmup_steps=1000, weight_decay=1e-4,
                          clip_norm=1.0),
        train=TrainConfig(steps=2000, grad_accum=1, seed=0, dtype="auto", activation_checkpointing=True,
                          checkpoint_every=1000, keep_last=3, log_every=10),
        eval_ds=EvalConfig(batch_size=8, steps=[32, 64, 96], step_type="ddim", temperature=0.7,
                           early_stopping="entropy", entropy_threshold=0.05, num_examples=256),
    )
