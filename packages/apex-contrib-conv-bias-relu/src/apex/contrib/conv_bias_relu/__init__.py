"""apex.contrib.conv_bias_relu: convolution + bias (+ ReLU, + mask, + frozen scale), upstream's API.

``ConvBiasReLU``, ``ConvBias``, ``ConvBiasMaskReLU`` and ``ConvFrozenScaleBiasReLU`` (see
:mod:`apex.contrib.conv_bias_relu.conv_bias_relu`). Importing it registers the ops
``torch.ops.apex_contrib_conv_bias_relu.*``. No custom kernel: PyTorch's convolution (cuDNN's on
CUDA) and its element-wise kernels, on every device.
"""

from apex.contrib.conv_bias_relu.conv_bias_relu import ConvBias, ConvBiasMaskReLU, ConvBiasReLU, ConvFrozenScaleBiasReLU

__all__ = ["ConvBias", "ConvBiasMaskReLU", "ConvBiasReLU", "ConvFrozenScaleBiasReLU"]
