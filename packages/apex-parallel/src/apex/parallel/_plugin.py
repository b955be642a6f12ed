from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary(
    name="apex_parallel",
    package="apex.parallel",
    sources=("csrc/*.cu", "csrc/*.cpp"),
)

PLUGIN = Plugin(
    name="parallel",
    distribution="apex-parallel",
    provides=("apex.parallel",),
    kernel_library=KERNELS,
    requires=("apex-core",),
)
