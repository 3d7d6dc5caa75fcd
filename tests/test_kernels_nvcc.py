"""Every torch-free kernel file (csrc/kernels/*.cu) compiles with nvcc for every target
architecture, with the flags setup.py gives nvcc, and ptxas reports no register spills; the
host side of the CUDA ops (csrc/cuda/*.cu) compiles against the installed torch's headers.
Needs nvcc only (no GPU, no CUDA build of torch); skipped without it.

nvcc's results are kept by content, as ccache keeps objects: the key hashes nvcc's version,
torch's, the command line, the source and every file of this tree it includes, directly or
through other headers (tests/cuda_stubs/ whole; the toolkit's and torch's own headers are pinned
by the two versions). A change compiles anew exactly the sources that include what changed.
MTI_NVCC_CACHE=0 turns the cache off; MTI_NVCC_CACHE=<dir> moves it (default
~/.cache/make_torch_inplace/nvcc)."""

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = sorted((ROOT / "csrc" / "kernels").rglob("*.cu"))
NVCC = shutil.which("nvcc") or (
    os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if "CUDA_HOME" in os.environ else None
)

# setup.py's nvcc flags and its default TORCH_CUDA_ARCH_LIST "7.5;8.0;8.6;8.9;9.0a" with PTX for
# compute_90: machine code for each architecture (sm_90a: with the warpgroup MMA kernels) plus
# PTX that later GPUs compile. Keep the two in step.
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
GENCODES = [f"arch=compute_{a},code=sm_{a}" for a in ("75", "80", "86", "89", "90a")] + [
    "arch=compute_90,code=compute_90"
]

_CACHE_SETTING = os.environ.get("MTI_NVCC_CACHE", "")
CACHE = (
    None
    if _CACHE_SETTING == "0"
    else Path(_CACHE_SETTING or Path.home() / ".cache" / "make_torch_inplace" / "nvcc")
)


@functools.cache
def _versions_digest() -> bytes:
    """nvcc's and torch's versions and tests/cuda_stubs/ (which stands in for headers)."""
    h = hashlib.sha256()
    h.update(subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout.encode())
    try:
        import torch

        h.update(torch.__version__.encode())
    except ImportError:
        pass
    for path in sorted((ROOT / "tests" / "cuda_stubs").rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.digest()


_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)


def _included_files(source: Path) -> list[Path]:
    """source and every file under csrc/ it includes, transitively. Every #include line counts,
    also those a condition excludes: the set can only be too large, never miss a file."""
    found, todo = {source}, [source]
    while todo:
        current = todo.pop()
        for name in _INCLUDE.findall(current.read_text()):
            for base in (current.parent, ROOT / "csrc"):
                path = (base / name).resolve()
                if path.is_file() and path not in found:
                    found.add(path)
                    todo.append(path)
    return sorted(found)


def _inputs_digest(source: Path) -> str:
    h = hashlib.sha256(_versions_digest())
    for path in _included_files(source):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def run_nvcc(cmd: list[str], source: Path, out: Path) -> subprocess.CompletedProcess:
    """Runs nvcc's command line `cmd` (which compiles `source` into `out`), or returns its
    cached result."""
    # Neither the output's temporary path nor where the checkout lies changes the result.
    key_args = [a.replace(str(ROOT), "<root>") for a in cmd if a != str(out)]
    key = hashlib.sha256(json.dumps([_inputs_digest(source), key_args]).encode()).hexdigest()
    cached = CACHE / f"{key}.json" if CACHE is not None else None
    if cached is not None and cached.exists():
        r = json.loads(cached.read_text())
        return subprocess.CompletedProcess(cmd, r["returncode"], r["stdout"], r["stderr"])
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if result.returncode == 0 and out.stat().st_size == 0:
        result.returncode, result.stderr = 1, result.stderr + "\nempty object file"
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        record = {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}
        # Written whole, then renamed: parallel test workers may compile the same file.
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(record))
        partial.replace(cached)
    return result


pytestmark = pytest.mark.skipif(
    NVCC is None or not Path(NVCC).exists(), reason="nvcc not found (PATH, CUDA_HOME)"
)


