from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("contrib.transducer")
PLUGIN = Plugin.of_package("contrib.transducer", kernels=KERNELS)
