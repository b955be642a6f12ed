from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("core")
# apex-core depends on no other apex package, and also serves upstream Apex's apex.multi_tensor_apply.
PLUGIN = Plugin.of_package("core", kernels=KERNELS, provides=("apex.core", "apex.multi_tensor_apply"), requires=())
