"""Shared pieces of the benchmark suites: timing, memory, profiles, tables, JSON, budgets.

Rules every suite follows (docs/benchmarks.md):

- a figure is the **median** over timed repeats, after untimed warm-up runs;
- a comparison is a **ratio against a baseline measured in the same process** (absolute times on
  a shared machine are noise; ratios of neighbours in time mostly are not);
- a ratio worse than its baseline gets a ``torch.profiler`` table in the JSON (:func:`profile_call`).

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` after a reset. On CPU there is no
allocator counter, so :class:`MemoryTracker` (a ``TorchDispatchMode``) adds up the bytes of every
storage an operator creates and subtracts them when the storage is freed; its peak is the
largest sum of live tensor bytes created inside the measured call (weights and inputs allocated
before it are not counted). It runs during an untimed warm-up call, never during a timed one.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dgemma.device import heap_policy, synchronize
from dgemma.models import smallm

SCHEMA_VERSION = 1
TIMING_METHOD = ("wall clock (time.perf_counter, CUDA synchronised) around each call; median over the timed "
                 "repeats after the warm-up calls")
CPU_MEMORY_METHOD = ("peak live tensor bytes created inside the call, counted by a TorchDispatchMode "
                     "(storage bytes added at creation, removed when the storage is freed), in an untimed "
                     "warm-up call; tensors that existed before the call (weights, inputs) are not counted")
CUDA_MEMORY_METHOD = ("torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus the memory "
                      "allocated before the call")


# ------------------------------------------------------------------------------------ budget
class Budget:
    """Wall-clock seconds a suite may spend; rows beyond it are skipped with a note, never run."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def allows(self, estimate_s: float = 0.0) -> bool:
        """True while the budget leaves room for a call of about ``estimate_s`` seconds."""
        return self.left() > estimate_s


# ------------------------------------------------------------------------------------ peaks
# Dense (no sparsity) BF16 tensor-core peak, TFLOP/s, by device-name substring (vendor datasheets;
# SXM parts; PCIe/NVL variants are lower: pass --peak-tflops). First match wins.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0,
                    "A10G": 70.0, "4090": 165.0, "3090": 71.0, "V100": 125.0, "T4": 65.0}


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """The dense BF16 peak for ``device_name`` (``override`` wins; None when unknown)."""
    if override:
        return float(override)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


# ------------------------------------------------------------------------------------ timing
@dataclass
class Measurement:
    median_s: float
    times_s: list[float]
    warmup: int
    result: Any = None  # what the last timed call returned
    peak_bytes: int | None = None
    largest_bytes: int | None = None

    @property
    def repeats(self) -> int:
        return len(self.times_s)

    def record(self) -> dict:
        out = {"median_s": self.median_s, "min_s": min(self.times_s), "times_s": self.times_s,
               "repeats": self.repeats, "warmup": self.warmup}
        if self.peak_bytes is not None:
            out["peak_bytes"] = self.peak_bytes
        if self.largest_bytes is not None:
            out["largest_tensor_bytes"] = self.largest_bytes
        return out


def measure(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 3, max_seconds: float | None = None,
            device=None, memory: bool = False) -> Measurement:
    """Median wall time of ``fn()`` over up to ``repeats`` timed calls after ``warmup`` untimed ones.

    Timed repeats stop early (never before the first) once they have taken ``max_seconds`` in
    all, so one slow row cannot eat a suite's budget; the number actually run is recorded.
    ``memory=True`` measures the peak memory of the first warm-up call (one is forced).
    """
    peak = largest = None
    for i in range(max(warmup, 1 if memory else 0)):
        if memory and i == 0:
            peak, largest = peak_memory(fn, device)
        else:
            fn()
            synchronize(device)
    times, result = [], None
    for _ in range(max(repeats, 1)):
        synchronize(device)
        t0 = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        if max_seconds is not None and sum(times) >= max_seconds:
            break
    return Measurement(statistics.median(times), times, max(warmup, 1 if memory else 0), result, peak, largest)


