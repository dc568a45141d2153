"""Backends for the matrix products the orthogonalizers are made of.

Today every device uses the torch backend (``torch.bmm``/``torch.baddbmm``). Faster backends
(symmetric GPU kernels) plug in here and are chosen at runtime, always with this torch fallback.
"""

from orthoptim.kernels.torch_backend import gram, symmetric_polynomial

__all__ = ["gram", "symmetric_polynomial"]
