from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("parallel")
PLUGIN = Plugin.of_package("parallel", kernels=KERNELS, provides=("apex.parallel", "syncbn"))
