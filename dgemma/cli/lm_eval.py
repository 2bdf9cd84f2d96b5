"""``dgemma lm-eval ARGS``: EleutherAI's lm-evaluation-harness command line (``lm-eval ARGS``) with
the ``dgemma`` model registered, e.g. ``dgemma lm-eval run --model dgemma --model_args
run=DIR --tasks TASK``.

lm-eval 0.4.13 finds a ``--model`` only among the models registered in its own process; this
verb imports ``dgemma/lm_eval_model.py`` (which registers ``dgemma``), then hands every argument
to ``lm_eval.__main__.cli_evaluate`` unchanged. See docs/guides/lm-eval.md.
"""

from __future__ import annotations

import sys

from dgemma.errors import DGemmaError


def run(argv: list[str]) -> int:
    try:
        import dgemma.lm_eval_model  # noqa: F401  (registers the model)
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        raise DGemmaError(f"dgemma lm-eval needs lm-eval ({e}): pip install 'dgemma[lm_eval]'") from None
    if argv in (["-h"], ["--help"]):  # the flags people look for are those of `run`
        print("dgemma lm-eval: lm-eval's command line with the dgemma model registered; its commands are run, "
              "ls and validate (`dgemma lm-eval COMMAND --help`). `run`:\n", flush=True)
        argv = ["run", "--help"]
    sys.argv = ["dgemma lm-eval", *argv]
    cli_evaluate()
    return 0
