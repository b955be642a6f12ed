from apex.core.descriptors import Plugin

# No ops and nothing to compile: the GPUDirect Storage paths are PyTorch's torch.cuda.gds (cuFile), the
# others plain file I/O. Upstream's extension module is src/_apex_gpu_direct_storage.py.
PLUGIN = Plugin.of_package(
    "contrib.gpu_direct_storage", provides=("apex.contrib.gpu_direct_storage", "_apex_gpu_direct_storage")
)
