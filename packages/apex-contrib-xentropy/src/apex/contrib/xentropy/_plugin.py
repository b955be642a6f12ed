from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("contrib.xentropy")
PLUGIN = Plugin.of_package("contrib.xentropy", kernels=KERNELS, provides=("apex.contrib.xentropy", "xentropy_cuda"))
