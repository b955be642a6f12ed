from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("contrib.transducer")
PLUGIN = Plugin.of_package(
    "contrib.transducer",
    kernels=KERNELS,
    provides=("apex.contrib.transducer", "transducer_joint_cuda", "transducer_loss_cuda"),
)
