from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("mlp")
PLUGIN = Plugin.of_package("mlp", kernels=KERNELS, provides=("apex.mlp", "mlp_cuda"))
