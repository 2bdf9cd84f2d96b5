"""SFT recipe (docs/design.md §6): adapt Gemma 3 270M to PubMedQA with LoRA r4.

A 1,024-token prompt (contexts and question, left-truncated) and two 128-token canvases for
the long answer and its "The answer is: yes|no|maybe" tail; LR 1e-4 decaying to 1e-5.

    dgemma prepare gemma3-270m
    dgemma prepare pubmedqa --source ../shared/data/pubmedqa --out data/pubmedqa
    dgemma train --cfg=configs/sft_pubmedqa.py --cfg.workdir=runs/sft_pubmedqa
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, LoraConfig,
                                    OptimConfig, TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(self_conditioning=True, selfcond_variant="zero_init", attn_implementation="sdpa"),
        init=InitConfig(base="gemma3-270m"),
        lora=LoraConfig(enabled=True, r=4, alpha=8.0, dropout=0.0, target_modules="all-linear"),
        diffusion=DiffusionConfig(process="uniform", schedule="linear", t_eps=1e-4, canvas_size=128, num_canvases=2,
                                  selfcond_prob=0.5, ar_loss_weight=1.0, decode="one", loss_chunk_tokens=1024),
        data=DataConfig(task="pubmedqa", path="data/pubmedqa", prompt_len=1024, batch_size=2, seed=0),
        optim=OptimConfig(name="adamw", lr=1e-4, min_lr_ratio=0.1, warmup_steps=100, betas=(0.95, 0.99),
                          weight_decay=1e-4, clip_norm=1.0),
        train=TrainConfig(steps=2000, grad_accum=1, seed=0, dtype="auto", checkpoint_every=1000, keep_last=3,
                          log_every=10),
        eval_ds=EvalConfig(batch_size=8, steps=[32, 64, 96], step_type="ddim", temperature=0.7,
                           early_stopping="entropy", entropy_threshold=0.05, num_examples=500),
    )
