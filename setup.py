"""Build and install dapo_kernels (+ dapo_trainer, npu_ops).

The C++ extension ``dapo_kernels._C`` is plain C++17 bound with pybind11; it does
not link against libtorch, so it builds on any machine with a C++ compiler. CUDA
sources (none so far) would be added only when both a CUDA toolkit and a CUDA build
of torch are present, so a CPU-only machine always builds.
"""
import glob
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

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


def _read_requirements(name):
    with open(os.path.join(HERE, name)) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]


setup(
    name="dapo-kernels",
    version="0.1.0",
    description="Kernels and a compact reference trainer for DAPO / GRPO RL training of LLMs",
    packages=find_packages(include=["dapo_kernels*", "dapo_trainer*", "npu_ops*"]),
    python_requires=">=3.10",
    install_requires=_read_requirements("requirements.txt"),
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    entry_points={
        "console_scripts": ["dapo-report=dapo_trainer.report:main"],
        # Out-of-tree device backends, loaded by dapo_kernels on the first privateuseone tensor
        # (the way torch loads its own out-of-tree devices); npu_ops is the Ascend one.
        "dapo_kernels.backends": ["npu = npu_ops:register"],
    },
    zip_safe=False,
)
