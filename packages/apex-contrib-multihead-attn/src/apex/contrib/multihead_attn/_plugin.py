from apex.core.descriptors import Plugin

# No dispatcher ops of its own and nothing to compile: the attention is composed of public torch ops
# (linear, scaled_dot_product_attention, softmax, dropout), whose CUDA kernels torch provides.
PLUGIN = Plugin.of_package("contrib.multihead_attn", provides=("apex.contrib.multihead_attn", "fast_multihead_attn"))
