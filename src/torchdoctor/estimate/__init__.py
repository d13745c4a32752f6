"""VRAM estimates of a training step without a GPU (``torchdoctor estimate``).

The step is traced under fake tensors on the CPU, storage by storage; CUDA's kernel choices and
caching allocator are modelled on top. Importing this package does not import torch.
"""
