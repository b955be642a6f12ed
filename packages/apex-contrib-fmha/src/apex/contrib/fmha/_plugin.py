from apex.core.descriptors import Plugin

# No dispatcher ops of its own and nothing to compile: the attention is composed of public torch ops
# (torch.nn.attention.varlen.varlen_attn, scaled_dot_product_attention on nested tensors, matmul,
# softmax), whose CUDA kernels torch provides.
PLUGIN = Plugin.of_package("contrib.fmha", provides=("apex.contrib.fmha", "fmhalib"))
