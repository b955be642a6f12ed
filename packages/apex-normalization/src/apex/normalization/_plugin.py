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
    requires=("apex-core",),
)
