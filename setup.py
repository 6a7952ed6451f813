"""The wheel carries what an installed kdev reads (kdev/project.py): the kernel sources and their header, configs/, the
committed golden vectors and benchmarks/, copied into the package as kdev/_project when it is built. An editable
install reads them from the checkout instead."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
SHIPPED = ("kernels", "configs", "vectors", "benchmarks")  # folders of the checkout an installed kdev reads
SKIP = ("*.pyc", "__pycache__", ".*", "NOTES.md")


class BuildWithProject(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        dest = Path(self.build_lib) / "kdev" / "_project"
        shutil.rmtree(dest, ignore_errors=True)
        for name in SHIPPED:
            shutil.copytree(HERE / name, dest / name, ignore=shutil.ignore_patterns(*SKIP))


setup(cmdclass={"build_py": BuildWithProject})
