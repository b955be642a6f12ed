from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary.of_package("core")
# apex-core depends on no other apex package, and also serves upstream Apex's apex.multi_tensor_apply
# and its top-level amp_C and apex_C modules.
PLUGIN = Plugin.of_package(
    "core", kernels=KERNELS, provides=("apex.core", "amp_C", "apex_C", "apex.multi_tensor_apply"), requires=()
)
