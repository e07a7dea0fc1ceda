"""The old import path of the kernelspec manager, kept for sites' configurations.

``c.ServerApp.kernel_spec_manager_class = "provisioner.kernel.specs.GPULeaseKernelSpecManager"``
keeps working; the manager lives in :mod:`provisioner.kernel.offered` (which kernels a
user's launcher offers), beside :mod:`provisioner.kernel.kernelspecs` (publishing them).
"""

from .offered import *  # noqa: F403
from .offered import __all__  # noqa: F401
