"""Build torchstrategies and its one C++ extension, ``torchstrategies._C``.

CPU sources are always built. CUDA sources (csrc/cuda/*.cu and *_binding.cpp) are built only when the
installed torch has CUDA (``torch.version.cuda``) and a CUDA toolkit is found (CUDA_HOME); set
``TORCHSTRATEGIES_CUDA=1`` to require it or ``TORCHSTRATEGIES_CUDA=0`` to skip it. We never gate on
``torch.cuda.is_available()``: a build host may have no GPU.

Compile flags are portable (-O3, no -march): the hot loops carry GCC ``target_clones`` so one binary
runs on any x86-64 and picks AVX2/AVX-512 at load time. ``TORCHSTRATEGIES_NATIVE=1`` adds
``-march=native`` for a build that will only run on this CPU.

On Linux the C++ sources compile with ``-fopenmp``: ``at::parallel_for`` is a header template whose
thread split (ATen/ParallelOpenMP.h) exists only when ``_OPENMP`` is defined, so without the flag every
``at::parallel_for`` in the extension runs on the calling thread. Nothing links an OpenMP runtime of its
own: the ``GOMP_*`` / ``omp_*`` symbols resolve to the libgomp torch already loaded, so the split uses
torch's intra-op pool and follows ``torch.set_num_threads``.

The build says once that it is compiling and about how long it takes, and keeps the compiler's output in
``build/extension-build.log``, shown if it fails (``build_quiet.py``; ``TORCHSTRATEGIES_BUILD_VERBOSE=1``
shows it all). ninja still rebuilds only what changed.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import setup

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
from build_quiet import estimate_minutes, out_of_date, quiet_build  # noqa: E402

LOG = os.path.join("build", "extension-build.log")


def _want_cuda() -> bool:
    flag = os.environ.get("TORCHSTRATEGIES_CUDA")
    has = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if flag == "0":
        return False
    if flag == "1":
        if not has:
            raise RuntimeError(
                "TORCHSTRATEGIES_CUDA=1 but the installed torch has no CUDA "
                f"(torch.version.cuda={torch.version.cuda!r}) or CUDA_HOME is unset "
                f"(CUDA_HOME={cpp_extension.CUDA_HOME!r})"
            )
        return True
    return has


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def extensions() -> list:
    sources = _sources("csrc/*.cpp") + _sources("csrc/core/*.cpp") + _sources("csrc/cpu/*.cpp")
    cxx = ["-O3", "-std=c++20", "-fvisibility=hidden"]
    if sys.platform.startswith("linux"):
        cxx.append("-fopenmp")  # at::parallel_for splits over torch's pool (see the module docstring)
    if os.environ.get("TORCHSTRATEGIES_NATIVE") == "1":
        cxx.append("-march=native")
    define_macros = []
    kwargs = {
        "include_dirs": [os.path.join(ROOT, "csrc")],
        "extra_link_args": ["-lrt"],
    }
    if _want_cuda():
        sources += _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/*_binding.cpp")
        define_macros.append(("TORCHSTRATEGIES_WITH_CUDA", "1"))
        return [
            cpp_extension.CUDAExtension(
                "torchstrategies._C",
                sources,
                define_macros=define_macros,
                extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17"]},
                **kwargs,
            )
        ]
    return [
        cpp_extension.CppExtension(
            "torchstrategies._C",
            sources,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx},
            **kwargs,
        )
    ]


def _wanted_extensions() -> list:
    """``TORCHSTRATEGIES_NO_EXTENSION=1``: the Python package only. The Makefile's editable install uses it,
    because pip's editable build compiles in a temporary directory of its own (setup.cfg's build_temp does not
    reach it), so the ``build_ext --inplace`` after it would compile every file a second time; with the
    switch, that ``build_ext --inplace`` is the one compile, and later ones rebuild only what changed."""
    if os.environ.get("TORCHSTRATEGIES_NO_EXTENSION") == "1":
        return []
    return extensions()


class QuietBuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension (ninja), saying once what it compiles and keeping the compiler's lines in LOG."""

    def build_extension(self, ext) -> None:
        target = self.get_ext_fullpath(ext.name)
        inputs = [os.path.join(ROOT, s) for s in ext.sources] + glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"),
                                                                           recursive=True)
        if not out_of_date(target, inputs):
            return super().build_extension(ext)  # ninja finds nothing to do
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        jobs = int(os.environ.get("MAX_JOBS") or cores)  # what torch's ninja build runs at once
        if os.path.exists(target):
            message = "rebuilding the C++ extension (only the files that changed)"
        else:
            message = (f"compiling the C++ extension (about {estimate_minutes(len(ext.sources), jobs)} minutes: "
                       f"{len(ext.sources)} files on {jobs} cores)")
        with quiet_build(message, os.path.join(ROOT, LOG)):
            super().build_extension(ext)


setup(
    ext_modules=_wanted_extensions(),
    cmdclass={"build_ext": QuietBuildExtension.with_options(use_ninja=True)},
)
