"""``dgemma serve [--checkpoint DIR] [--sudoku-checkpoint DIR] [--text-model gemma3-270m|WORKDIR|none]
[--host 127.0.0.1] [--port 8000] [--device cpu|cuda] [--max-jobs 4] [--max-steps 512] [--max-prompt-tokens 1024]``

A local web playground (FastAPI + uvicorn; see docs/playground.md): a Sudoku panel that fills the
board step by step with the Sudoku checkpoint (default ``checkpoints/sudoku_avg``) and a Text
panel for any model (default the Gemma 3 270M, loaded on the first text request). It binds to
127.0.0.1 unless ``--host`` says otherwise; ``--port 0`` picks a free port. ``--checkpoint DIR``
is a shortcut: a Sudoku run goes to the Sudoku panel, any other run to the Text panel. The same
models answer OpenAI-compatible requests under ``/v1`` (``dgemma/serve/openai_api.py``,
docs/guides/serving.md).
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
from pathlib import Path

from dgemma import shipped
from dgemma.errors import DGemmaError

DEFAULT_SUDOKU = str(shipped.SUDOKU)
DEFAULT_TEXT = "gemma3-270m"
ADAPTED_TEXT = shipped.PUBMEDQA  # the shipped adapted model


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dgemma serve", description="serve the local diffusion playground")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a training workdir: a Sudoku run serves the Sudoku panel, any other run the Text panel")
    p.add_argument("--sudoku-checkpoint", metavar="DIR",
                   help=f"training workdir of the Sudoku model (default {DEFAULT_SUDOKU}; 'none' to disable)")
    p.add_argument("--text-model", metavar="MODEL",
                   help=f"a training workdir (default: checkpoints/pubmedqa_270m where shipped, else {DEFAULT_TEXT}, "
                        f"flagged untrained), a Gemma 3 folder or .gguf, or 'none'")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="inference dtype (auto: a run's training precision; bf16 where the CPU/GPU has native units)")
    p.add_argument("--max-jobs", type=int, default=4, help="sampling requests running at once (default 4)")
    p.add_argument("--max-steps", type=int, default=512, help="denoising steps a request may ask for")
    p.add_argument("--max-canvases", type=int, default=16, help="text canvases a request may ask for")
    p.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="longest text prompt for a pretrained model (a run uses its data.prompt_len)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise DGemmaError(f"--port must be in 0..65535, got {args.port}")
    for name in ("max_jobs", "max_steps", "max_canvases", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            raise DGemmaError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def _none(value: str | None) -> str | None:
    return None if value is None or value.lower() == "none" else value


def resolve_models(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(sudoku source, text source)`` from the flags; ``--checkpoint`` goes where its task says."""
    from dgemma.serve.engine import is_run

    sudoku, text = args.sudoku_checkpoint, args.text_model
    if args.checkpoint:
        if not is_run(args.checkpoint):
            raise DGemmaError(f"--checkpoint {args.checkpoint} is not a training workdir (no config.json)")
        from dgemma.training.config import load_config

        task = load_config(Path(args.checkpoint) / "config.json").data.task
        if task == "sudoku":
            if sudoku is not None:
                raise DGemmaError("--checkpoint is a Sudoku run and --sudoku-checkpoint is given too; pass one")
            sudoku = args.checkpoint
        else:
            if text is not None:
                raise DGemmaError(f"--checkpoint is a {task} run and --text-model is given too; pass one")
            text = args.checkpoint
    sudoku = DEFAULT_SUDOKU if sudoku is None else _none(sudoku)
    if text is None:  # the shipped adapted model where it exists; the base (flagged untrained) otherwise
        text = str(ADAPTED_TEXT) if is_run(ADAPTED_TEXT) else DEFAULT_TEXT
    else:
        text = _none(text)
    if text is not None and text != DEFAULT_TEXT and not Path(text).exists():
        raise DGemmaError(f"--text-model {text}: no such workdir, folder or file (or give {DEFAULT_TEXT} or none)")
    if sudoku is not None and args.sudoku_checkpoint is not None and not is_run(sudoku):
        raise DGemmaError(f"--sudoku-checkpoint {sudoku} is not a training workdir (no config.json)")
    return sudoku, text


def bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET  # a host name
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DGemmaError(f"cannot listen on {host}:{port}: {e.strerror or e}; pass --port N (0 picks a free one)") \
            from None
    sock.listen(128)
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(argv: list[str]) -> int:
    args = parse(argv)
    try:
        import uvicorn

        from dgemma.serve.app import create_app
        from dgemma.serve.engine import Limits, is_run, stop_all_jobs
    except ImportError as e:
        raise DGemmaError(f"dgemma serve needs fastapi and uvicorn ({e}): pip install fastapi uvicorn") from None

    sudoku, text = resolve_models(args)
    if sudoku is not None and not is_run(sudoku):
        print(f"[dgemma] serve: no Sudoku checkpoint at {sudoku}; the Sudoku panel will say how to train one",
              file=sys.stderr)
    limits = Limits(max_steps=args.max_steps, max_canvases=args.max_canvases, max_prompt_tokens=args.max_prompt_tokens,
                    max_jobs=args.max_jobs)
    app = create_app(sudoku=sudoku, text=text, device=args.device, limits=limits, dtype=args.dtype)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    if not _is_loopback(args.host):
        print(f"[dgemma] serve: warning: listening on {args.host}, reachable from other machines; the playground "
              f"has no authentication", file=sys.stderr)
    shown = f"[{host}]" if ":" in host else host
    print(f"[dgemma] serving the playground at http://{shown}:{port}/  (sudoku: {sudoku or 'none'}, "
          f"text: {text or 'none'}; Ctrl-C stops)", flush=True)
    print(f"[dgemma] OpenAI-compatible API at http://{shown}:{port}/v1", flush=True)
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # Ctrl-C: end the running streams at once
            stop_all_jobs(app)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down
        pass
    return 0
