"""SFT recipe (docs/design.md §6): adapt Gemma 3 270M into a Sudoku diffusion solver with LoRA r8.

Uniform-state noise, linear schedule, one 256-token canvas after a 256-token prompt, the
encoder AR loss (weight 1) beside the diffusion loss, and zero-init self-conditioning (step 0
is exactly the pretrained model). The LoRA matrices and the self-conditioning block train; the
base stays frozen.

    dgemma prepare gemma3-270m
    dgemma prepare sudoku --out data/sudoku --n 20000
    dgemma train --cfg=configs/sft_sudoku.py --cfg.workdir=runs/sft_sudoku
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, LoraConfig,
                                    OptimConfig, TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(self_conditioning=True, selfcond_variant="zero_init", attn_implementation="sdpa"),
        init=InitConfig(base="gemma3-270m"),
        lora=LoraConfig(enabled=True, r=8, alpha=16.0, dropout=0.0, target_modules="all-linear"),
        diffusion=DiffusionConfig(process="uniform", schedule="linear", t_eps=1e-4, canvas_size=256, num_canvases=1,
                                  selfcond_prob=0.5, ar_loss_weight=1.0, decode="one", loss_chunk_tokens=1024),
        data=DataConfig(task="sudoku", path="data/sudoku", prompt_len=256, batch_size=8, seed=0),
        optim=OptimConfig(name="adamw", lr=1.5e-4, min_lr_ratio=0.1, warmup_steps=100, betas=(0.95, 0.99),
                          weight_decay=1e-4, clip_norm=1.0),
        train=TrainConfig(steps=2000, grad_accum=1, seed=0, dtype="auto", checkpoint_every=1000, keep_last=3,
                          log_every=10),
        eval_ds=EvalConfig(batch_size=8, steps=[32, 64, 96], step_type="ddim", temperature=0.7,
                           early_stopping="entropy", entropy_threshold=0.05, num_examples=256),
    )
