"""Shared helpers of the benchmark scripts: environment, timing, peak memory, results, plots.

Every benchmark records the same environment fields (env_info), times with the same median
(time_ms), measures memory the same way (peak_extra_bytes) and writes its results to
benchmarks/results/<gpu>/<name>.json and .md (<gpu>: h100, h200, ..., or cpu; h200x2 for a
benchmark of two H200s), or to $MTI_RESULTS_DIR when set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

# do_bench's defaults (25 ms of warm-up, 100 ms of timed calls) also suit the CPU.
DEFAULT_WARMUP_MS = 25.0
DEFAULT_REP_MS = 100.0

# Bigger than the L2 cache of any GPU we target (H100: 50 MB), so that writing it between
# timed calls leaves no operand of the previous call in L2.
_L2_FLUSH_BYTES = 256 << 20


# --------------------------------------------------------------------------- environment


def env_info() -> dict:
    """device, torch version and the repository's commit, stored with every record."""
    return {"device": _device_name(), "torch": torch.__version__, "commit": _git_commit()}


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {model} ({torch.get_num_threads()} threads)"


def _git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    if os.environ.get("MTI_COMMIT"):
        # Set by whoever shipped the tree to the GPU machine, whose copy may carry a stale .git.
        return os.environ["MTI_COMMIT"]
    try:
        commit = git("rev-parse", "--short", "HEAD")
        # Any change to the code marks the tree dirty, new files included, but not the results
        # that the benchmarks write (build outputs are in .gitignore and never show).
        dirty = git(
            "status",
            "--porcelain",
            "--untracked-files=all",
            "--",
            ".",
            ":(exclude)benchmarks/results",
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def best_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------- timing


def time_ms(
    fn: Callable[[], object],
    *,
    warmup_ms: float = DEFAULT_WARMUP_MS,
    rep_ms: float = DEFAULT_REP_MS,
    device: torch.device | str | None = None,
    gpu_only: bool = False,
) -> float:
    """Median milliseconds of one call of fn.

    CUDA: triton.testing.do_bench when Triton imports, else CUDA events around each call with
    the L2 cache flushed in between (what do_bench does). CPU: perf_counter. device defaults
    to CUDA when a GPU is present.

    gpu_only (CUDA): the GPU's time alone. Each timed call is queued behind a GPU wait longer
    than the call's host time, so that all of its kernels are queued by the time the start
    event runs; otherwise a call whose host work (autograd's, say) outlasts the L2 flush that
    precedes it counts the GPU's idle wait for its first launch, which varies with how busy
    the host is.
    """
    device = torch.device(device) if device is not None else best_device()
    if device.type == "cuda":
        if gpu_only:
            return _cuda_events_ms(fn, warmup_ms, rep_ms, queue_ahead=True)
        try:
            import triton.testing
        except ImportError:
            return _cuda_events_ms(fn, warmup_ms, rep_ms)
        return float(
            triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        )
    return _perf_counter_ms(fn, warmup_ms, rep_ms)


def time_alternating(
    fns: Sequence[Callable[[], object]],
    *,
    warmup_ms: float = DEFAULT_WARMUP_MS,
    rep_ms: float = DEFAULT_REP_MS,
    device: torch.device | str | None = None,
    min_turns: int = 8,
    gpu_only: bool = False,
) -> list[list[list[float]]]:
    """Milliseconds of each timed call of each fn, by the call's place in its turn: result[i][p]
    holds fns[i]'s calls made p-th in a turn. The fns are called in turns, each turn one fn
    later than the last (a, b, c / b, c, a / c, a, b / ...), about rep_ms of calls of each (at
    least min_turns turns, whole rounds of places) after about warmup_ms of turns; see
    place_median.

    Each call is timed as time_ms times it (CUDA: events around it, L2 flushed before it; CPU:
    perf_counter). Calls side by side see the same state of the machine: a GPU under its
    power cap changes its clocks over tens of milliseconds, for every kernel alike, and the
    host's speed drifts too; timed one after the other, each fn would get whichever state its
    turn met. Every fn takes every place equally often because the place in a turn weighs on
    a call's time by itself, the same way in every repetition.

    gpu_only (CUDA): as time_ms's, each call queued behind a GPU wait longer than its host
    time. Calls of a few microseconds of GPU work are host-bound otherwise, and a call's time
    then takes in whatever part of its host time the GPU waited for: the same kernels would
    read differently behind different host code.
    """
    device = torch.device(device) if device is not None else best_device()
    cuda = device.type == "cuda"
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device=device) if cuda else None

    host_ms = [0.0] * len(fns)  # the longest host time of a warm-up call of each fn
    sleeps = [0] * len(fns)  # GPU cycles to wait before each timed call of each fn

    def timed(i: int) -> Callable[[], float]:
        """Starts one timed call of fns[i]; returns how to read its time once all are done."""
        fn = fns[i]
        if not cuda:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
            return lambda: ms
        flush.zero_()
        if sleeps[i]:
            torch.cuda._sleep(sleeps[i])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        return lambda: start.elapsed_time(end)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def round_ms() -> float:
        """The time of one call of every fn, with its flush."""
        t0 = time.perf_counter()
        for i, fn in enumerate(fns):
            if cuda:
                flush.zero_()
            h0 = time.perf_counter()
            fn()
            host_ms[i] = max(host_ms[i], (time.perf_counter() - h0) * 1e3)
        sync()
        return (time.perf_counter() - t0) * 1e3

    round_ms()  # the first calls may compile or allocate: no estimate from them
    host_ms[:] = [0.0] * len(fns)
    estimate = statistics.median(round_ms() for _ in range(3))
    for _ in range(_repeats(estimate, warmup_ms)):
        round_ms()
    if cuda and gpu_only:
        sleeps[:] = [_queue_ahead_cycles(ms) for ms in host_ms]
    n = len(fns)
    turns = -(-max(min_turns, _repeats(estimate / n, rep_ms)) // n) * n
    reads = [[[] for _ in range(n)] for _ in fns]
    for turn in range(turns):
        for place in range(n):
            i = (turn + place) % n
            reads[i][place].append(timed(i))
    sync()
    return [[[r() for r in at] for at in by_place] for by_place in reads]


def place_median(by_place: Sequence[Sequence[float]]) -> float:
    """One fn's time from time_alternating: the mean over places of its median at each place."""
    return statistics.fmean(statistics.median(at) for at in by_place)


def time_and_peak(
    calls: dict[str, Callable[[], object]], *, warmup_ms: float, rep_ms: float, device
) -> tuple[dict[str, float], dict[str, int]]:
    """Each named call's time ({name: ms}, place_median of time_alternating; on CUDA the GPU's
    time alone) and its peak memory above what was allocated before it ({name: bytes})."""
    peaks = {name: peak_extra_bytes(call, device=device) for name, call in calls.items()}
    reads = time_alternating(
        list(calls.values()),
        warmup_ms=warmup_ms,
        rep_ms=rep_ms,
        device=device,
        gpu_only=torch.device(device).type == "cuda",
    )
    return dict(zip(calls, (place_median(r) for r in reads))), peaks


def contender_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the options of a benchmark of contenders timed by time_and_peak: the
    device, leaving out torch.compile or Liger-Kernel, and the timing budgets."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-liger", action="store_true")
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    return ap


