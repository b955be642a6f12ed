from apex.core.descriptors import Plugin

PLUGIN = Plugin(
    name="amp",
    distribution="apex-amp",
    provides=("apex.amp", "apex.fp16_utils"),
    kernel_library=None,
    requires=("apex-core",),
)
