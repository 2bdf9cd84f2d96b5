"""Fixtures of the playground tests: a tiny Sudoku run trained in seconds and a live server."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SHIPPED_SUDOKU = REPO / "checkpoints" / "sudoku_small"


def train_tiny_sudoku(workdir: Path) -> Path:
    """A 1-layer Sudoku run of 10 steps at a high rate: far from solving, but a real workdir that
    load_run opens, and trained enough to fill the canvas with digits rather than stop tokens."""
    from dgemma.training.config import parse_cli
    from dgemma.training.trainer import train

    threads = torch.get_num_threads()
    cfg, _ = parse_cli([f"--cfg={REPO / 'configs' / 'sudoku_small.py'}", f"--cfg.workdir={workdir}",
                        "--cfg.train.steps=10", "--cfg.train.checkpoint_every=10", "--cfg.model.num_hidden_layers=1",
                        '--cfg.model.layer_types=["full_attention"]', "--cfg.data.batch_size=8",
                        "--cfg.optim.warmup_steps=0", "--cfg.optim.lr=1e-2", "--cfg.data.pin_clues=true"])
    try:
        train(cfg)
    finally:
        torch.set_num_threads(threads)
    return workdir


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    return train_tiny_sudoku(tmp_path_factory.mktemp("serve") / "tiny_sudoku")


class LiveServer:
    """uvicorn serving ``app`` in a thread on a free 127.0.0.1 port (bound before the thread starts)."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture
def live_server():
    """``live_server(app) -> LiveServer``; every server started is stopped after the test."""
    servers = []

    def start(app) -> LiveServer:
        servers.append(LiveServer(app))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()
