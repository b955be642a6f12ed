import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).parent / "src"))

from apex.core.build import setup_kernel_package
from apex.contrib.transducer._plugin import KERNELS

setup(**setup_kernel_package(KERNELS))
