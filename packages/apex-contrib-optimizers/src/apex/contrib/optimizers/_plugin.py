from apex.core.descriptors import KernelLibrary, Plugin

# The namespace of the ops. Without sources there is nothing to compile or load: the references
# run on every device; the common paths run apex-optimizers' kernels through torch.ops.
KERNELS = KernelLibrary.of_package("contrib.optimizers", sources=())
PLUGIN = Plugin.of_package(
    "contrib.optimizers",
    name="contrib_optimizers",
    provides=(
        "apex.contrib.optimizers",
        "fused_adam_cuda",
        "fused_lamb_cuda",
        "distributed_adam_cuda",
        "distributed_lamb_cuda",
    ),
    requires=("apex-core", "apex-optimizers", "apex-amp"),
)
