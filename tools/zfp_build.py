"""The build of the optional extension ``torchckpt._zfp``; setup.py imports this with ``TORCHCKPT_BUILD_ZFP=1``.

``torchckpt._zfp`` is built from zfp 1.0.1's sources, fetched at build time into
``.deps/zfp-1.0.1`` by ``fetch_zfp.py`` (never committed), plus our glue
``csrc/zfp/zfp_ops.cpp``. ``torchckpt._C`` is left as it is (it globs csrc/*.cpp, not
csrc/zfp/). zfp's .c files are compiled as C by a plain C compiler before the extension (torch's
compile wrapper would add C++ flags); cuZFP.cu goes through nvcc when a CUDA toolkit is found,
with ``-DZFP_WITH_CUDA`` so that ``zfp_exec_cuda`` exists::

    TORCHCKPT_BUILD_ZFP=1 pip install --no-build-isolation -e .
"""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def zfp_extension(ext_modules, cmdclass, find_cuda_home, has_cuda_headers):
    """Add the extension ``torchckpt._zfp`` (and the build step that compiles zfp's C sources) to a build."""
    from concurrent.futures import ThreadPoolExecutor

    import fetch_zfp as fetch

    find_cuda_home()  # before torch's cpp_extension reads CUDA_HOME at import
    try:
        from torch.utils import cpp_extension
    except ImportError:
        raise SystemExit("torchckpt: TORCHCKPT_BUILD_ZFP=1 needs torch at build time; "
                         "use `TORCHCKPT_BUILD_ZFP=1 pip install --no-build-isolation -e .`.")
    try:
        zdir = fetch.ensure_zfp()
    except fetch.FetchError as e:
        raise SystemExit(str(e))
    rel = os.path.relpath(zdir, ROOT)
    inc = [os.path.join(ROOT, rel, "include")]
    c_files = [os.path.relpath(p, ROOT) for p in fetch.c_sources(zdir)]
    cuda = has_cuda_headers(cpp_extension.CUDA_HOME)
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
