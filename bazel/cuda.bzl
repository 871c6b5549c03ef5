"""The nvcc rule.

`cuda_library(name, srcs, hdrs, deps)` compiles .cu files with nvcc
(sm_90a SASS for Hopper plus compute_90 PTX for other GPUs) into objects
wrapped in a cc_library; without a toolkit it is an empty library.
"""

load("@local_cuda//:defs.bzl", "CUDA_FOUND", "CUDA_PATH")

_NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "-gencode arch=compute_90a,code=sm_90a",
    "-gencode arch=compute_90,code=compute_90",
    "-Xcompiler -fPIC",
    "--expt-relaxed-constexpr",
    "-lineinfo",
]

def cuda_library(name, srcs, hdrs = [], deps = [], visibility = None):
    """nvcc-compiled .cu files as a cc_library (empty without a toolkit)."""
    objs = []
    if CUDA_FOUND:
        for src in srcs:
            stem = src[:-len(".cu")]
            native.genrule(
                name = "%s_%s_nvcc" % (name, stem),
                srcs = [src] + hdrs,
                outs = [stem + ".o"],
                cmd = "%s/bin/nvcc %s -I. -c $(location %s) -o $@" % (
                    CUDA_PATH,
                    " ".join(_NVCC_FLAGS),
                    src,
                ),
            )
            objs.append(stem + ".o")
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs if CUDA_FOUND else [],
        deps = (deps + ["@local_cuda//:cudart"]) if CUDA_FOUND else [],
        linkstatic = True,
        visibility = visibility,
    )

def cuda_cc_library(name, srcs = [], hdrs = [], deps = [], visibility = None):
    """A cc_library of host C++ that uses the CUDA runtime or cuBLAS: its
    sources, headers and dependencies only with a toolkit (empty without)."""
    native.cc_library(
        name = name,
        srcs = srcs if CUDA_FOUND else [],
        hdrs = hdrs if CUDA_FOUND else [],
        deps = (deps + ["@local_cuda//:cudart"]) if CUDA_FOUND else [],
        visibility = visibility,
    )
