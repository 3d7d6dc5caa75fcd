"""Build make_torch_inplace._C: the C++ ops always, the CUDA ops when torch has CUDA and nvcc
exists.

Whether to build CUDA is decided by the toolchain (torch.version.cuda and CUDA_HOME), never by
torch.cuda.is_available(): a build machine may have no GPU.
"""

import glob
import os
import sys

import torch
from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
# sm_75..sm_90 machine code plus PTX for the newest, unless the builder names its own list. The
# sm_90 code is built for sm_90a (the H100/H200 family), whose warpgroup MMA the zero-workspace
# matmul uses; PTX stays plain compute_90, which later GPUs can compile.
DEFAULT_ARCH_LIST = "7.5;8.0;8.6;8.9;9.0a"
DEFAULT_PTX = "-gencode=arch=compute_90,code=compute_90"


def sources(*patterns):
    return sorted(
        p for pat in patterns for p in glob.glob(os.path.join("csrc", pat), recursive=True)
    )


def make_extension():
    # No -std flag: torch.utils.cpp_extension passes the standard this torch was built with
    # (C++20 for recent releases); forcing another one breaks the ABI of torch's headers.
    cxx_flags = ["-O3"]
    # at::parallel_for is a header template: built with torch's OpenMP backend it is an
    # `omp parallel` region in our own code, which runs on one thread unless compiled with
    # -fopenmp. Not linked with it: the OpenMP runtime is the one libtorch_cpu loads.
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
    common = sources("registration.cpp", "common/**/*.cpp", "cpu/**/*.cpp")
    with_cuda = torch_has_cuda() and cpp_extension.CUDA_HOME is not None
    if os.environ.get("MTI_FORCE_CPU", "0") == "1":
        with_cuda = False
    if not with_cuda:
        return cpp_extension.CppExtension(
            "make_torch_inplace._C",
            common,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": cxx_flags},
        )
    default_archs = "TORCH_CUDA_ARCH_LIST" not in os.environ
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    nvcc_flags = [DEFAULT_PTX] if default_archs else []
    nvcc_flags += [
        "-O3",
        "--expt-relaxed-constexpr",
        # No --use_fast_math: it turns expf into __expf, whose relative error grows with |x|
        # (about 10x PyTorch's error in an fp32 softmax). The kernels use the fast intrinsics
        # explicitly where the output's rounding hides them (exp_for<T> in kernels/common.cuh).
        "-lineinfo",
        # Each file's architectures in parallel: the build's critical path is its largest
        # file, compiled once per architecture.
        "--threads",
        "0",
    ]
    return cpp_extension.CUDAExtension(
        "make_torch_inplace._C",
        common + sources("cuda/**/*.cu", "kernels/**/*.cu"),
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=[("MTI_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


def torch_has_cuda():
    import torch

    return torch.version.cuda is not None


setup(
    name="make-torch-inplace",
    version="0.1.0",
    description="In-place transformer ops (square matmul, softmax, LayerNorm, RMSNorm) for PyTorch",
    license="MIT",
    packages=find_packages(include=["make_torch_inplace", "make_torch_inplace.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    ext_modules=[make_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
