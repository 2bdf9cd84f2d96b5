"""``sft_sudoku.py`` in miniature, for CPU tests: LoRA r8 on a tiny random Gemma-style base.

Every mechanism of the recipe is kept (peft LoRA on all decoder linears, zero-init
self-conditioning, uniform noise with the linear schedule, the encoder AR loss, AdamW with
warmup and cosine, checkpoints); only the sizes shrink. The "pretrained" base is a random
2-layer model rebuilt from ``init.seed`` (a checkpoint stores only what trains), one sliding
and one global layer with a window shorter than the sequence. Digit tokens: the 81-cell
prompt is 82 tokens with BOS, the 81-digit answer plus end-of-turn fits one canvas of 96.

    dgemma train --cfg=configs/sft_sudoku_tiny.py --cfg.workdir=/tmp/sft_sudoku_tiny
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
        lora=LoraConfig(enabled=True, r=8, alpha=16.0, dropout=0.0, target_modules="all-linear"),
        diffusion=DiffusionConfig(process="uniform", schedule="linear", t_eps=1e-4, canvas_size=96, num_canvases=1,
                                  selfcond_prob=0.5, ar_loss_weight=1.0, decode="one", loss_chunk_tokens=1024),
        data=DataConfig(task="sudoku", path=None, tokenizer="digits", prompt_len=82, batch_size=4, seed=0),
        optim=OptimConfig(name="adamw", lr=1e-3, min_lr_ratio=0.1, warmup_steps=2, betas=(0.95, 0.99),
                          weight_decay=1e-4, clip_norm=1.0),
        train=TrainConfig(steps=8, grad_accum=1, seed=0, dtype="float32", checkpoint_every=4, keep_last=None,
                          log_every=1, threads=1),
        eval_ds=EvalConfig(batch_size=4, steps=[8], step_type="ddim", temperature=0.7, early_stopping="entropy",
                           num_examples=8),
    )
