"""Reverse a word: a tiny diffusion model trained from scratch on CPU, on the ``reverse`` task.

The prompt ``reverse: hello`` is prefilled by the causal encoder into the KV cache; the answer
``olleh`` (plus end-of-turn, then EOS padding) is denoised as one canvas of 8 tokens. Characters
are tokens (the ``lower`` alphabet: a-z and ``:``; spaces are skipped). Absorbing (masked) noise
with the loss on masked positions, as for the from-scratch Sudoku model: uniform noise needs far
more compute when nothing is pretrained. See docs/guides/new-task.md.

    dgemma prepare reverse --out data/reverse
    dgemma train --cfg=examples/reverse/config.py --cfg.workdir=runs/reverse
    dgemma eval --cfg.workdir=runs/reverse
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, OptimConfig,
                                    TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=32,  # 5 special tokens + 27 characters of the "lower" alphabet
            hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=None,
            layer_types=["full_attention"] * 4, max_position_embeddings=64, rope_local_theta=10_000.0,
            rope_global_theta=10_000.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            attn_implementation="sdpa",
        ),
        init=InitConfig(base=None, seed=0),
        diffusion=DiffusionConfig(process="absorbing", schedule="linear", t_eps=1e-3, canvas_size=8, num_canvases=1,
                                  selfcond_prob=0.0, ar_loss_weight=0.0, loss_on="noised"),
        data=DataConfig(task="reverse", path="data/reverse", tokenizer="lower", prompt_len=16,
                        batch_size=64, seed=0),
        optim=OptimConfig(name="adamw", lr=2e-3, min_lr_ratio=0.1, warmup_steps=50, betas=(0.9, 0.98),
                          weight_decay=0.01, clip_norm=1.0),
        train=TrainConfig(steps=300, checkpoint_every=100, keep_last=2, log_every=20, threads=1),
        eval_ds=EvalConfig(batch_size=100, steps=[8], step_type="commit", temperature=0.0, early_stopping=None,
                           num_examples=200),
    )
