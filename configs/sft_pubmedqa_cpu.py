"""PubMedQA on a 2-core CPU: the sft_pubmedqa recipe (LoRA r4 on Gemma 3 270M, LR 1e-4 -> 1e-5,
batch 2) changed until it trains a working adapter in about 70 minutes, alone, on this project's
2-core CPU.

Deviations from ``configs/sft_pubmedqa.py``, each with its reason (figures measured on the
2-core AMD EPYC with AVX512-BF16, torch 2.13.0; see ``docs/guides/adapt-gemma-pubmedqa.md``):

- ``data.path="data/pubmedqa_first"``, prepared with ``dgemma prepare pubmedqa --verdict first``:
  the target is "The answer is: X. " then the long answer, so the one token the metric reads is
  in the first canvas, written from the question and context alone. With the verdict last
  (``data/pubmedqa``) the previous adapter's verdict followed 30-60 tokens of its own parallel
  text, trained on reference explanations that give the verdict away, and did not read the
  question: all "yes" at step 120, all "no" at step 160 (checkpoints/pubmedqa_270m/README.md).
- ``data.response_end="eos"``: answers end with EOS, not ``<end_of_turn>``, whose embedding row
  in Gemma 3 270M is within cosine 0.95 of ~6,200 untrained rows, so with the tied head the
  previous adapter could not rank it first and wrote "The answer is: yes" then a junk twin
  ("capturePlayer"). EOS's nearest other row is at cosine 0.61.

- ``model.shift_logits=True``: canvas token ``j`` is predicted from the state at ``j - 1`` (the
  first one from the clean state of the token before the canvas), so the adapter keeps Gemma's
  next-token head instead of learning to predict each token at its own position
  (``dgemma/diffusion/shift.py``). Masked-token CE at step 0: 8.5 nats shifted, 9.3 not (3 batches).
- ``diffusion.canvas_size=32, num_canvases=5`` (2 x 128 in the seed recipe; 160 tokens hold
  every training answer, the longest being 149 with its end-of-turn). Answers are 51 tokens at
  the median, so a 128-token canvas is 57% EOS fill: after 100-200 steps at 2 x 128 the model
  gave P(stop) = 0.34-0.79 at a fully masked canvas's *first* position (4 train-eval prompts),
  argmax EOS everywhere, and the commit sampler emitted empty answers for all 50 train-eval
  questions. At 32 the fill is 23% of a decoded canvas and a first canvas is never fill.
- ``diffusion.process="absorbing"`` (``<mask>``, id 4) with the loss on masked positions
  (``loss_on="noised"``) and the ``commit`` step (greedy, most confident first): the denoiser
  sees which positions are unknown, as in LLaDA, Dream and Fast-dLLM, whereas over a
  262,144-token vocabulary a uniformly noised canvas is mostly random words the model must first
  learn to spot. 200-step probes of both at 2 x 128 canvases scored 0 of 50 alike (the guide).
- ``diffusion.decode="all"`` and ``data.batch_size=8`` (one canvas of 2 examples in the seed
  recipe): every canvas of an answer is decoded in the one decoder pass, each against its own
  clean prefix. Without the encoder AR loss a step of the seed shape scores ~32 masked tokens, and
  at that noise the loss hovered at 4.5-6.3 nats from step 150 to 600 while every step's gradient
  norm (20-35) was clipped to 1; 8 x all canvases score ~250-350.
- ``lora.r=16, alpha=32`` (r4, alpha 8 in the seed recipe) and ``optim.lr=6e-4``, warm-up 20,
  ``train.steps=120``, a checkpoint every 40: at r4 and 2e-4 the masked CE sat at 4.4-5.0 from
  step 40 to 100 and the sampler answered "The answer is:" and stopped; with the same data and
  noise draws, r16 at 6e-4 was 0.5-0.6 nats lower at every step from 1 to 60 (curve in the
  model card). 120 steps are 960 answers, 2.1 epochs of the 450 training ones, about 70 minutes
  alone on two threads, so that this run and its AR baseline fit one 3-hour working session
  (the previous 240-step schedule took 99 minutes for 160 steps and was stopped there).
- ``diffusion.ar_loss_weight=0``: no encoder next-token loss. Its cost is the LM head over every
  scored position: 12.7 s/step with the AR loss over prompt and response, 6.3 s over the
  response alone, 3.9 s without it (2 threads, bf16, seed shape). The diffusion loss still trains
  the encoder, through the keys and values it writes into the cache and, with the shift, the
  state before each canvas.
- ``data.trim_prompt_padding=True``: prompts are 380 tokens at the median (of 1,024 allowed), so
  each step runs on its longest prompt instead of 1,024 padded positions (same math).
- ``train.threads=2``: the run has the machine to itself (its AR baseline runs after it). Bits
  depend on the thread count: resume with the same count.
- bf16 autocast (``train.dtype="auto"``) on CPUs with native bf16 matrix units, fp32 elsewhere.
- ``eval_ds.commit_block=4``: commits go left to right in blocks of 4 inside a canvas (LLaDA's
  semi-autoregressive decoding). Without it the commit step committed the canvas's most
  confident positions anywhere: on 16 train-eval questions at step 80 and 32 steps it wrote
  "The answer is:" and stopped (mean 5 tokens); with blocks of 4 it wrote an explanation ending
  in "The answer is: no" (mean 41 tokens).
- ``eval_ds.stop_alias_cos=0.95``: the stop tokens absorb the tokens whose embedding row is
  within cosine 0.95 of theirs (``dgemma/diffusion/sampler.py:stop_aliases``). Gemma 3 270M's
  ``<end_of_turn>`` row has cosine >= 0.95 with ~6,200 untrained rows (unused and rare-script
  tokens, none in a PubMedQA answer; EOS has no such twins): with the tied head a fine-tune that
  means "end of turn" cannot rank it above them and writes "The answer is: yes" then one of them
  ("capturePlayer", "𒄊"), which the decision regex rightly refuses. At step 80 the adapter gave
  ``<end_of_turn>`` 0.1% at the end of its own training answers. Both models (AR too) are
  decoded with it; with answers ending in EOS (above) it changes nothing unless a model writes
  one of those untrained rows, which then ends the answer instead of trailing it.
- ``eval_ds.interactive_steps=16, interactive_early_stopping="none"`` (added 2026-12-05, decoding
  only): ``dgemma generate``, the playground and the OpenAI API decode with 16 steps a canvas and
  no early stop unless asked otherwise. Before, they took ``steps[0]`` = 8 and the entropy rule,
  where a fifth of the test verdicts no longer parse; 16 steps is the fastest setting that keeps
  the 32-step verdicts (checkpoints/pubmedqa_270m/README.md).
- ``eval_ds.interactive_self_condition=False, interactive_reuse_canvas_keys=True,
  interactive_no_repeat=True`` (added 2026-12-07, decoding only; ``dgemma eval`` keeps the
  evaluated settings): the same front ends decode without the self-conditioning signal, with
  partial passes and no parallel repeats. On all 500 test questions at 16 steps that kept every
  verdict, raised BLEU 1.16x (2.40 -> 2.79) and cut the answers with a doubled word from 470 to
  41, at 2.2-2.5x the tokens/s at batch 1 (checkpoints/pubmedqa_270m/README.md, "2026-12-07").
- Every checkpoint is kept (``keep_last=None``, every 40 steps): the held-out curve is measured
  on them afterwards (``dgemma eval --step=S --eval_names=train_eval_sample_ar_steps16``)
  instead of pausing training for it.

    dgemma prepare gemma3-270m
    dgemma prepare pubmedqa --source ../shared/data/pubmedqa --out data/pubmedqa_first --verdict first
    dgemma train --cfg=configs/sft_pubmedqa_cpu.py --cfg.workdir=runs/pubmedqa_270m
    dgemma eval --cfg.workdir=runs/pubmedqa_270m
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, LoraConfig,
                                    OptimConfig, TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(self_conditioning=True, selfcond_variant="zero_init", attn_implementation="sdpa",
                          shift_logits=True),
        init=InitConfig(base="gemma3-270m"),
        lora=LoraConfig(enabled=True, r=16, alpha=32.0, dropout=0.0, target_modules="all-linear"),
        diffusion=DiffusionConfig(process="absorbing", mask_token_id=4, schedule="linear", t_eps=1e-4,
                                  canvas_size=32, num_canvases=5, selfcond_prob=0.5, ar_loss_weight=0.0,
                                  decode="all", loss_on="noised", loss_chunk_tokens=1024),
        data=DataConfig(task="pubmedqa", path="data/pubmedqa_first", prompt_len=1024, trim_prompt_padding=True,
                        response_end="eos", batch_size=8, seed=0),
        optim=OptimConfig(name="adamw", lr=6e-4, min_lr_ratio=0.1, warmup_steps=20, betas=(0.95, 0.99),
                          weight_decay=1e-4, clip_norm=1.0),
        train=TrainConfig(steps=120, grad_accum=1, seed=0, dtype="auto", checkpoint_every=40, keep_last=None,
                          log_every=1, threads=2),
        eval_ds=EvalConfig(batch_size=16, steps=[8, 16, 32], step_type="commit", temperature=0.0,
                           early_stopping="entropy", entropy_threshold=0.05, commit_block=4, stop_alias_cos=0.95,
                           interactive_steps=16, interactive_early_stopping="none", interactive_self_condition=False,
                           interactive_reuse_canvas_keys=True, interactive_no_repeat=True, num_examples=500),
    )
