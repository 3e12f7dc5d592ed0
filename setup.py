"""Build and install torchckpt.

``pip install -e .`` installs the pure-Python package anywhere (no GPU, no toolkit needed).
``pip install --no-build-isolation -e .`` in an environment that has torch also builds the
native extension ``torchckpt._C`` from csrc/ (C++ always; .cu files only when a CUDA toolkit
is found). ``TORCHCKPT_USE_CPP=0`` skips it. The build never asks torch.cuda.is_available().
"""
from __future__ import annotations

import glob
import os

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


# ---- BEGIN ZFP (issue 5) --------------------------------------------------------------------
# With TORCHCKPT_BUILD_ZFP=1 (and only then) build the SEPARATE extension torchckpt._zfp from
# zfp 1.0.1's sources, fetched at build time into .deps/zfp-1.0.1 by tools/fetch_zfp.py (never
# committed), plus our glue csrc/zfp/zfp_ops.cpp. torchckpt._C above is left as it is (it globs
# csrc/*.cpp, not csrc/zfp/). zfp's .c files are compiled as C by a plain C compiler before the
# extension (torch's compile wrapper would add C++ flags); cuZFP.cu goes through nvcc when a
# CUDA toolkit is found, with -DZFP_WITH_CUDA so that zfp_exec_cuda exists.
#   TORCHCKPT_BUILD_ZFP=1 pip install --no-build-isolation -e .
def _zfp_extension(ext_modules, cmdclass):
    import importlib.util
    from concurrent.futures import ThreadPoolExecutor

    _find_cuda_home()  # before torch's cpp_extension reads CUDA_HOME at import
    try:
        from torch.utils import cpp_extension
    except ImportError:
        raise SystemExit("torchckpt: TORCHCKPT_BUILD_ZFP=1 needs torch at build time; "
                         "use `TORCHCKPT_BUILD_ZFP=1 pip install --no-build-isolation -e .`.")
    spec = importlib.util.spec_from_file_location("_torchckpt_fetch_zfp", os.path.join(ROOT, "tools", "fetch_zfp.py"))
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    try:
        zdir = fetch.ensure_zfp()
    except fetch.FetchError as e:
        raise SystemExit(str(e))
    rel = os.path.relpath(zdir, ROOT)
    inc = [os.path.join(ROOT, rel, "include")]
    c_files = [os.path.relpath(p, ROOT) for p in fetch.c_sources(zdir)]
    cuda = _has_cuda_headers(cpp_extension.CUDA_HOME)
    c_macros = [("ZFP_WITH_CUDA", None)] if cuda else []
    glue = [os.path.join("csrc", "zfp", "zfp_ops.cpp")]
    cxx = ["-O3", "-std=c++17"] + (["-DTORCHCKPT_ZFP_CUDA", "-DZFP_WITH_CUDA"] if cuda else [])
    if cuda:
        nvcc = ["-O3", "-DZFP_WITH_CUDA", "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_80,code=sm_80"]
        ext = cpp_extension.CUDAExtension(
            "torchckpt._zfp", glue + [os.path.join(rel, "src", "cuda_zfp", "cuZFP.cu")],
            include_dirs=inc, extra_compile_args={"cxx": cxx, "nvcc": nvcc})
    else:
        print("torchckpt: no CUDA toolkit with headers found; torchckpt._zfp gets the CPU (serial zfp) path only")
        ext = cpp_extension.CppExtension("torchckpt._zfp", glue, include_dirs=inc, extra_compile_args={"cxx": cxx})
    base = cmdclass.get("build_ext") or cpp_extension.BuildExtension.with_options(use_ninja=False)

    class BuildWithZfp(base):  # type: ignore[misc, valid-type]
        """Compiles zfp's C sources as C (own compiler, in parallel) before linking torchckpt._zfp."""

        def build_extension(self, e):
            if e.name == "torchckpt._zfp":
                from setuptools._distutils.ccompiler import new_compiler
                from setuptools._distutils.sysconfig import customize_compiler

                out = os.path.join(self.build_temp, "zfp_c")

                def one(src):
                    cc = new_compiler()
                    customize_compiler(cc)
                    return cc.compile([src], output_dir=out, macros=c_macros, include_dirs=inc,
                                      extra_postargs=["-O3", "-std=gnu11", "-fPIC"])[0]

                with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
                    e.extra_objects = list(pool.map(one, c_files))
            super().build_extension(e)

    return ext_modules + [ext], dict(cmdclass, build_ext=BuildWithZfp)


if os.environ.get("TORCHCKPT_BUILD_ZFP", "0") == "1":
    ext_modules, cmdclass = _zfp_extension(ext_modules, cmdclass)
# ---- END ZFP --------------------------------------------------------------------------------

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
