"""O1's cast lists, one module per patched namespace, with upstream Apex's module and list names.

Each module names its namespace (``MODULE``) and lists function names by what ``amp.init`` does
to them:

* ``FP16_FUNCS``: run in reduced precision (fp16, or bf16 when asked); floating inputs are cast down
  and fp32 parameters' copies are cached for the iteration.
* ``FP32_FUNCS``: run in fp32; fp16/bf16 inputs are cast up. Their in-place forms (``exp_``, ...)
  refuse reduced-precision tensors.
* ``CASTS``: when floating inputs of different dtypes meet, all are cast to the widest.
* ``SEQUENCE_CASTS``: the same over the tensors of the first (sequence) argument.
* ``BANNED_FUNCS`` (functional only): ``(name, advice)``; they raise on reduced-precision inputs
  unless ``amp.init(allow_banned=True)``, which runs them in fp32 instead.

The lists are plain Python lists: changing them before ``amp.init`` changes what it patches.
Names absent from this torch version are skipped. ``RNN_FUNCS`` and ``RNN_CELL_FUNCS`` are the
``torch._VF`` recurrent kernels that ``torch.nn``'s RNN modules call; they run in reduced precision.
"""

RNN_FUNCS = ["rnn_relu", "rnn_tanh", "gru", "lstm"]
RNN_CELL_FUNCS = [name + "_cell" for name in RNN_FUNCS]
