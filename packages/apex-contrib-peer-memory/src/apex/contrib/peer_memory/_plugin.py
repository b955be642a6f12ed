from apex.core.descriptors import Plugin

# No ops and nothing to compile: halos travel through apex-contrib-nccl-p2p's torch.distributed exchange.
PLUGIN = Plugin.of_package(
    "contrib.peer_memory",
    provides=("apex.contrib.peer_memory", "peer_memory_cuda"),
    requires=("apex-core", "apex-contrib-nccl-p2p"),
)
