"""jupyter-gpu-lease: fractional GPU leases for Jupyter kernels."""

from ._version import __version__

__all__ = ["__version__"]
