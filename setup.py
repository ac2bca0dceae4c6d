"""The C++ extension of dapo_kernels (+ dapo_trainer, npu_ops; metadata in pyproject.toml).

The C++ extension ``dapo_kernels._C`` is plain C++17 bound with pybind11; it does
not link against libtorch, so it builds on any machine with a C++ compiler. CUDA
sources (none so far) would be added only when both a CUDA toolkit and a CUDA build
of torch are present, so a CPU-only machine always builds.
"""
import glob
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup


cxx_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))

ext_modules = [
    Pybind11Extension(
        "dapo_kernels._C",
        cxx_sources,
        cxx_std=17,
        extra_compile_args=["-O3"],
        include_dirs=["csrc"],
    )
]


# Metadata, dependencies and entry points are in pyproject.toml's [project] table.
setup(
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
