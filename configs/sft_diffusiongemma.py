"""Fine-tune a released DiffusionGemma (e.g. google/diffusiongemma-26B-A4B-it) on your chat data.

The base is a transformers ``DiffusionGemmaForBlockDiffusion`` folder (download it first; dgemma
reads local folders). Its own design is kept: Gemma 4 layers with experts, the post-norm
self-conditioning block, the canvas-anchored sliding window, a causal encoder that shares every
weight with the bidirectional decoder. The recipe follows docs/design.md §2 and NeMo AutoModel's
DiffusionGemma SFT: uniform corruption with t ~ U(1e-3, 1 - 1e-3), cross-entropy over one random
canvas, encoder AR loss weight 1, two-pass self-conditioning with p = 0.5, LoRA r16 on attention
and the dense MLP (the router stays frozen; ``--cfg.lora.train_experts=true`` trains the experts in
full), only the final assistant turn supervised. Evaluation samples the way the released model
does: the entropy-bound step with stable-and-confident stopping.

    dgemma train --cfg=configs/sft_diffusiongemma.py --cfg.init.base=/models/diffusiongemma-26B-A4B-it \\
        --cfg.workdir=runs/sft_dg
    dgemma eval --task=chat --cfg.workdir=runs/sft_dg
    dgemma export --cfg.workdir=runs/sft_dg --out=exports/sft_dg   # a DiffusionGemma folder again
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, LoraConfig,
                                    OptimConfig, TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(attn_implementation="sdpa"),  # everything else comes from the checkpoint
        init=InitConfig(base="checkpoints/diffusiongemma-26B-A4B-it"),
        lora=LoraConfig(enabled=True, r=16, alpha=32.0, dropout=0.0, target_modules="all-linear"),
        diffusion=DiffusionConfig(process="uniform", schedule="linear", t_eps=1e-3, canvas_size=256, num_canvases=2,
                                  selfcond_prob=0.5, ar_loss_weight=1.0, decode="one", loss_chunk_tokens=2048),
        data=DataConfig(task="chat", path="examples/arithmetic/data/train.jsonl", prompt_len=1024, batch_size=4,
                        supervise="last", on_error="fail", seed=0),
        optim=OptimConfig(name="adamw", lr=1e-4, min_lr_ratio=0.1, warmup_steps=50, betas=(0.9, 0.999),
                          weight_decay=0.0, clip_norm=1.0),
        train=TrainConfig(steps=1000, checkpoint_every=250, keep_last=2, log_every=10, dtype="auto",
                          activation_checkpointing=True),
        eval_ds=EvalConfig(batch_size=8, steps=[48], step_type="entropy_bound", temperature=0.8,
                           early_stopping="stable_confident", num_examples=200,
                           path="examples/arithmetic/data/eval.jsonl",
                           regex=r"The answer is (?P<answer>-?\d+)", normalizer="default"),
    )
