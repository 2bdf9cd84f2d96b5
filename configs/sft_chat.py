"""Fine-tune Gemma 3 270M on your own chat data with LoRA (the chat task).

Data: OpenAI-style chat JSONL (`{"messages": [{"role": ..., "content": ...}, ...]}`) or a
Hugging Face dataset name with `--cfg.data.split`. Gemma's chat template renders the history;
only the final assistant turn is supervised (`--cfg.data.supervise=all` for every assistant
turn); long prompts are cut from the left; bad rows are reported with file:line and refused
(`--cfg.data.on_error=skip` to skip and count them). The example data set is the project's own
arithmetic word problems (examples/arithmetic), scored by the number after "The answer is".

    dgemma prepare gemma3-270m
    dgemma train --cfg=configs/sft_chat.py --cfg.workdir=runs/sft_chat
    dgemma eval --task=chat --cfg.workdir=runs/sft_chat
"""

from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (Config, DataConfig, DiffusionConfig, EvalConfig, InitConfig, LoraConfig,
                                    OptimConfig, TrainConfig)


def get_config() -> Config:
    return Config(
        model=ModelConfig(self_conditioning=True, selfcond_variant="zero_init", attn_implementation="sdpa"),
        init=InitConfig(base="gemma3-270m"),
        lora=LoraConfig(enabled=True, r=8, alpha=16.0, dropout=0.0, target_modules="all-linear"),
        diffusion=DiffusionConfig(process="uniform", schedule="linear", t_eps=1e-4, canvas_size=64, num_canvases=2,
                                  selfcond_prob=0.5, ar_loss_weight=1.0, decode="one", loss_chunk_tokens=1024),
        data=DataConfig(task="chat", path="examples/arithmetic/data/train.jsonl", prompt_len=128, batch_size=8,
                        supervise="last", on_error="fail", seed=0),
        optim=OptimConfig(name="adamw", lr=1.5e-4, min_lr_ratio=0.1, warmup_steps=100, betas=(0.95, 0.99),
                          weight_decay=1e-4, clip_norm=1.0),
        train=TrainConfig(steps=2000, checkpoint_every=500, keep_last=3, log_every=10),
        eval_ds=EvalConfig(batch_size=16, steps=[32, 64], step_type="ddim", temperature=0.7,
                           early_stopping="entropy", num_examples=200,
                           path="examples/arithmetic/data/eval.jsonl",
                           regex=r"The answer is (?P<answer>-?\d+)", normalizer="default"),
    )
