"""Build of the native CPU backend (ktflow._native). Everything else is in pyproject.toml.

Each translation unit is compiled on its own, in parallel, all with the baseline x86-64 flags (the
ISA kernels name their instructions in a pragma of their own: native/src/kernels_avx512.cpp says
why). No torch is needed to build it."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
NATIVE = HERE / "native"
COMMON = ["-std=c++17", "-O3", "-fvisibility=hidden", "-fno-math-errno", "-Wall", "-Wno-unused-function", "-Wno-maybe-uninitialized"]


class ParallelBuildExt(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        includes = [str(NATIVE / "include"), pybind11.get_include()]
        self.compiler.compiler_so = [a for a in self.compiler.compiler_so if a not in ("-g", "-O2")]

        def compile_one(src: str) -> list[str]:
            return self.compiler.compile([src], output_dir=self.build_temp, include_dirs=includes,
                                         extra_postargs=COMMON)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            objects = [o for objs in pool.map(compile_one, ext.sources) for o in objs]
        ext.extra_objects = objects
        # the link step's up-to-date check looks at sources + depends: keep the sources in it
        ext.depends = list(ext.depends) + list(ext.sources)
        ext.sources = []
        super().build_extension(ext)


setup(
    ext_modules=[Extension("ktflow._native", sorted(str(p.relative_to(HERE)) for p in (NATIVE / "src").glob("*.cpp")),
                           depends=sorted(str(p.relative_to(HERE)) for p in (NATIVE / "include").rglob("*.h")),
                           language="c++", extra_link_args=["-pthread", "-ldl"])],
    cmdclass={"build_ext": ParallelBuildExt},
)
