"""Build of the native CPU backend (ktflow._native). Everything else is in pyproject.toml.

Each translation unit is compiled on its own, in parallel; the ISA kernels get the flags listed in
native/isa_flags.txt and nothing else does. No torch is needed to build it."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
NATIVE = HERE / "native"
COMMON = ["-std=c++17", "-O3", "-fvisibility=hidden", "-fno-math-errno", "-Wall", "-Wno-unused-function", "-Wno-maybe-uninitialized"]


def isa_flags() -> dict[str, list[str]]:
    out = {}
    for line in (NATIVE / "isa_flags.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, flags = line.split(":", 1)
            out[name.strip()] = flags.split()
    return out


class ParallelBuildExt(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        flags = isa_flags()
        includes = [str(NATIVE / "include"), pybind11.get_include()]
        self.compiler.compiler_so = [a for a in self.compiler.compiler_so if a not in ("-g", "-O2")]

        def compile_one(src: str) -> list[str]:
            extra = COMMON + flags.get(Path(src).name, [])
            return self.compiler.compile([src], output_dir=self.build_temp, include_dirs=includes,
                                         extra_postargs=extra)

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
