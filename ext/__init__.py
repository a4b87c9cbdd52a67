"""The project's only door to custom kernels: `ext.ops` dispatches each op to the CUDA extension when it
is built and the tensors are on CUDA, else to the pure-PyTorch reference in `ext.reference`."""
