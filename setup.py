"""Build and install torchckpt.

``pip install -e .`` installs the pure-Python package anywhere (no GPU, no toolkit needed).
``pip install --no-build-isolation -e .`` in an environment that has torch also builds the
native extension ``torchckpt._C`` from csrc/ (C++ always; .cu files only when a CUDA toolkit
is found). ``TORCHCKPT_USE_CPP=0`` skips it. The build never asks torch.cuda.is_available().
"""
from __future__ import annotations

import glob
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _find_cuda_home() -> None:
    """Point torch's build helpers at a CUDA toolkit that has headers.

    torch guesses CUDA_HOME from ``which nvcc``; where nvcc is a wrapper script in
    /usr/local/bin that guess (/usr/local) has no include/cuda_runtime.h. Prefer an explicit
    CUDA_HOME / CUDA_PATH, then /usr/local/cuda.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return
    for cand in ("/usr/local/cuda",):
        if os.path.exists(os.path.join(cand, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = cand
            return


def _has_cuda_headers(home: str | None) -> bool:
    return home is not None and os.path.exists(os.path.join(home, "include", "cuda_runtime.h"))


def _extensions():
    if os.environ.get("TORCHCKPT_USE_CPP", "1") == "0":
        print("torchckpt: TORCHCKPT_USE_CPP=0, building the pure-Python package only")
        return [], {}
    _find_cuda_home()
    try:
        from torch.utils import cpp_extension
    except ImportError:
        print("torchckpt: torch is not importable at build time (build isolation?); pure-Python package only. "
              "Use `pip install --no-build-isolation -e .` to build the native extension.")
        return [], {}
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cu = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    if not sources and not cu:
        return [], {}
    args = {"cxx": ["-O3", "-std=c++17"]}
    if _has_cuda_headers(cpp_extension.CUDA_HOME):
        # C++ sources use the CUDA runtime (cudaHostRegister, the driver entry points for VMM)
        # behind TORCHCKPT_WITH_CUDA; the module still loads on a machine with no GPU.
        args["cxx"].append("-DTORCHCKPT_WITH_CUDA")
        args["nvcc"] = ["-O3", "-DTORCHCKPT_WITH_CUDA",
                        "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_80,code=sm_80"]
        ext = cpp_extension.CUDAExtension("torchckpt._C", sources + cu, extra_compile_args=args)
    else:
        print("torchckpt: no CUDA toolkit with headers found; building the C++ part of the extension only "
              "(no pinned host pool registration, no VMM device cache)")
        ext = cpp_extension.CppExtension("torchckpt._C", sources, extra_compile_args={"cxx": args["cxx"]})
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=False)}


ext_modules, cmdclass = _extensions()


if os.environ.get("TORCHCKPT_BUILD_ZFP", "0") == "1":  # the optional torchckpt._zfp: tools/zfp_build.py
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import zfp_build

    ext_modules, cmdclass = zfp_build.zfp_extension(ext_modules, cmdclass, _find_cuda_home, _has_cuda_headers)


setup(
    name="torchckpt",
    version="0.1.0",
    description="Activation and adjoint checkpointing for PyTorch: recompute, or offload to a GPU cache "
    "backed by pinned host memory with exact prefetch.",
    long_description=open(os.path.join(ROOT, "README.md")).read() if os.path.exists(os.path.join(ROOT, "README.md")) else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torchckpt", "torchckpt.*"]),
    python_requires=">=3.11",
    install_requires=["torch>=2.11"],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6", "numpy", "mypy>=1.10", "checkpoint-schedules==1.0.4",
                 "nvidia-libnvcomp-cu13==6.0.0.12"],
        "nvcomp": ["nvidia-libnvcomp-cu13==6.0.0.12"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["torchckpt=torchckpt.__main__:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    license="BSD-3-Clause",
)
