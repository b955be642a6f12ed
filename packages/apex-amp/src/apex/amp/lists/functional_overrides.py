"""What ``amp.init`` does to ``torch.nn.functional``.

``instance_norm`` and ``batch_norm`` are left alone: they take fp16 inputs with fp32 weights.
``normalize`` and ``cosine_similarity`` call ``norm`` (itself on the fp32 list) internally; they
are listed in case that changes.
"""

import torch.nn.functional

MODULE = torch.nn.functional

FP16_FUNCS = [
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_tbc",
    "linear",
]

FP32_FUNCS = [
    # resampling
    "interpolate",
    "grid_sample",
    # pointwise
    "softplus",
    "softmin",
    "log_softmax",
    "softmax",
    "gelu",
    # normalization
    "layer_norm",
    "group_norm",
    "local_response_norm",
    "normalize",
    "cosine_similarity",
    # losses
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "cross_entropy",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
    "multi_margin_loss",
    "nll_loss",
    "binary_cross_entropy_with_logits",
    "smooth_l1_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "ctc_loss",
]

CASTS: list = []
SEQUENCE_CASTS: list = []

_BCE_ADVICE = (
    "\namp cannot run `F.binary_cross_entropy` (or `torch.nn.BCELoss`) on a reduced-precision input: "
    "the probabilities it takes must already be fp32 for the loss to be accurate.\n\n"
    "When a sigmoid comes right before the loss, use\n"
    "    torch.nn.BCEWithLogitsLoss (F.binary_cross_entropy_with_logits)\n"
    "which fuses the two and runs in fp32 under amp. Or call\n"
    "    amp.register_float_function(torch, 'sigmoid')\n"
    "before `amp.init()` (or `amp.initialize()`) so that the sigmoid returns fp32.\n"
    "To run it anyway (in fp32), pass allow_banned=True to `amp.init()`."
)

BANNED_FUNCS = [("binary_cross_entropy", _BCE_ADVICE)]
