from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary(
    name="apex_core",
    package="apex.core",
    sources=("csrc/*.cu", "csrc/*.cpp"),
)

PLUGIN = Plugin(
    name="core",
    distribution="apex-core",
    provides=("apex.core", "apex.multi_tensor_apply"),
    kernel_library=KERNELS,
)
