"""Fixtures of the server tests: a live server in a thread and ``dgemma serve`` as a process (the
tiny models they serve are made in ``tests/conftest.py``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dgemma import shipped

REPO = Path(__file__).resolve().parents[2]
SHIPPED_SUDOKU = shipped.SUDOKU


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


class ServeProcess:
    """``dgemma serve --port 0 ARGS`` as a subprocess on 127.0.0.1 (one torch thread); ``url`` is its
    base URL, read from the line it prints."""

    def __init__(self, *args: str):
        cmd = [sys.executable, "-m", "dgemma", "serve", "--port", "0", "--log-level", "warning", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line.startswith("[dgemma] serving the playground at http://127.0.0.1:"):
            self.stop()
            raise RuntimeError(f"dgemma serve did not start: {line}{self.proc.stderr.read()}")
        self.url = line.split(" at ")[1].split()[0].rstrip("/")
        assert self.proc.stdout.readline().strip() == f"[dgemma] OpenAI-compatible API at {self.url}/v1"

    def client(self, **kw):
        """An ``openai.OpenAI`` client of this server that does not retry (429s must be seen)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)

    def status(self) -> dict:
        import httpx

        return httpx.get(self.url + "/api/status", timeout=30).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="session")
def serve_process():
    """:class:`ServeProcess`, for fixtures of any scope to start (and stop) servers with."""
    return ServeProcess
