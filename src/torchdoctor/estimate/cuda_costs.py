"""Memory a CUDA training process uses outside the tensors it allocates.

These constants are documented values, not measured by torchdoctor yet: the GPU comparison in
``benchmarks/estimate_cuda_check.py`` prints what a real GPU shows so they can be calibrated.

- cuBLAS workspace: PyTorch allocates one per (handle, stream) through the caching allocator on
  the first matmul, so it counts in ``torch.cuda.memory_allocated``. The default
  ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:2:16:8`` (2 x 4 MiB + 8 x 16 KiB = 8,519,680 B) before
  Hopper and 32 MiB on sm90 and newer.
- cuBLASLt: recent PyTorch hands cuBLASLt the cuBLAS workspace, so it adds nothing here.
- cuDNN: convolution workspaces are transient and depend on the algorithm cuDNN picks; they are
  not modelled per call. Loading cuDNN's kernels costs device memory outside the allocator,
  counted below with the context.
- CUDA context: the driver's per-process state and the loaded kernels; with lazy module loading
  (CUDA >= 11.7, the default in PyTorch wheels) it is typically 250-500 MB per GPU. nvidia-smi
  counts it, PyTorch's allocator does not.
"""

from __future__ import annotations

from torchdoctor.estimate.profiles import GpuProfile, MiB

CUBLAS_WORKSPACE_BYTES = 2 * 4096 * 1024 + 8 * 16 * 1024
CUBLAS_WORKSPACE_BYTES_SM90 = 32 * MiB
CUBLASLT_EXTRA_WORKSPACE_BYTES = 0

CUDA_CONTEXT_BYTES = 400 * MiB
CUDNN_LIBRARY_BYTES = 100 * MiB


def cublas_workspace_bytes(gpu: GpuProfile) -> int:
    """The cuBLAS workspace PyTorch allocates for the first matmul on ``gpu``."""
    base = CUBLAS_WORKSPACE_BYTES_SM90 if gpu.is_hopper_or_newer else CUBLAS_WORKSPACE_BYTES
    return base + CUBLASLT_EXTRA_WORKSPACE_BYTES


def context_bytes(uses_cudnn: bool) -> int:
    """Device memory of the CUDA context (and cuDNN's kernels when the step uses cuDNN)."""
    return CUDA_CONTEXT_BYTES + (CUDNN_LIBRARY_BYTES if uses_cudnn else 0)
