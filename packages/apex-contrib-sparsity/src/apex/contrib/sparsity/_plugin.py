from apex.core.descriptors import KernelLibrary, Plugin

# The namespace of the ops. Without sources there is nothing to compile or load: the references
# run on every device.
KERNELS = KernelLibrary.of_package("contrib.sparsity", sources=())
PLUGIN = Plugin.of_package("contrib.sparsity", provides=("apex.contrib.sparsity", "permutation_search_cuda"))
