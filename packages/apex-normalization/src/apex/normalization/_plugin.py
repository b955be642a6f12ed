from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("normalization")
PLUGIN = Plugin.of_package("normalization", kernels=KERNELS, provides=("apex.normalization", "fused_layer_norm_cuda"))
