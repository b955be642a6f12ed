from apex.core.descriptors import Plugin

# No ops of its own and nothing to compile: FastLayerNorm and the legacy fast_layer_norm module call
# apex-normalization's layer norm ops (torch.ops.apex_normalization), whose kernels that package builds.
PLUGIN = Plugin.of_package(
    "contrib.layer_norm",
    provides=("apex.contrib.layer_norm", "fast_layer_norm"),
    requires=("apex-core", "apex-normalization"),
)
