from apex.core.descriptors import Plugin

# No ops of its own and nothing to compile: the norm runs on apex-parallel's SyncBatchNorm kernels
# (torch.ops.apex_parallel), which apex-parallel builds and loads.
PLUGIN = Plugin.of_package(
    "contrib.groupbn",
    provides=("apex.contrib.groupbn", "bnp"),
    requires=("apex-core", "apex-parallel"),
)
