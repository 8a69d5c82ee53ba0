"""Helpers shared by the benchmarks: machine info, timing, thread control, JSON and markdown."""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"


# ---------------------------------------------------------------- machine
def cpu_model() -> str:
    """The CPU's model name, with its family and model numbers where /proc/cpuinfo has
    them: a virtual machine may name every AMD server CPU "AMD EPYC", and which one
    it is (Zen 2: family 23, Zen 5: family 26) decides which kernels libibp runs."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                break  # the first CPU's block ends
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _version(module: str) -> str | None:
    try:
        return getattr(__import__(module), "__version__", "?")
    except Exception:  # noqa: BLE001 - an optional library may fail to import in many ways
        return None


def machine_info(extra_versions: tuple = ()) -> dict:
    """CPU, cores, memory, library versions (plus those of `extra_versions` modules) and
    the git commit, for a results file."""
    from ibp_embed import _native

    mem_total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    cache = {}  # per-core view as sysfs (and lscpu) report it; getconf can report the host's
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind = (d / "level").read_text().strip(), (d / "type").read_text().strip()
            size = (d / "size").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction":
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            cache[f"L{level}"] = int(size.rstrip("KMG")) * mult
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    try:
        lib_sha = hashlib.sha256(_native.library_path.read_bytes()).hexdigest()[:16]
    except OSError:
        lib_sha = None
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cache_bytes": cache,
        "mem_total_bytes": mem_total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in
                     ("torch", "numpy", "ibp_embed", "zstandard", "lz4", "blosc2", "fbgemm_gpu", "torchrec",
                      *extra_versions)},
        "ibp_isa": {isa: name for name, isa in _native.KERNEL_SETS.items()}[_native.lib.ibp_isa()],
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty) if dirty is not None else None,
        "libibp_sha256_16": lib_sha,  # identifies the native build (tree dirty, or $IBP_LIBRARY)
        "libibp_path": str(_native.library_path),
    }


# ---------------------------------------------------------------- threads
@contextlib.contextmanager
def threads(n: int):
    """Run a block with n torch threads and n libibp threads, restoring both after."""
    from ibp_embed import _native

    old_torch, old_ibp = torch.get_num_threads(), int(_native.lib.ibp_get_num_threads())
    torch.set_num_threads(n)
    _native.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old_torch)
        _native.set_num_threads(old_ibp)


# ---------------------------------------------------------------- timing
def steady_allocations() -> bool:
    """Serve large allocations from glibc's heap and keep it mapped (mallopt), so that
    a buffer freed by one call is reused by the next without page faults.

    A batch's pooled output can exceed glibc's largest dynamic mmap threshold (32 MiB):
    each such allocation is then a fresh mapping whose pages fault on first touch, or,
    now and then, a reused one, at random. FBGEMM's TBE measured 12 ms a batch with
    its 54 MiB output reused and 36 ms with it faulted, so timings measured the
    allocator, not the kernels. Returns False where glibc's mallopt is not available."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 2**31 - 1))


def int_list(p, text: str, option: str) -> list[int]:
    """The comma-separated integers of command-line option `option`, or p.error."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        p.error(f"{option} takes comma-separated integers, not {text!r}")


def time_runs(fn, repeats: int = 5, warmup: int = 1) -> dict:
    """Call fn() warmup + repeats times; seconds of the timed calls and their median."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


FRESH_ORDERS = 64


def fresh_orders(ids: np.ndarray, n: int = FRESH_ORDERS, seed: int = 0) -> list[np.ndarray]:
    """n random orders of ids, one for each call of a decode benchmark in turn. Rows
    decoded in the same order every call let the CPU's branch predictor learn every
    row's branches, which a lookup's rows (others in every batch) never allow: on the
    Zen 4 of docs/benchmarks.md, 1,000 fp32 d64 rows in cache took 14.6 ns a row in one order,
    24.5 in a new order every call, and 24.8 as other rows every call (W = 64)."""
    rng = np.random.default_rng(seed)
    return [np.ascontiguousarray(ids[rng.permutation(ids.size)]) for _ in range(n)]


def in_turn(calls: list):
    """One callable that calls calls[0], calls[1], ... in turn, round and round."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def round_orders(names, rounds: int, seed: int = 0) -> list:
    """An order of `names` for each of `rounds` rounds, drawn at random (seeded), no round
    starting with the name the one before ended with: no name is timed right after itself,
    where its own data is warmest, and none always follows the same other name."""
    names = list(names)
    rng = np.random.default_rng(seed)
    orders = []
    for _ in range(rounds):
        order = [names[i] for i in rng.permutation(len(names))]
        if orders and len(names) > 1 and order[0] == orders[-1][-1]:
            order[0], order[-1] = order[-1], order[0]
        orders.append(order)
    return orders


def time_interleaved(fns: dict, repeats: int = 5, warmup: int = 1, shuffle: bool = False) -> dict:
    """Time several callables in rounds (a, b, c, a, b, c, ...) so that a change of machine
    load over the run hits each of them alike (fairer pairwise ratios on a shared machine).
    shuffle: each round in its own order (round_orders) rather than the order of `fns`.
    Returns {name: {"median_s", "min_s", "times_s"}} like time_runs; times_s[r] is round r's."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    orders = round_orders(fns, repeats) if shuffle else [list(fns)] * repeats
    for order in orders:
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "times_s": t} for name, t in times.items()}


def load_average() -> str:
    """The 1, 5 and 15 minute load averages as a string ('?' where unavailable)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


class Stopwatch:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


# ---------------------------------------------------------------- output
def utc_stamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if math.isfinite(x) else None
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, (torch.dtype, Path)):
        return str(x)
    return x


def shown(path: Path) -> Path:
    """A path as a report prints it: relative to the repository where it lies in it."""
    path = Path(path).resolve()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def write_json(obj: dict, name: str, stamp: str | None = None, results_dir: Path = RESULTS_DIR) -> Path:
    """Write obj to results_dir/<name>-<UTC stamp>.json (written whole, then renamed)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}-{stamp or utc_stamp()}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(obj), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def save_runs(name: str, config: dict, runs: list, results_dir: Path = RESULTS_DIR, **extra) -> dict:
    """{"machine", "config", "runs", **extra} written as results_dir/<name>-<UTC stamp>.json
    (its path printed); returns it."""
    result = {"machine": machine_info(), "config": config, "runs": runs, **extra}
    print(f"\nresults: {write_json(result, name, results_dir=results_dir)}")
    return result


def markdown_table(headers, rows, align=None) -> str:
    """A GitHub markdown table; align: a string of 'l'/'r' per column (default: first left)."""
    headers = [str(h) for h in headers]
    rows = [["" if c is None else str(c) for c in r] for r in rows]
    align = align or "l" + "r" * (len(headers) - 1)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w)
                                 for c, w, a in zip(cells, widths, align)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1))
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def fmt(x, digits: int = 2) -> str:
    """Fixed-point number, '-' for None/NaN."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}"
