from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("contrib.focal_loss")
PLUGIN = Plugin.of_package(
    "contrib.focal_loss", kernels=KERNELS, provides=("apex.contrib.focal_loss", "focal_loss_cuda")
)
