from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("contrib.index_mul_2d")
PLUGIN = Plugin.of_package("contrib.index_mul_2d", kernels=KERNELS)
