from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary(
    name="apex_normalization",
    package="apex.normalization",
    sources=("csrc/*.cu", "csrc/*.cpp"),
)

PLUGIN = Plugin(
    name="normalization",
    distribution="apex-normalization",
    provides=("apex.normalization",),
    kernel_library=KERNELS,
    ops_module="apex.normalization._ops",
    requires=("apex-core",),
)
