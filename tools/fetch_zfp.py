"""Fetch the zfp 1.0.1 sources (with cuZFP) that ``torchckpt._zfp`` is built from.

No PyPI package ships GPU zfp, but the ``hdf5plugin==7.1.0`` sdist holds the full zfp 1.0.1
source tree (BSD-3-Clause) at ``lib/zfp/``, CUDA kernels included (see DEPS.md, cuZFP). This
tool downloads that sdist with pip, checks its SHA-256, and extracts only ``lib/zfp/include``,
``lib/zfp/src`` and ``lib/zfp/LICENSE`` into ``.deps/zfp-1.0.1/`` (an ignored folder: these
sources are never committed). It is idempotent: a complete extracted tree is reused without
touching the network, so a machine with no internet can build from a carried ``.deps`` folder.

Usage::

    python tools/fetch_zfp.py                      # download if needed, print the folder
    python tools/fetch_zfp.py --sdist hdf5plugin-7.1.0.tar.gz   # offline, from a local sdist
    TORCHCKPT_ZFP_SDIST=/path/to/hdf5plugin-7.1.0.tar.gz python tools/fetch_zfp.py

``zfp_build.py`` (imported by setup.py) calls ``ensure_zfp()`` when ``TORCHCKPT_BUILD_ZFP=1``.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DEST = os.path.join(ROOT, ".deps", "zfp-1.0.1")

SDIST_NAME = "hdf5plugin-7.1.0.tar.gz"
SDIST_REQ = "hdf5plugin==7.1.0"
SDIST_SHA256 = "dc4aa9576bf5770d773be9309a060ccf2f0ce2f0031f2b369f566d2662ec2fb3"
PREFIX = "hdf5plugin-7.1.0/lib/zfp/"
KEEP = ("include/", "src/", "LICENSE")
MANIFEST = "MANIFEST.sha256"

# Files the build needs; a tree missing any of them is fetched again.
REQUIRED = (
    "LICENSE",
    "include/zfp.h",
    "include/zfp/version.h",
    "include/zfp/bitstream.h",
    "include/zfp/bitstream.inl",
    "src/zfp.c",
    "src/bitstream.c",
    "src/encode3f.c",
    "src/decode3d.c",
    "src/template/cudacompress.c",
    "src/cuda_zfp/cuZFP.cu",
    "src/cuda_zfp/cuZFP.h",
    "src/cuda_zfp/encode3.cuh",
    "src/cuda_zfp/decode3.cuh",
)


class FetchError(RuntimeError):
    """The zfp sources could not be obtained or are not what was expected."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def c_sources(dest: str = DEFAULT_DEST) -> list[str]:
    """zfp's C sources to compile (as C): ``src/*.c`` (``src/template/*.c`` are #included)."""
    src = os.path.join(dest, "src")
    return sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".c"))


def verify(dest: str = DEFAULT_DEST) -> str | None:
    """``None`` when ``dest`` holds a complete zfp 1.0.1 tree, else what is wrong."""
    if not os.path.isdir(dest):
        return f"{dest} does not exist"
    missing = [f for f in REQUIRED if not os.path.isfile(os.path.join(dest, f))]
    if missing:
        return f"{dest} lacks {', '.join(missing)}"
    with open(os.path.join(dest, "include", "zfp", "version.h")) as f:
        ver = f.read()
    for part, want in (("MAJOR", "1"), ("MINOR", "0"), ("PATCH", "1")):
        if f"#define ZFP_VERSION_{part} {want}" not in ver:
            return f"{dest}/include/zfp/version.h is not zfp 1.0.1"
    man = os.path.join(dest, MANIFEST)
    if not os.path.isfile(man):
        return f"{dest} has no {MANIFEST} (an interrupted extraction?)"
    with open(man) as f:
        for line in f:
            digest, rel = line.rstrip("\n").split("  ", 1)
            path = os.path.join(dest, rel)
            if not os.path.isfile(path) or _sha256(path) != digest:
                return f"{dest}/{rel} differs from {MANIFEST}"
    return None


