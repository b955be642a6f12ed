from apex.core.descriptors import Plugin

# No ops of its own and nothing to compile: GroupBatchNorm2d runs on apex-parallel's SyncBatchNorm
# kernels (torch.ops.apex_parallel) through apex-parallel's group_sync composition.
PLUGIN = Plugin.of_package(
    "contrib.cudnn_gbn",
    provides=("apex.contrib.cudnn_gbn", "cudnn_gbn_lib"),
    requires=("apex-core", "apex-parallel"),
)
