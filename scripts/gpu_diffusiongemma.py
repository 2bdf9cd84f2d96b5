#!/usr/bin/env python3
"""DiffusionGemma decoding, dgemma vs transformers, side by side: ``python scripts/gpu_diffusiongemma.py``.

Builds a DiffusionGemma of about 1B parameters with random weights in transformers
(``DiffusionGemmaForBlockDiffusion``: 12 Gemma 4 layers of width 1024 with 32 experts, top 4, beside
the dense MLP, vocabulary 262,144, canvas 256), converts the same tensors into dgemma's model in
memory, and times block-diffusion decoding of both with the same sampler settings: the
entropy-bound step (bound 0.1), the linear temperature schedule 0.8 -> 0.4, at most 48 denoising
steps, stable-and-confident stopping, 2 canvases after a 256-token prompt, bf16, batch 1 and 8.
Random weights never stop early, so both run every step: the comparison is work for work. Token
agreement is 1.0 at batch 1; in a batch it holds until some row ends its sequence, after which
dgemma drops that row (it stops costing compute) while transformers keeps sampling it, so the two
random streams part.
It prints a table (tokens/s, tokens per decoder forward, dgemma / transformers ratio, token
agreement of the two outputs) and writes ``OUT/diffusiongemma.json``.

It installs nothing and downloads nothing. ``--smoke`` runs the same code on a CPU with a tiny
config in seconds (the test suite does); without ``--smoke`` it needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

FULL = dict(vocab_size=262_144, hidden_size=1024, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=8, num_key_value_heads=2, head_dim=128, global_head_dim=256,
            num_global_key_value_heads=1, sliding_window=512, num_experts=32, top_k_experts=4,
            moe_intermediate_size=512, max_position_embeddings=4096)
SMOKE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=8,
             num_experts=4, top_k_experts=2, moe_intermediate_size=16, max_position_embeddings=256,
             layer_types=["sliding_attention", "full_attention"])


def build(text: dict, canvas: int, device, dtype):
    """The transformers reference and dgemma's model holding the same tensors."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from dgemma.models.hf_gemma4 import config_from_gemma4, diffusiongemma_to_dgemma
    from dgemma.models.weights import model_from_state_dict

    torch.manual_seed(0)
    cfg = DiffusionGemmaConfig(text_config=dict(text), canvas_length=canvas)
    hf = DiffusionGemmaForBlockDiffusion(cfg).to(device=device, dtype=dtype).eval()
    tensors, _ = diffusiongemma_to_dgemma(hf.state_dict(), source="random DiffusionGemma")
    ours_cfg = config_from_gemma4(cfg.text_config.to_dict(), diffusion=True)
    ours = model_from_state_dict(ours_cfg, tensors, dtype=dtype).to(device).eval()
    return hf, ours


def timed(fn, device, repeats: int):
    import torch

    fn()  # warm-up
    best = float("inf")
    out = None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny config on the CPU, for tests")
    p.add_argument("--out", default="results/gpu", help="folder for diffusiongemma.json")
    p.add_argument("--batches", default="1,8", help="batch sizes (default 1,8)")
    p.add_argument("--steps", type=int, default=48, help="max denoising steps (default 48)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per cell, best kept (default 2)")
    args = p.parse_args(argv)

    import torch

    sys.path.insert(0, str(REPO))
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    from dgemma.sampling import diffusiongemma_sampler

    if args.smoke:
        device, dtype, text, canvas, prompt_len, steps = torch.device("cpu"), torch.float32, SMOKE, 8, 12, 3
    else:
        if not torch.cuda.is_available():
            print("gpu_diffusiongemma: no CUDA device here; use --smoke on a CPU", file=sys.stderr)
            return 1
        device, dtype, text, canvas, prompt_len, steps = torch.device("cuda"), torch.bfloat16, FULL, 256, 256, args.steps
    hf, ours = build(text, canvas, device, dtype)
    n_params = ours.num_parameters()
    vocab, canvases = text["vocab_size"], 2
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompt = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch)).to(device)
        gen_kw = dict(max_new_tokens=canvases * canvas, max_denoising_steps=steps,
                      sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1), t_min=0.4, t_max=0.8,
                      stability_threshold=1, confidence_threshold=0.005, eos_token_id=1, pad_token_id=0)

        def run_hf():
            torch.manual_seed(0)
            with torch.no_grad():
                return hf.generate(prompt, **gen_kw)

        sampler = diffusiongemma_sampler(vocab, canvas, max_new_tokens=canvases * canvas, max_denoising_steps=steps,
                                         eos_token_id=1)

        def run_ours():
            return sampler(ours, prompt, torch.ones_like(prompt, dtype=torch.bool),
                           generator=torch.Generator(device=device).manual_seed(0))

        t_hf, ref = timed(run_hf, device, args.repeats)
        t_ours, got = timed(run_ours, device, args.repeats)
        ref_tokens = ref.sequences[:, prompt_len:].tolist()
        tok_hf = sum(sum(t != 0 for t in r) for r in ref_tokens)
        tok_ours = sum(len(t) for t in got.tokens)
        agree = [sum(a == b for a, b in zip(r, o)) / max(len(o), 1) for r, o in zip(ref_tokens, got.tokens)]
        rows.append({"batch": batch, "tokens_per_s_transformers": tok_hf / t_hf, "tokens_per_s_dgemma": tok_ours / t_ours,
                     "speedup": (tok_ours / t_ours) / (tok_hf / t_hf),
                     "tokens_per_forward_transformers": float(ref.tokens_per_forward.float().mean()),
                     "tokens_per_forward_dgemma": sum(got.tokens_per_decoder_forward(0)) / batch,
                     "token_agreement": sum(agree) / len(agree), "seconds_transformers": t_hf, "seconds_dgemma": t_ours})
    head = (f"DiffusionGemma decode, {n_params / 1e9:.2f}B params, {dtype}, {device}, "
            f"{canvases} canvases of {canvas} after {prompt_len} prompt tokens, <= {steps} steps")
    print(head)
    print(f"{'batch':>5} {'hf tok/s':>10} {'dgemma tok/s':>13} {'ratio':>6} {'tpf hf':>7} {'tpf ours':>8} {'agree':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['tokens_per_s_transformers']:>10.1f} {r['tokens_per_s_dgemma']:>13.1f} "
              f"{r['speedup']:>6.2f} {r['tokens_per_forward_transformers']:>7.3f} {r['tokens_per_forward_dgemma']:>8.3f} "
              f"{r['token_agreement']:>6.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"title": head, "params": n_params, "smoke": args.smoke, "rows": rows,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    (out / "diffusiongemma.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
