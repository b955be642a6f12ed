from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("contrib.index_mul_2d")
PLUGIN = Plugin.of_package(
    "contrib.index_mul_2d", kernels=KERNELS, provides=("apex.contrib.index_mul_2d", "fused_index_mul_2d")
)
