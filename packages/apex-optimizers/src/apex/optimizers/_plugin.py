from apex.core.descriptors import KernelLibrary, Plugin

KERNELS = KernelLibrary(
    name="apex_optimizers",
    package="apex.optimizers",
    sources=("csrc/*.cu", "csrc/*.cpp"),
)

PLUGIN = Plugin(
    name="optimizers",
    distribution="apex-optimizers",
    provides=("apex.optimizers",),
    kernel_library=KERNELS,
    requires=("apex-core",),
)
