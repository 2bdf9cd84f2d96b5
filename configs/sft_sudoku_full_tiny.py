"""``sft_sudoku_full.py`` in miniature, for CPU tests: every weight of a tiny Gemma-style model
trains (from a random init), with activation checkpointing and Adafactor.

    dgemma train --cfg=configs/sft_sudoku_full_tiny.py --cfg.workdir=/tmp/sft_sudoku_full_tiny
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, LoraConfig,
                                    OptimConfig, TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
            pad_token_id=0, eos_token_id=1, bos_token_id=2, attn_implementation="sdpa",
            self_conditioning=True, selfcond_variant="zero_init",
        ),
        init=InitConfig(base=None, seed=0),
        lora=LoraConfig(enabled=False),
        diffusion=DiffusionConfig(process="uniform", schedule="linear", t_eps=1e-4, canvas_size=96, num_canvases=1,
                                  selfcond_prob=0.5, ar_loss_weight=1.0, decode="one", loss_chunk_tokens=1024),
        data=DataConfig(task="sudoku", path=None, tokenizer="digits", prompt_len=82, batch_size=4, seed=0),
        optim=OptimConfig(name="adafactor", lr=1e-3, min_lr_ratio=0.1, warmup_steps=2, weight_decay=1e-4,
                          clip_norm=1.0),
        train=TrainConfig(steps=8, grad_accum=1, seed=0, dtype="float32", activation_checkpointing=True,
                          checkpoint_every=4, keep_last=None, log_every=1, threads=1),
        eval_ds=EvalConfig(batch_size=4, steps=[8], step_type="ddim", temperature=0.7, early_stopping="entropy",
                           num_examples=8),
    )
