from apex.core.descriptors import KernelLibrary, Plugin

# The namespace of the ops. Without sources there is nothing to compile or load: the references
# run on every device. A kernel package keeps the default csrc/ sources and passes kernels=KERNELS.
KERNELS = KernelLibrary.of_package("contrib.gpu_direct_storage", sources=())
PLUGIN = Plugin.of_package("contrib.gpu_direct_storage")
