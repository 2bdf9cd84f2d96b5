"""PubMedQA on a 2-core CPU without self-conditioning: ``configs/sft_pubmedqa_cpu.py`` with the
self-conditioning block removed, to learn whether the shipped adapter needs it.

Why: decoding the shipped adapter without its self-conditioning signal (``--no-self-condition``)
makes a batch-1 denoising pass ~70 ms instead of ~113 ms (no ``probs @ E`` over the 262,144 x 640
embedding, and the LM head only where the step reads) and cost 1 verdict in 500 at 16 steps
(``checkpoints/pubmedqa_270m/README.md``, "2026-12-05, night"). That adapter was trained to use
the signal on half its rows (``selfcond_prob=0.5``); a model trained without it at all may lose
nothing, and trains faster (no no-grad first decoder pass, which ran on almost every batch of 8).

The one deviation from ``configs/sft_pubmedqa_cpu.py``:

- ``model.self_conditioning=False`` and ``diffusion.selfcond_prob=0``: no self-conditioning block,
  no first pass. Everything else (data, its order, LoRA, optimiser, schedule, steps, seed,
  threads, eval settings) is the shipped recipe's, so the two runs differ in this alone (the
  noise draws differ after step 1: the shipped run drew its self-conditioning coins from the same
  generator).

Measured 2026-12-05 (``checkpoints/pubmedqa_270m/README.md``, "2026-12-05, late"): it trains in
35 minutes instead of 65, with the same loss curve. It ends at the same "yes" prior. At 8 steps
a canvas it keeps every verdict where the shipped adapter loses a fifth. But its explanations are
worse at every step count: BLEU 1.61 against 2.06-2.35 at 16 steps on 64 full answers, and
shorter. A trade, not shipped; the recipe stays so that the experiment can be rerun.

    dgemma train --cfg=configs/sft_pubmedqa_cpu_nosc.py --cfg.workdir=runs/pubmedqa_270m_nosc
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, LoraConfig,
                                    OptimConfig, TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(self_conditioning=False, attn_implementation="sdpa", shift_logits=True),
        init=InitConfig(base="gemma3-270m"),
        lora=LoraConfig(enabled=True, r=16, alpha=32.0, dropout=0.0, target_modules="all-linear"),
        diffusion=DiffusionConfig(process="absorbing", mask_token_id=4, schedule="linear", t_eps=1e-4,
                                  canvas_size=32, num_canvases=5, selfcond_prob=0.0, ar_loss_weight=0.0,
                                  decode="all", loss_on="noised", loss_chunk_tokens=1024),
        data=DataConfig(task="pubmedqa", path="data/pubmedqa_first", prompt_len=1024, trim_prompt_padding=True,
                        response_end="eos", batch_size=8, seed=0),
        optim=OptimConfig(name="adamw", lr=6e-4, min_lr_ratio=0.1, warmup_steps=20, betas=(0.95, 0.99),
                          weight_decay=1e-4, clip_norm=1.0),
        train=TrainConfig(steps=120, grad_accum=1, seed=0, dtype="auto", checkpoint_every=20, keep_last=None,
                          log_every=1, threads=2),
        eval_ds=EvalConfig(batch_size=16, steps=[8, 16, 32], step_type="commit", temperature=0.0,
                           early_stopping="entropy", entropy_threshold=0.05, commit_block=4, stop_alias_cos=0.95,
                           num_examples=500),
    )
