from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("fused_dense")
PLUGIN = Plugin.of_package(
    "fused_dense",
    kernels=KERNELS,
    provides=("apex.fused_dense", "fused_dense_cuda", "fused_weight_gradient_mlp_cuda"),
)
