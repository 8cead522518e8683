"""Triton kernels of fusedrl, installed as `fusedrl.kernels` (DESIGN section 5).

The fused kernels are not in this build yet: `fusedrl.policy_loss(..., backend="triton")` raises
NotImplementedError and `backend="auto"` runs the chunked torch backend on every device.
"""
