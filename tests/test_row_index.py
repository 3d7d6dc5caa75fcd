"""csrc/kernels/row_layout.h's RowIndexer::offset on the host, compiled with the system C++
compiler, against the offset computed from the sizes and strides: its 32-bit and 64-bit paths,
rows and sizes past 2^31 and 2^32, broadcast (stride 0) dims. The kernels run the same
header's code; the op tests reach it only through the shapes they happen to use, none of them
past 2^31 rows."""

import functools
import math
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("c++") or shutil.which("g++")
MAX_DIMS = 8  # kMaxLeadDims

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")

# Reads one query per line, "NDIM S1 .. Sk T1 .. Tk ROW", and prints the offset of ROW in a
# RowIndexer of those sizes and strides.
_PROGRAM = r"""
#include <cstdio>
#include "kernels/row_layout.h"
int main() {
  int ndim;
  while (std::scanf("%d", &ndim) == 1) {
    mti::RowIndexer index;
    index.ndim = ndim;
    long long v, row;
    for (int i = 0; i < ndim; ++i) std::scanf("%lld", &v), index.sizes[i] = v;
    for (int i = 0; i < ndim; ++i) std::scanf("%lld", &v), index.strides[i] = v;
    if (std::scanf("%lld", &row) != 1) return 1;
    std::printf("%lld\n", static_cast<long long>(index.offset(row)));
  }
  return 0;
}
"""


@functools.cache
def _binary() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="mti_row_index_"))
    src, exe = tmp / "row_index.cpp", tmp / "row_index"
    src.write_text(_PROGRAM)
    subprocess.run(
        [CXX, "-std=c++17", "-O2", "-I", str(ROOT / "csrc"), str(src), "-o", str(exe)],
        check=True,
        capture_output=True,
        text=True,
    )
    return exe


def _run(lines: list[str]) -> list[int]:
    out = subprocess.run(
        [str(_binary())], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True
    ).stdout
    return [int(v) for v in out.split()]


def _reference_offset(sizes, strides, row):
    off = 0
    for size, stride in zip(reversed(sizes[1:]), reversed(strides[1:])):
        off += (row % size) * stride
        row //= size
    return off + row * strides[0]


@st.composite
def _indexers(draw):
    """Sizes (with some past 2^31), strides (0 for broadcast dims) and rows: the first and last
    rows, the neighbours of 2^31 and 2^32 where they exist, and random ones."""
    ndim = draw(st.integers(1, MAX_DIMS))
    size = st.one_of(
        st.integers(2, 9), st.integers(2, 5000), st.sampled_from([2**31 - 1, 2**31, 2**33 + 1])
    )
    sizes = [draw(size) for _ in range(ndim)]
    strides = [draw(st.sampled_from([0, 1, 3, 1024, 2**20 + 7])) for _ in range(ndim)]
    # Rows and offsets of a real tensor fit in int64.
    while math.prod(sizes) >= 2**62 or sum((s - 1) * t for s, t in zip(sizes, strides)) >= 2**62:
        sizes[sizes.index(max(sizes))] //= 2
    total = math.prod(sizes)
    rows = {0, total - 1, draw(st.integers(0, total - 1))}
    rows |= {r for r in (2**31 - 1, 2**31, 2**32 - 1, 2**32) if r < total}
    return sizes, strides, sorted(rows)


@settings(max_examples=60)
@given(st.lists(_indexers(), min_size=1, max_size=10))
def test_row_offsets(indexers):
    lines, expected = [], []
    for sizes, strides, rows in indexers:
        for r in rows:
            lines.append(" ".join(map(str, [len(sizes), *sizes, *strides, r])))
            expected.append(_reference_offset(sizes, strides, r))
    assert _run(lines) == expected
