"""``dgemma eval --cfg.workdir=DIR [--task=sudoku|pubmedqa] [--step=N] [--eval_names=a,b] [--visualize=K]
[--cfg.eval_ds.batch_size=..] [--cfg.aux.eval_num_batches=..] [--cfg.aux.num_canvases=..] ...``

``dgemma eval --task=lm --cfg.workdir=DIR [--ar_workdir=AR_DIR] [--windows=64] [--elbo_points=16]
[--gen_steps=8,16,32,64] [--gen_canvases=4] [--gen_batch=4] [--repeats=2]`` evaluates a pretrained
Lite run instead (the default for a run with ``data.task="corpus"``): held-out loss, the NELBO
bound on perplexity, and generation speed against an AR baseline (:mod:`dgemma.eval.lite`).

The run's own ``DIR/config.json`` is the source of truth; ``--cfg.*`` overrides apply on top of
it (evaluation settings; an architecture change is refused). ``--cfg=FILE`` is accepted so a
training command line can be reused, but the file itself is not read: a config file edited
since training would otherwise silently disagree with the checkpoint.

``--task`` defaults to the run's ``data.task``. ``--eval_names`` picks evaluators by name
(default: ``sample_ar_steps{N}`` and ``..._early_stopping`` for N in ``eval_ds.steps``); see
:mod:`dgemma.eval.harness` for names on other splits and for the files written.
"""

from __future__ import annotations

import argparse
import sys

