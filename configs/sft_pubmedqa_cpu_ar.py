"""The AR baseline of ``configs/sft_pubmedqa_cpu.py``: the same Gemma 3 270M, LoRA (r16, all linear
layers), data (verdict first, answers ending in EOS, the same 5 x 32-token response layout, so the
loss covers the same tokens: the answer, its EOS and the EOS fill of its last canvas), batch,
steps, optimiser, schedule, seed and thread count (batch 8, LR 6e-4 -> 6e-5, warm-up 20, 120
steps, 2 threads), trained as a plain
autoregressive model: next-token loss on the response (and its end-of-turn) only, as SFT does,
no corruption and no decoder pass (``diffusion_loss_weight=0``), no self-conditioning module
(an AR model has no previous denoising step to condition on). Answers end in EOS for the same
reason as the diffusion recipe's: the tied head cannot rank Gemma 3 270M's ``<end_of_turn>``
above its ~6,200 near-duplicate rows.

It is decoded greedily, token by token, through dgemma's KV cache (the ``ar_greedy``
evaluator), and it is the model the diffusion fine-tune is judged against.

    dgemma train --cfg=configs/sft_pubmedqa_cpu_ar.py --cfg.workdir=runs/pubmedqa_270m_ar
    dgemma eval --cfg.workdir=runs/pubmedqa_270m_ar

The AR fine-tune shipped in ``checkpoints/pubmedqa_270m/ar/`` is this recipe's run.
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, LoraConfig,
                                    OptimConfig, TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(self_conditioning=False, attn_implementation="sdpa"),
        init=InitConfig(base="gemma3-270m"),
        lora=LoraConfig(enabled=True, r=16, alpha=32.0, dropout=0.0, target_modules="all-linear"),
        diffusion=DiffusionConfig(process="absorbing", mask_token_id=4, canvas_size=32, num_canvases=5,
                                  selfcond_prob=0.0, ar_loss_weight=1.0, ar_loss_on="response",
                                  diffusion_loss_weight=0.0, decode="one", loss_chunk_tokens=1024),
        data=DataConfig(task="pubmedqa", path="data/pubmedqa_first", prompt_len=1024, trim_prompt_padding=True,
                        response_end="eos", batch_size=8, seed=0),
        optim=OptimConfig(name="adamw", lr=6e-4, min_lr_ratio=0.1, warmup_steps=20, betas=(0.95, 0.99),
                          weight_decay=1e-4, clip_norm=1.0),
        train=TrainConfig(steps=120, grad_accum=1, seed=0, dtype="auto", checkpoint_every=40, keep_last=None,
                          log_every=1, eval_name="train_eval_ar_greedy", threads=2),
        eval_ds=EvalConfig(batch_size=16, steps=[8, 16, 32], step_type="commit", temperature=0.0,
                           early_stopping="entropy", stop_alias_cos=0.95, num_examples=500),
    )
