from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("optimizers")
PLUGIN = Plugin.of_package("optimizers", kernels=KERNELS)
