"""apex_transformer's dispatcher ops (``torch.ops.apex_transformer.*``): importing this module
registers them all. The softmax family is defined in ``_softmax_ops.py``, the rotary embeddings in
``_rope_ops.py``, SwiGLU in ``_swiglu_ops.py`` (schemas, checks, references, fakes and autograd,
through ``apex.core.library``); their CUDA kernels are in ``csrc/``."""

from apex.transformer import _rope_ops, _softmax_ops, _swiglu_ops  # noqa: F401  (registers the ops)