from dgemma.errors import DGemmaError


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    overrides = [a for a in argv if a.startswith("--cfg.")]
    rest = [a for a in argv if not a.startswith("--cfg.")]
    p = argparse.ArgumentParser(prog="dgemma eval", description="evaluate a training run's checkpoint",
                                epilog="--cfg.workdir=DIR is required; --cfg.SECTION.KEY=VALUE overrides the run's "
                                       "config.json, e.g. --cfg.eval_ds.batch_size=16 --cfg.aux.eval_num_batches=2")
    p.add_argument("--cfg", help="accepted and ignored: the workdir's config.json is used")
    p.add_argument("--task", help="sudoku, pubmedqa, chat, completion or lm (default: the run's data.task; "
                                  "lm for a corpus run)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
    p.add_argument("--eval_names", help="comma-separated evaluator names, e.g. sample_ar_steps32,"
                                        "sample_ar_steps32_early_stopping")
    p.add_argument("--visualize", type=int, default=0, metavar="K",
                   help="write a GIF and a PNG strip of the denoising of the first K examples")
    p.add_argument("--out", metavar="DIR", help="write DIR/eval/... instead of WORKDIR/eval/... (e.g. a batch-1 "
                                                "speed run beside the batch-16 one)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="inference dtype (auto: bf16 where the CPU or GPU has native bf16 matrix units)")
    p.add_argument("--compile", action="store_true",
                   help="decode through torch.compile (dgemma/models/compiled.py): about a minute of compiling per "
                        "kind of call on a CPU, paid in the untimed warm-up; pays only over long evaluations")
    p.add_argument("--ar_max_tokens", type=int, default=None,
                   help="tokens of the AR baseline per prompt (default 64; 0 skips it)")
    lm = p.add_argument_group("--task=lm (a pretrained Lite run)")
    lm.add_argument("--ar_workdir", help="the AR baseline run (e.g. configs/lite_debug_ar.py) to compare with")
    lm.add_argument("--windows", type=int, default=64, help="held-out windows of the val split (default 64)")
    lm.add_argument("--elbo_points", type=int, default=16, help="time cells of the NELBO quadrature (default 16)")
    lm.add_argument("--gen_steps", default="8,16,32,64", help="fixed step counts of the commit sampler")
    lm.add_argument("--gen_canvases", type=int, default=4, help="canvases generated per row (default 4)")
    lm.add_argument("--gen_batch", type=int, default=4, help="rows generated at once (default 4)")
    lm.add_argument("--repeats", type=int, default=2, help="timed repeats; the fastest counts (default 2)")
    args = p.parse_args(rest)
    workdir = [a.partition("=")[2] for a in overrides if a.startswith("--cfg.workdir=")]
    if not workdir or not workdir[-1]:
        raise DGemmaError("missing --cfg.workdir=DIR (a training workdir with config.json and checkpoints)")
    args.workdir = workdir[-1]
    if args.visualize < 0:
        raise DGemmaError(f"--visualize must be >= 0, got {args.visualize}")
    return args, overrides


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _rows(r: dict) -> list[tuple[str, int, dict, dict]]:
    """``(label, n, metrics, stats)`` of one result: a verified evaluator gives two rows,
    model-only and verified, never one mixed number."""
    n = r["num_examples"]
    if "verified" not in r:
        return [(r["eval_name"], n, r["metrics"], r["stats"])]
    return [(f"{r['eval_name']} {part.replace('_', '-')}", n, r[part],
             {"mean_steps_per_canvas": r[part]["mean_passes"], "boards_per_second": r[part]["boards_per_second"]})
            for part in ("model_only", "verified")]


def table(results: list[dict], primary: tuple[str, ...]) -> str:
    """One line per evaluator: the task's main metrics and the speed figures (verified solving:
    one line model-only, one verified; ``steps/canvas`` is then forward passes per board)."""
    rows_ = [row for r in results for row in _rows(r)]
    primary = tuple(m for m in primary if any(m in met for _, _, met, _ in rows_))
    cols = ["eval_name", "n", *primary, "steps/canvas", "tok/fwd", "tok/s", "ar tok/s", "x ar"]
    rows = [[label, n, *(met.get(m) for m in primary), st["mean_steps_per_canvas"], st.get("tokens_per_forward"),
             st.get("tokens_per_second"), st.get("ar_tokens_per_second"), st.get("speedup_vs_ar")]
            for label, n, met, st in rows_]
    cells = [cols] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def run(argv: list[str]) -> int:
    from dgemma.eval.harness import AR_MAX_TOKENS, default_evaluators, parse_evaluator, run_evaluators
    from dgemma.tasks import get_task
    from dgemma.training.runs import load_run

    args, overrides = parse(argv)
    if args.cfg:
        print(f"[dgemma] eval: using {args.workdir}/config.json; --cfg={args.cfg} is not read "
              f"(only --cfg.* overrides apply)", file=sys.stderr)
    run_ = load_run(args.workdir, step=args.step, overrides=overrides, dtype=args.dtype)
    if args.compile:
        from dgemma.models.compiled import CompiledModel

        run_.model = CompiledModel(run_.model)
    if args.task == "lm" or (args.task is None and run_.cfg.data.task == "corpus"):
        return _run_lm(args, run_)
    task = get_task(args.task or run_.cfg.data.task).configure(run_.cfg)
    if args.eval_names:
        evaluators = [parse_evaluator(n.strip(), task) for n in args.eval_names.split(",") if n.strip()]
    else:
        evaluators = default_evaluators(run_.cfg, task)
    if not evaluators:
        raise DGemmaError("no evaluators to run")
    ar = AR_MAX_TOKENS if args.ar_max_tokens is None else args.ar_max_tokens
    print(f"[dgemma] eval: {task.name} at step {run_.step} from {run_.path}, "
          f"{len(evaluators)} evaluator(s)", file=sys.stderr)
    out = args.out or args.workdir
    results = run_evaluators(run_, task, evaluators, out_dir=out, visualize=args.visualize, ar_max_tokens=ar)
    print(table(results, task.primary))
    print(f"[dgemma] wrote {out}/eval/<eval_name>/step_{run_.step}.json(l)"
          + (" and viz/" if args.visualize else ""), file=sys.stderr)
    return 0


def _run_lm(args: argparse.Namespace, run_) -> int:
    from dgemma.eval.lite import evaluate_lm, lm_table
    from dgemma.training.runs import load_run

    try:
        steps = tuple(int(x) for x in args.gen_steps.split(",") if x.strip())
    except ValueError:
        raise DGemmaError(f"--gen_steps must be comma-separated integers, got {args.gen_steps!r}") from None
    for name in ("windows", "elbo_points", "gen_canvases", "gen_batch", "repeats"):
        if getattr(args, name) < 1:
            raise DGemmaError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not steps or min(steps) < 1:
        raise DGemmaError(f"--gen_steps needs step counts >= 1, got {args.gen_steps!r}")
    ar = load_run(args.ar_workdir) if args.ar_workdir else None
    print(f"[dgemma] eval: lm at step {run_.step} from {run_.path}"
          + (f", AR baseline {ar.path}" if ar else ""), file=sys.stderr)
    result = evaluate_lm(run_, ar_run=ar, windows=args.windows, batch_size=run_.cfg.eval_ds.batch_size,
                         points=args.elbo_points, seed=run_.cfg.eval_ds.seed, gen_steps=steps,
                         gen_canvases=args.gen_canvases, gen_batch=args.gen_batch, repeats=args.repeats,
                         out_dir=args.workdir)
    print(lm_table(result))
    print(f"[dgemma] wrote {args.workdir}/eval/lm/step_{run_.step}.json", file=sys.stderr)
    return 0