def _download(tmp: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary=:all:", "--no-deps",
           "--disable-pip-version-check", "-q", "-d", tmp, SDIST_REQ]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        res = None
        err = str(e)
    else:
        err = res.stderr[-2000:]
    path = os.path.join(tmp, SDIST_NAME)
    if res is None or res.returncode != 0 or not os.path.isfile(path):
        raise FetchError(
            f"torchckpt: could not download the zfp 1.0.1 sources ({SDIST_REQ} sdist from PyPI) with "
            f"`{' '.join(cmd[2:])}`; expected {SDIST_NAME}, found: {err.strip() or 'no file'}. "
            "Fix: on a machine with internet run `python tools/fetch_zfp.py` and copy .deps/zfp-1.0.1 here, "
            "or download the sdist elsewhere and pass it with TORCHCKPT_ZFP_SDIST=/path/to/" + SDIST_NAME + "."
        )
    return path


def _extract(sdist: str, dest: str) -> None:
    digest = _sha256(sdist)
    if digest != SDIST_SHA256:
        raise FetchError(
            f"torchckpt: {sdist} has SHA-256 {digest}, expected {SDIST_SHA256} ({SDIST_REQ}); "
            "the file is corrupt or another release. Fix: delete it and fetch again."
        )
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".zfp-", dir=parent)
    try:
        out = os.path.join(stage, "zfp")
        names: list[str] = []
        with tarfile.open(sdist, "r:gz") as tar:
            for m in tar:
                if not m.name.startswith(PREFIX):
                    continue
                rel = m.name[len(PREFIX):]
                if not rel or not any(rel == k or rel.startswith(k) for k in KEEP):
                    continue
                if m.isdir():
                    continue
                if not m.isfile() or rel.startswith("/") or ".." in rel.split("/"):
                    raise FetchError(f"torchckpt: unexpected member {m.name!r} in {sdist}; refusing to extract it.")
                target = os.path.join(out, rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                src = tar.extractfile(m)
                if src is None:
                    raise FetchError(f"torchckpt: cannot read {m.name!r} from {sdist}.")
                with src, open(target, "wb") as f:
                    shutil.copyfileobj(src, f)
                names.append(rel)
        with open(os.path.join(out, MANIFEST), "w") as f:
            for rel in sorted(names):
                f.write(f"{_sha256(os.path.join(out, rel))}  {rel}\n")
        problem = verify(out)
        if problem is not None:
            raise FetchError(f"torchckpt: {sdist} does not hold the expected zfp 1.0.1 tree: {problem}.")
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        os.replace(out, dest)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def ensure_zfp(dest: str = DEFAULT_DEST, sdist: str | None = None, quiet: bool = False) -> str:
    """Return ``dest`` holding zfp 1.0.1's include/, src/ and LICENSE; fetch them if needed.

    Args:
        dest: the folder to fill (default ``.deps/zfp-1.0.1`` in the repository).
        sdist: a local ``hdf5plugin-7.1.0.tar.gz`` to extract instead of downloading
            (default: ``$TORCHCKPT_ZFP_SDIST`` when set).
        quiet: print nothing.

    Returns:
        ``dest``. A complete tree already there is reused without network access.

    Raises:
        FetchError: the sdist cannot be downloaded (offline) or is not the expected file.
    """
    problem = verify(dest)
    if problem is None:
        return dest
    sdist = sdist or os.environ.get("TORCHCKPT_ZFP_SDIST") or None
    if not quiet:
        print(f"torchckpt: zfp sources not ready ({problem}); "
              + (f"extracting {sdist}" if sdist else f"downloading the {SDIST_REQ} sdist (75 MB)"), flush=True)
    if sdist:
        if not os.path.isfile(sdist):
            raise FetchError(f"torchckpt: TORCHCKPT_ZFP_SDIST / --sdist points at {sdist!r}, which is not a file.")
        _extract(sdist, dest)
    else:
        with tempfile.TemporaryDirectory(prefix="torchckpt-zfp-") as tmp:
            _extract(_download(tmp), dest)
    if not quiet:
        print(f"torchckpt: zfp 1.0.1 sources in {dest}", flush=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=DEFAULT_DEST, help="folder to fill (default: %(default)s)")
    ap.add_argument("--sdist", default=None, help="a local hdf5plugin-7.1.0.tar.gz (no download)")
    args = ap.parse_args(argv)
    try:
        print(ensure_zfp(args.dest, args.sdist))
    except FetchError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
