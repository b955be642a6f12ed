from apex.core.descriptors import Plugin

# No ops of its own and nothing to compile: clip_grad_norm_ calls apex-core's multi-tensor ops
# (torch.ops.apex_core), whose CUDA kernels apex-core builds and loads.
PLUGIN = Plugin.of_package("contrib.clip_grad")
