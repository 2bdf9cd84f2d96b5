"""The AR baseline of configs/lite_debug.py: the same backbone (width 128, 4 layers, vocabulary 2,048),
data, windows, optimiser and steps, but a token-causal encoder trained on next-token prediction only
(``diffusion_loss_weight=0``: no corruption, no decoder pass). Self- and time-conditioning are off:
an AR model has no noisy tokens for them to condition. ``dgemma eval --task=lm --ar_workdir=...``
compares it with the diffusion model (validation NLL, wall-clock decoding speed).

    dgemma train --cfg=configs/lite_debug_ar.py --cfg.workdir=runs/lite_debug_ar
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import Config, DataConfig, DiffusionConfig, InitConfig, OptimConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
            sliding_window=None, layer_types=["full_attention"] * 4, max_position_embeddings=512,
            rope_local_theta=10_000.0, rope_global_theta=10_000.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            attn_implementation="sdpa", encoder_mode="causal", self_conditioning=False, time_conditioning=False,
        ),
        init=InitConfig(base=None, seed=0),
        diffusion=DiffusionConfig(process="uniform", schedule="cosine", t_eps=1e-3, canvas_size=32,
                                  num_canvases=8, selfcond_prob=0.0, ar_loss_weight=1.0, diffusion_loss_weight=0.0,
                                  decode="all", loss_chunk_tokens=1024),
        data=DataConfig(task="corpus", path="data/corpus_debug", tokenizer="data/corpus_debug/tokenizer",
                        prompt_len=0, batch_size=8, seed=0),
        optim=OptimConfig(name="adamw", lr=1e-3, min_lr_ratio=0.1, warmup_steps=50, betas=(0.9, 0.95),
                          weight_decay=0.1, clip_norm=1.0),
        # fp32: a model this small gains nothing from bf16 units, and its measured numbers are fp32
        train=TrainConfig(steps=500, checkpoint_every=100, keep_last=2, log_every=10, dtype="float32"),
    )
