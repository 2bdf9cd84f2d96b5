"""``dgemma bench``: speed and memory of the library against in-process baselines.

One module per suite, each with ``run(ctx) -> dict`` (the JSON written to ``<out>/<suite>.json``):

- :mod:`dgemma.bench.decode`: block-diffusion sampling vs AR decoding (ours and transformers');
- :mod:`dgemma.bench.loss`: chunked x0 cross-entropy vs full logits;
- :mod:`dgemma.bench.attention`: eager vs sdpa vs flex attention;
- :mod:`dgemma.bench.train`: a LoRA training step in dgemma vs transformers + peft;
- :mod:`dgemma.bench.gpu`: the same suites at GPU sizes (bf16, FlexAttention, torch.compile).

:mod:`dgemma.bench.common` holds timing, memory, profiling, tables and JSON;
:mod:`dgemma.bench.fixtures` the shared models. See docs/benchmarks.md.
"""

SUITES = ("decode", "loss", "attention", "train", "gpu")