@functools.cache
def nvcc(source: Path) -> subprocess.CompletedProcess:
    """Compiles source (-c, host code included) for every target once per test session; both
    tests below read the same run."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            NVCC,
            *NVCC_FLAGS,
            "-I",
            str(ROOT / "csrc"),
            "-Xptxas",
            "-v",
            "--threads",
            str(min(len(GENCODES), os.cpu_count() or 1)),
        ]
        for g in GENCODES:
            cmd += ["-gencode", g]
        out = Path(tmp) / (source.stem + ".o")
        cmd += ["-c", str(source), "-o", str(out)]
        return run_nvcc(cmd, source, out)


# ptxas -v prints, per kernel and architecture: "Compiling entry function '<name>' for
# 'sm_XX'" (sm_90a: 'sm_90a') and later "N bytes spill stores, M bytes spill loads".
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def spills(ptxas_log: str) -> list[str]:
    found, entry = [], None
    for line in ptxas_log.splitlines():
        if m := _ENTRY.search(line):
            entry = f"{m.group(1)} ({m.group(2)})"
        elif (m := _SPILL.search(line)) and (int(m.group(1)) or int(m.group(2))):
            found.append(f"{entry}: {m.group(0)}")
    return found


# One nvcc call per kernel file with every architecture (CI has 2 cores); before any kernel
# file exists, one skipped placeholder says so.
KERNEL_PARAMS = [
    pytest.param(k, id=str(k.relative_to(ROOT / "csrc" / "kernels"))) for k in KERNELS
] or [pytest.param(None, id="none", marks=pytest.mark.skip(reason="no csrc/kernels/*.cu yet"))]


@pytest.mark.parametrize("source", KERNEL_PARAMS)
def test_compiles_for_every_arch(source):
    result = nvcc(source)
    assert result.returncode == 0, f"nvcc failed on {source.name}:\n{result.stderr[-8000:]}"


@pytest.mark.parametrize("source", KERNEL_PARAMS)
def test_no_register_spills(source):
    """Spilled registers mean a per-thread array outgrew the register file (e.g. a row cached
    in registers for too wide a row): local-memory traffic the kernels are designed to avoid."""
    result = nvcc(source)
    if result.returncode != 0:
        pytest.skip("does not compile (see test_compiles_for_every_arch)")
    spilled = spills(result.stderr + result.stdout)
    assert not spilled, f"{len(spilled)} kernel/arch pairs spill:\n" + "\n".join(spilled)


# csrc/cuda/: the host side of the CUDA ops, which only a GPU machine builds otherwise. Compiled
# for one architecture (their device code is instantiated in csrc/kernels/, tested above)
# against the headers of the installed torch, which a CPU wheel ships too, with the macros and
# flags torch.utils.cpp_extension adds. tests/cuda_stubs/ stands in for the headers of CUDA
# libraries and of torch's CMake build that those headers include and a CPU machine may lack.
HOST_SOURCES = sorted((ROOT / "csrc" / "cuda").rglob("*.cu"))
CUDA_STUBS = ROOT / "tests" / "cuda_stubs"


@pytest.mark.parametrize("source", [pytest.param(s, id=s.name) for s in HOST_SOURCES])
def test_cuda_host_code_compiles(source):
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    includes = [ROOT / "csrc", *cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / (source.stem + ".o")
        cmd = [
            NVCC,
            *NVCC_FLAGS,
            *cpp_extension.COMMON_NVCC_FLAGS,
            "-DMTI_WITH_CUDA=1",
            "-DTORCH_API_INCLUDE_EXTENSION_H",
            "-DTORCH_EXTENSION_NAME=_C",
            "-gencode",
            "arch=compute_90,code=sm_90",
            *[f"-I{p}" for p in includes],
            # After every real include directory: a toolkit's own headers win.
            "-Xcompiler",
            f"-idirafter{CUDA_STUBS}",
            "-c",
            str(source),
            "-o",
            str(out),
        ]
        result = run_nvcc(cmd, source, out)
    errors = [line for line in result.stderr.splitlines() if "error" in line][:20]
    assert result.returncode == 0, f"nvcc failed on {source.name}:\n" + "\n".join(
        errors or [result.stderr[-8000:]]
    )
