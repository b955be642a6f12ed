from apex.core.descriptors import KernelLibrary, Plugin

# The ops of this package (namespace apex_contrib_optimizers) have CUDA kernels in csrc/; the
# common fp32 paths also run apex-optimizers' kernels through torch.ops.
KERNELS = KernelLibrary.of_package("contrib.optimizers")
PLUGIN = Plugin.of_package(
    "contrib.optimizers",
    name="contrib_optimizers",
    kernels=KERNELS,
    provides=(
        "apex.contrib.optimizers",
        "fused_adam_cuda",
        "fused_lamb_cuda",
        "distributed_adam_cuda",
        "distributed_lamb_cuda",
    ),
    requires=("apex-core", "apex-optimizers", "apex-amp"),
)
