from apex.core.descriptors import KernelLibrary, Plugin

# The namespace of the ops. Without sources there is nothing to compile or load: the references
# (cuDNN's convolution and PyTorch's elementwise kernels on CUDA) run on every device.
KERNELS = KernelLibrary.of_package("contrib.conv_bias_relu", sources=())
PLUGIN = Plugin.of_package("contrib.conv_bias_relu", provides=("apex.contrib.conv_bias_relu", "fused_conv_bias_relu"))
