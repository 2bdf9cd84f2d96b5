"""PubMedQA, second stage: the shipped adapter trained further on the canvases its sampler
actually sees (an experiment for issue #17's tokens a pass; see checkpoints/pubmedqa_270m/README.md).

The shipped adapter decodes a 32-token canvas left to right in blocks of 4 (``eval_ds.commit_block=4``):
every pass sees a clean prefix, a partly masked block and nothing but masks after it. It was
trained with i.i.d. masking, which almost never draws that state (at 16 steps a canvas it is sure
of 1.7 tokens a pass; at 8 steps, one whole block a pass, a fifth of its verdicts stop parsing).
``diffusion.block_noise_prob`` draws that state in a share of the rows
(``dgemma/diffusion/corruption.py:block_states``).

Result (2026-12-06, the AMX Xeon, 39 minutes): measured, not shipped. Tokens a pass did not move
(1.70 / 3.28 / 5.44 at 16 / 8 / 4 steps on 32 test questions, against 1.71 / 3.30 / 5.66), and the
8- and 4-step verdicts did not parse more often. The verdict left the "yes" prior (261 yes / 231 no
on the 500 test questions at 16 steps): 51.8%, under the 55.2% majority. The i.i.d. control
(``--cfg.diffusion.block_noise_prob=0``) decoded the 500 verdicts at 8 steps with 1 unparsed (54.0%),
against 68 with block noise and 102 before the stage. Tables:
checkpoints/pubmedqa_270m/sweep_2026-12-05.md, "After midnight".

Deviations from ``configs/sft_pubmedqa_cpu.py``, each with its reason:

- ``diffusion.block_noise_prob=0.75, block_noise_size=4``: three rows in four as the block sampler
  leaves a canvas (one block picked uniformly among those holding answer tokens, the blocks before it
  clean, its positions masked at the row's ``t``, every later block masked); the rest i.i.d., as
  before, so the adapter keeps what it knows.
- ``init.weights="checkpoints/pubmedqa_270m"``: starts from the shipped adapter (LoRA and
  self-conditioning weights); optimiser and schedule start afresh.
- ``optim.lr=2e-4`` (warm-up 5, cosine to 2e-5), ``train.steps=100`` (800 answers, 1.8 epochs of
  the 450), ``data.seed=1`` (a new order): a second stage from trained weights, at a third of the
  first stage's peak rate, as the distillation run (``configs/sft_pubmedqa_cpu_distill.py``).
  A checkpoint every 20 steps.

    dgemma train --cfg=configs/sft_pubmedqa_cpu_blocks.py --cfg.workdir=runs/pubmedqa_270m_blocks
    python scripts/pubmedqa_sweep.py --workdir runs/pubmedqa_270m_blocks
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, LoraConfig,
                                    OptimConfig, TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(self_conditioning=True, selfcond_variant="zero_init", attn_implementation="sdpa",
                          shift_logits=True),
        init=InitConfig(base="gemma3-270m", weights="checkpoints/pubmedqa_270m"),
        lora=LoraConfig(enabled=True, r=16, alpha=32.0, dropout=0.0, target_modules="all-linear"),
        diffusion=DiffusionConfig(process="absorbing", mask_token_id=4, schedule="linear", t_eps=1e-4,
                                  canvas_size=32, num_canvases=5, selfcond_prob=0.5, ar_loss_weight=0.0,
                                  decode="all", loss_on="noised", loss_chunk_tokens=1024,
                                  block_noise_prob=0.75, block_noise_size=4),
        data=DataConfig(task="pubmedqa", path="data/pubmedqa_first", prompt_len=1024, trim_prompt_padding=True,
                        response_end="eos", batch_size=8, seed=1),
        optim=OptimConfig(name="adamw", lr=2e-4, min_lr_ratio=0.1, warmup_steps=5, betas=(0.95, 0.99),
                          weight_decay=1e-4, clip_norm=1.0),
        train=TrainConfig(steps=100, grad_accum=1, seed=0, dtype="auto", checkpoint_every=20, keep_last=None,
                          log_every=1, threads=2),
        eval_ds=EvalConfig(batch_size=16, steps=[8, 16, 32], step_type="commit", temperature=0.0,
                           early_stopping=None, commit_block=4, stop_alias_cos=0.95,
                           interactive_steps=16, interactive_early_stopping="none", num_examples=500),
    )
