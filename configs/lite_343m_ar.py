"""The AR baseline of configs/lite_343m.py: the same backbone (width 1,024, 24 layers, 16/4 heads of
64, GeGLU 3,072, vocabulary 50,257), data, 4,096-token windows, optimiser and token budget, but a
token-causal encoder trained on next-token prediction only (``diffusion_loss_weight=0``: no
corruption, no decoder pass). Self- and time-conditioning are off (an AR model has no noisy tokens),
so it has 340,972,544 parameters: Lite's 343,516,160 minus the time MLP (1,312,768) and the
self-conditioning block (1,230,848).

    torchrun --nproc_per_node=8 -m dgemma train --cfg=configs/lite_343m_ar.py --cfg.workdir=runs/lite_ar
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
            attn_implementation="flex", encoder_mode="causal", self_conditioning=False, time_conditioning=False,
        ),
        init=InitConfig(base=None, seed=0),
        diffusion=DiffusionConfig(process="uniform", schedule="cosine", t_eps=1e-3, canvas_size=256,
                                  num_canvases=16, selfcond_prob=0.0, ar_loss_weight=1.0, diffusion_loss_weight=0.0,
                                  decode="all", loss_chunk_tokens=4096),
        data=DataConfig(task="corpus", path="data/corpus", tokenizer="data/corpus/tokenizer", prompt_len=0,
                        batch_size=8, seed=0),
        optim=OptimConfig(name="adamw", lr=3e-4, min_lr_ratio=0.1, warmup_steps=2000, betas=(0.9, 0.95),
                          weight_decay=0.1, clip_norm=1.0),
        train=TrainConfig(steps=30_518, grad_accum=1, dtype="auto", activation_checkpointing=False,
                          checkpoint_every=1000, keep_last=3, log_every=10),
    )