def contender_records(
    case: dict, times: dict, peaks: dict, errors: dict, copy_ms: float, label: str = ""
) -> list[dict]:
    """One record per contender of a case that time_and_peak timed (with a "copy" row):
    env_info, the case's fields, ms, of_copy (copy_ms / ms; 1 for the copy itself),
    peak_extra_bytes and max_err (None where not measured); each printed as a line."""
    records = []
    for name, ms in times.items():
        of_copy = 1.0 if name == "copy" else copy_ms / ms
        records.append(
            dict(
                env_info(),
                **case,
                impl=name,
                ms=ms,
                of_copy=of_copy,
                peak_extra_bytes=peaks[name],
                max_err=errors.get(name),
            )
        )
        print(
            f"  {label}{name:>18}: {ms:8.3f} ms  of copy {of_copy:5.2f}  "
            f"peak {fmt_bytes(peaks[name]):>10}  max err {errors.get(name)}"
        )
    return records


def _repeats(estimate_ms: float, budget_ms: float) -> int:
    return max(1, min(10_000, int(budget_ms / max(estimate_ms, 1e-6))))


@functools.cache
def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep on the current device, at the
    fastest clock of a few tries after a warm-up, so that a sleep lasts at least as long as
    asked: a GPU that idled runs its first sleep at a lower clock."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)
    rates = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        rates.append(cycles / start.elapsed_time(end))
    return max(rates)


def _queue_ahead_cycles(host_ms: float) -> int:
    """GPU sleep cycles to queue before a timed call whose host time is at most host_ms, so
    that its kernels are all queued by the time its start event runs."""
    return int((2 * host_ms + 0.05) * _sleep_cycles_per_ms())


def _cuda_events_ms(fn, warmup_ms: float, rep_ms: float, queue_ahead: bool = False) -> float:
    """See time_ms; queue_ahead is its gpu_only."""
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / 5
    host_ms = 0.0  # the longest host time of a warm-up call
    for _ in range(_repeats(estimate, warmup_ms)):
        t0 = time.perf_counter()
        fn()
        host_ms = max(host_ms, (time.perf_counter() - t0) * 1e3)
    sleep_cycles = _queue_ahead_cycles(host_ms) if queue_ahead else 0
    n = _repeats(estimate, rep_ms)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush.zero_()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _perf_counter_ms(fn, warmup_ms: float, rep_ms: float) -> float:
    fn()  # the first call may compile or allocate: no estimate from it
    t0 = time.perf_counter()
    fn()
    estimate = (time.perf_counter() - t0) * 1e3
    for _ in range(_repeats(estimate, warmup_ms) - 1):
        fn()
    times = []
    for _ in range(max(3, _repeats(estimate, rep_ms))):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# --------------------------------------------------------------------------- memory