def measure_interleaved(fns: dict[str, Callable[[], Any]], *, repeats: int = 3, max_seconds: float | None = None,
                        device=None) -> dict[str, Measurement]:
    """Timed repeats of several already warmed-up calls, interleaved (a, b, a, b, ...), so a change in
    the machine's load hits both sides of a ratio alike. Stops early (after at least one round) once
    the rounds have taken ``max_seconds`` in all."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    results: dict[str, Any] = {}
    spent = 0.0
    for _ in range(max(repeats, 1)):
        for name, fn in fns.items():
            synchronize(device)
            t0 = time.perf_counter()
            results[name] = fn()
            synchronize(device)
            dt = time.perf_counter() - t0
            times[name].append(dt)
            spent += dt
        if max_seconds is not None and spent >= max_seconds:
            break
    return {k: Measurement(statistics.median(v), v, 0, results[k]) for k, v in times.items()}


# ------------------------------------------------------------------------------------ memory
class MemoryTracker(TorchDispatchMode):
    """Live tensor bytes created under the mode: ``peak``, ``current`` and ``largest`` (one storage).

    Keyed by storage, so views cost nothing; a storage is released through a weak reference on
    its (preserved) Python object, i.e. exactly when PyTorch frees it.
    """

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self.largest = 0
        self._live: dict[int, int] = {}

    def _release(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # outputs that alias an input (views, in-place ops) allocate nothing, even when the input
        # predates the mode (a transposed weight is not a new 640 MiB tensor)
        inputs = {x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0]
                  if isinstance(x, torch.Tensor) and x.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._live or (storage.data_ptr() in inputs and storage.nbytes()):
                continue
            n = storage.nbytes()
            try:
                weakref.finalize(storage, self._release, key)
            except TypeError:  # storages without weak references (old PyTorch): count, never free
                pass
            self._live[key] = n
            self.current += n
            self.peak = max(self.peak, self.current)
            self.largest = max(self.largest, n)
        return out


def peak_memory(fn: Callable[[], Any], device=None) -> tuple[int, int | None]:
    """``(peak bytes above the starting point, largest single tensor bytes or None)`` of ``fn()``."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base), None
    with MemoryTracker() as tracker:
        fn()
    return int(tracker.peak), int(tracker.largest)


def memory_method(device) -> str:
    return CUDA_MEMORY_METHOD if device is not None and torch.device(device).type == "cuda" else CPU_MEMORY_METHOD


