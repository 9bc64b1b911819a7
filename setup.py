"""Builds the private extension torch_mp_ext._C (pybind11, no torch or CUDA headers)."""

import re
from glob import glob
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("TMX_BUILD_JOBS", default=2).install()

_version = re.search(
    r'__version__ = "([^"]+)"', Path("torch_mp_ext/_version.py").read_text()
).group(1)

ext_modules = [
    Pybind11Extension(
        "torch_mp_ext._C",
        sorted(glob("csrc/**/*.cpp", recursive=True)),  # sorted: reproducible builds
        include_dirs=["csrc"],
        define_macros=[("VERSION_INFO", f'"{_version}"')],
        cxx_std=17,
        # Note [Platform floor] (csrc/platform/compat.h): no glibc symbol newer than 2.28.
        extra_compile_args=["-O2", "-Wall", "-Wextra", "-pthread",
                            "-include", "csrc/platform/glibc_floor.h"],
        extra_link_args=["-pthread"],
        libraries=["rt", "dl", "pthread"],
    )
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