def peak_extra_bytes(fn: Callable[[], object], *, device: torch.device | str | None = None) -> int:
    """Peak bytes allocated while fn runs, above what was allocated when it started.

    CUDA: the caching allocator's max_memory_allocated after reset_peak_memory_stats. CPU: the
    allocations and frees that torch.profiler records during fn, summed in time order; the
    peak of that running sum. What fn returns is kept alive until the measurement ends.
    """
    device = torch.device(device) if device is not None else best_device()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del result
        return int(peak)
    return _cpu_peak_extra_bytes(fn)


def _cpu_peak_extra_bytes(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints a line to stderr at every profiler start and stop; level 6 silences it.
    # It is read when the profiler starts, so setting it here is early enough.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    # "[memory]" events carry the bytes of each allocation (> 0) and free (< 0) that the CPU
    # allocator reported while profiling; the public FunctionEvent API only has per-op sums,
    # which lose the order needed for a peak.
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return int(peak)


def fmt_bytes(nbytes: float) -> str:
    """Human-readable size in binary units, e.g. '64.0 MiB'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- results


def device_slug(device: str | None = None) -> str:
    """The results folder of a device: its GPU model in lower case ("h100", "h200"), or "cpu"."""
    name = device or env_info()["device"]
    if name.startswith("CPU"):
        return "cpu"
    words = [w for w in re.split(r"[\s-]+", name) if any(ch.isdigit() for ch in w)]
    return (words[0] if words else name.split()[-1]).lower()


def results_dir(suffix: str = "") -> Path:
    """benchmarks/results/<device_slug()><suffix>, or $MTI_RESULTS_DIR when set; created on
    first use. suffix names a machine of several GPUs: "x2" for a benchmark run on two."""
    default = REPO_ROOT / "benchmarks" / "results" / (device_slug() + suffix)
    path = Path(os.environ.get("MTI_RESULTS_DIR", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_results(
    name: str, records: list[dict], table_md: str, suffix: str = ""
) -> tuple[Path, Path]:
    """Writes <results>/<name>.json (the records of one sweep) and <results>/<name>.md (its
    tables), replacing an earlier sweep's; <results> is results_dir(suffix)."""
    out = results_dir(suffix)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(records, indent=1) + "\n")
    env = records[0] if records else env_info()
    header = f"# {name}\n\n{env['device']}, torch {env['torch']}, commit {env['commit']}\n\n"
    md_path.write_text(header + table_md.rstrip() + "\n")
    return json_path, md_path


def earlier_records(name: str, env: dict, keep: Callable[[dict], bool]) -> list[dict]:
    """The records of <results>/<name>.json that `keep` accepts, when all are of env's commit,
    device and torch: the earlier parts of a sweep run in parts (a script's --append). Exits
    when the file holds another commit's, device's or torch's records."""
    path = results_dir() / f"{name}.json"
    if not path.exists():
        return []
    same = ("commit", "device", "torch")
    old = json.loads(path.read_text())
    if any(r[k] != env[k] for r in old for k in same):
        sys.exit(f"--append: {path} holds records of another commit, device or torch")
    return [r for r in old if keep(r)]


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A GitHub markdown table of the given columns; missing values print as '-'."""
    lines = [
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots


Series = dict[str, Sequence[tuple[float, float]]]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(ax, series: Series, xlabel: str, ylabel: str, title: str, logx: bool) -> None:
    for label, points in series.items():
        points = sorted(points)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def plot_lines(
    path: str | os.PathLike,
    series: Series,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = True,
) -> None:
    """One line per series (label -> [(x, y), ...]) in one PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _draw(ax, series, xlabel, ylabel, title, logx)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_grid(
    path: str | os.PathLike,
    panels: Iterable[tuple[str, Series]],
    xlabel: str,
    ylabel: str,
    ncols: int,
    logx: bool = True,
) -> None:
    """Several plot_lines panels, (title, series) each, in a grid of ncols columns."""
    panels = list(panels)
    if not panels:
        return
    plt = _pyplot()
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.4 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (title, series) in zip(flat, panels):
        _draw(ax, series, xlabel, ylabel, title, logx)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cuda_missing(script: str, device: str) -> bool:
    """True, after saying so, when a CUDA run was asked for on a machine without a GPU: the
    benchmark then measures nothing and exits 0 (CI machines have no GPU)."""
    if device == "cuda" and not torch.cuda.is_available():
        print(
            f"{script} needs CUDA; no GPU here, nothing measured "
            "(--device cpu runs the code paths on the CPU)"
        )
        return True
    return False
