from apex.core.descriptors import Plugin

# No ops and nothing to compile: the allocator is PyTorch's own (ProcessGroupNCCL's ncclMemAlloc-backed
# mem_allocator), used through torch.cuda.MemPool. Upstream's extension module is src/_apex_nccl_allocator.py.
PLUGIN = Plugin.of_package("contrib.nccl_allocator", provides=("apex.contrib.nccl_allocator", "_apex_nccl_allocator"))
