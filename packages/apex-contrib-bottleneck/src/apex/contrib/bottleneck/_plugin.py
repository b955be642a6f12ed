from apex.core.descriptors import Plugin

# No ops of its own and nothing to compile: the block runs on apex-contrib-conv-bias-relu's ops and
# PyTorch convolutions; halos travel through apex-contrib-nccl-p2p / apex-contrib-peer-memory.
PLUGIN = Plugin.of_package(
    "contrib.bottleneck",
    provides=("apex.contrib.bottleneck", "fast_bottleneck"),
    requires=("apex-core", "apex-contrib-conv-bias-relu", "apex-contrib-nccl-p2p", "apex-contrib-peer-memory"),
)
