"""Lite: a 343,516,160-parameter block-diffusion LM pretrained from scratch (docs/design.md §1).

Uniform-state noise with a cosine schedule, a block-causal encoder (causal across canvases of
256, bidirectional within one), time and self-conditioning, every canvas of a 4,096-token window
decoded at once against its clean prefix. Parameter count (tests/models/test_lite.py pins it):

    embedding (tied LM head)   50,257 x 1,024                      =  51,463,168
    24 layers x 12,062,848                                         = 289,508,352
        attention  q 1024x1024, k 1024x256, v 1024x256, o 1024x1024 = 2,621,440
        q/k norms  64 + 64                                          =       128
        4 RMSNorms 4 x 1,024                                        =     4,096
        GeGLU MLP  3 x 1,024 x 3,072                                = 9,437,184
    final norm                                                     =       1,024
    time MLP   (256 -> 1,024 -> 1,024, with biases)                =   1,312,768
    self-conditioning (2 RMSNorms + GeGLU 1,024 -> 400 -> 1,024)   =   1,230,848
                                                                   -----------
                                                                   343,516,160

    dgemma prepare corpus --input 'corpus/*.jsonl' --out data/corpus
    torchrun --nproc_per_node=8 -m dgemma train --cfg=configs/lite_343m.py --cfg.workdir=runs/lite
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import Config, DataConfig, DiffusionConfig, InitConfig, OptimConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=50_257, hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
            num_attention_heads=16, num_key_value_heads=4, head_dim=64, query_pre_attn_scalar=64,
            sliding_window=None, layer_types=["full_attention"] * 24, max_position_embeddings=4096,
            rope_local_theta=10_000.0, rope_global_theta=10_000.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            attn_implementation="flex", encoder_mode="block", self_conditioning=True, selfcond_variant="zero_init",
            selfcond_intermediate_size=400, time_conditioning=True, time_freq_dim=256,
        ),
        init=InitConfig(base=None, seed=0),
        diffusion=DiffusionConfig(process="uniform", schedule="cosine", t_eps=1e-3, canvas_size=256,
                                  num_canvases=16, selfcond_prob=0.5, ar_loss_weight=0.0, decode="all",
                                  loss_chunk_tokens=4096),
        data=DataConfig(task="corpus", path="data/corpus", tokenizer="data/corpus/tokenizer", prompt_len=0,
                        batch_size=8, seed=0),
        optim=OptimConfig(name="adamw", lr=3e-4, min_lr_ratio=0.1, warmup_steps=2000, betas=(0.9, 0.95),
                          weight_decay=0.1, clip_norm=1.0),
        # 8.0B tokens (Chinchilla-optimal for 343.5M) at 8 x 4,096 tokens per step and rank on 8 ranks
        train=TrainConfig(steps=30_518, grad_accum=1, dtype="auto", activation_checkpointing=False,
                          checkpoint_every=1000, keep_last=3, log_every=10),
    )
