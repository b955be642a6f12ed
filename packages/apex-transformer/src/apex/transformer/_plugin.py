from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("transformer")
PLUGIN = Plugin.of_package(
    "transformer",
    kernels=KERNELS,
    provides=(
        "apex.transformer",
        "scaled_upper_triang_masked_softmax_cuda",
        "scaled_masked_softmax_cuda",
        "scaled_softmax_cuda",
        "generic_scaled_masked_softmax_cuda",
        "fused_rotary_positional_embedding",
    ),
)
