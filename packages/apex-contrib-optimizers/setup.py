import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).parent / "src"))

from apex.contrib.optimizers._plugin import KERNELS
from apex.core.build import setup_kernel_package

setup(**setup_kernel_package(KERNELS))