# ------------------------------------------------------------------------------------ profiles
def profile_call(fn: Callable[[], Any], *, device=None, row_limit: int = 15) -> dict:
    """One call of ``fn`` under ``torch.profiler``: the top operators by self time, as a table and
    as records, plus the top (operator, input shapes) pairs, which is where a big matmul such as
    the 262,144-word LM head shows up by name."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device is not None and torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=acts, record_shapes=True) as prof:
        fn()
        synchronize(device)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    total = sum(e.self_device_time_total if cuda else e.self_cpu_time_total for e in events) or 1
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    top = sorted(events, key=key, reverse=True)[:row_limit]
    by_shape = sorted(prof.key_averages(group_by_input_shape=True), key=key, reverse=True)[:row_limit]
    return {
        "sort_by": sort,
        "total_self_ms": total / 1e3,
        "top_ops": [{"name": e.key, "self_ms": key(e) / 1e3, "share": key(e) / total, "calls": e.count}
                    for e in top],
        "top_ops_by_shape": [{"name": e.key, "input_shapes": str(e.input_shapes)[:200], "self_ms": key(e) / 1e3,
                              "share": key(e) / total, "calls": e.count} for e in by_shape],
        "table": events.table(sort_by=sort, row_limit=row_limit),
    }


def share_of(profile: dict, pred: Callable[[dict], bool]) -> float:
    """Share of the profiled self time in the (operator, shapes) rows where ``pred(row)``."""
    return sum(r["share"] for r in profile.get("top_ops_by_shape", []) if pred(r))


# ------------------------------------------------------------------------------------ ratios
def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing or the denominator is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


# ------------------------------------------------------------------------------------ context
@dataclass
class Context:
    """What every suite gets: where to write, how big to run, and shared state."""

    out: Path = Path("results")
    quick: bool = False
    profile: str = "cpu"  # quick | cpu | gpu: the size tables in each suite
    device: str = "cpu"
    budget_s: float | None = None
    repeats: int | None = None  # overrides each row's default number of timed repeats
    do_profile: bool = True
    sudoku_workdir: str | None = None
    pubmedqa_workdir: str | None = None
    pubmedqa_steps: tuple[int, ...] | None = None  # the adapted PubMedQA rows' steps a canvas (None: the profile's)
    pubmedqa_prefix: str | None = None  # a response prefix for both PubMedQA decoders (None: the run's own)
    pubmedqa_no_repeat: bool = False  # the PubMedQA diffusion rows with eval_ds.commit_no_repeat on
    # > 0: the reused-keys rows again with CanvasSampler.shortlist at this K (None: the run's interactive one)
    pubmedqa_shortlist: int | None = None
    pubmedqa_b1: int | None = None  # questions the PubMedQA batch-1 rows decode (None: the profile's)
    dtype: str = "auto"  # the decode suite's weights: auto | float32 | bfloat16 (dgemma/device.py:resolve_dtype)
    compile: bool = False  # decode --only step_cost: also time the forwards through torch.compile
    allow_convert: bool = True  # build the 270M cache from the GGUF package when it is missing
    verbose: bool = True
    cache: dict = field(default_factory=dict)  # models shared between suites of one process

    def say(self, msg: str) -> None:
        if self.verbose:
            print(f"[bench] {msg}", file=sys.stderr, flush=True)

    def reps(self, default: int) -> int:
        return self.repeats if self.repeats is not None else default


# ------------------------------------------------------------------------------------ machine
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001 - missing or broken optional package: just not reported
        return None


def machine_info(device: str = "cpu") -> dict:
    info = {
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "heap": heap_policy(),  # glibc's policy for big tensors (dgemma/device.py:keep_freed_heap)
        # whether the few-row CPU kernels loaded (dgemma/models/smallm.py; bf16 ones also need AVX512-BF16)
        "smallm_kernel": smallm.kernel() is not None if device == "cpu" else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "device": device,
        "load_average": load_average(),
    }
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


# ------------------------------------------------------------------------------------ tables
def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:
            return "nan"
        a = abs(v)
        if a != 0 and (a >= 1e5 or a < 1e-3):
            return f"{v:.3g}"
        return f"{v:.3f}" if a < 10 else f"{v:.1f}"
    return str(v)


def format_table(rows: list[dict], columns: list[tuple[str, str]], title: str | None = None) -> str:
    """Plain-text table of ``rows``; ``columns`` are ``(key, header)``; missing values print '-'."""
    cells = [[h for _, h in columns]] + [[_fmt(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    out = [lines[0], "-" * len(lines[0]), *lines[1:]]
    if title:
        out.insert(0, title)
    return "\n".join(out)


def mib(n: int | None) -> float | None:
    return None if n is None else n / 2**20


# ------------------------------------------------------------------------------------ JSON
def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    return repr(x)


def new_result(suite: str, ctx: Context, command: str | None = None) -> dict:
    """The common head of every suite's JSON; the suite fills ``rows``, ``ratios`` and the rest."""
    return {
        "suite": suite,
        "schema": SCHEMA_VERSION,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command or "dgemma bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "quick": ctx.quick,
        "profile": ctx.profile,
        "machine": machine_info(ctx.device),
        "method": {"timing": TIMING_METHOD, "memory": memory_method(ctx.device)},
        "settings": {},
        "rows": [],
        "ratios": [],
        "profiles": {},
        "notes": [],
        "skipped": [],
        "tables": [],
    }


def add_ratio(result: dict, name: str, value: float | None, *, baseline: str, higher_is_better: bool = True,
              what: str = "") -> None:
    """Record a headline ratio: ``value`` is this setting over ``baseline`` (>1 = faster/better when
    ``higher_is_better``)."""
    worse = None if value is None else (value < 1.0 if higher_is_better else value > 1.0)
    result["ratios"].append({"name": name, "value": value, "baseline": baseline,
                             "higher_is_better": higher_is_better, "worse_than_baseline": worse, "what": what})


def finish(result: dict, ctx: Context, started: float) -> dict:
    result["seconds"] = time.perf_counter() - started
    result["machine"]["load_average_end"] = load_average()
    return result


def write_result(result: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result['suite']}.json"
    tmp = out / f".{result['suite']}.json.tmp"
    tmp.write_text(json.dumps(jsonable(result), indent=2) + "\n")
    tmp.replace(path)
    return path


def ratios_table(result: dict) -> str:
    rows = [{"name": r["name"], "value": r["value"], "better": "x > 1" if r["higher_is_better"] else "x < 1",
             "baseline": r["baseline"], "flag": "WORSE" if r["worse_than_baseline"] else ""} for r in result["ratios"]]
    return format_table(rows, [("name", "ratio"), ("value", "x"), ("better", "better if"), ("baseline", "baseline"),
                               ("flag", "")],
                        title=f"== {result['suite']}: ratios against the baseline (WORSE: on its wrong side of 1)")


def no_grad_if(flag: bool):
    return torch.no_grad() if flag else nullcontext()
