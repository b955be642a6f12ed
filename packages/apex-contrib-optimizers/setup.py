import importlib.util
from pathlib import Path

from setuptools import setup

from apex.core.build import setup_kernel_package

# _plugin.py by its path: importing it as apex.contrib.optimizers._plugin would run the package's
# __init__, which needs apex-amp and apex-optimizers, not present in every build environment.
_path = Path(__file__).parent / "src" / "apex" / "contrib" / "optimizers" / "_plugin.py"
_spec = importlib.util.spec_from_file_location("_apex_contrib_optimizers_plugin", _path)
_plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_plugin)
KERNELS = _plugin.KERNELS

setup(**setup_kernel_package(KERNELS))
