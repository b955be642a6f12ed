from apex.core.descriptors import Plugin

PLUGIN = Plugin.of_package("amp", provides=("apex.amp", "apex.fp16_utils"))
