from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("contrib.group_norm")
PLUGIN = Plugin.of_package(
    "contrib.group_norm",
    kernels=KERNELS,
    provides=("apex.contrib.group_norm", "group_norm_cuda", "group_norm_v2_cuda"),
)
