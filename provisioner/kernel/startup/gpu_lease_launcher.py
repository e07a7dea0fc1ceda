"""Start a Python kernel so that GPU memory caps apply when a framework is imported.

Run as a script, in place of ``python -m MODULE ARGS``::

    python [python options] gpu_lease_launcher.py -m ipykernel_launcher -f CONN --ext=gpu_lease_magic

The kernel provisioner rewrites the kernelspec's argv this way (``provisioner.kernel.env
.kernel_argv``). This file runs *inside* the kernel's Python, which may be another
environment than the server's: it imports nothing from the ``provisioner`` package and
nothing heavy (start-up cost is one small file). What it does:

1. ``sys.path``: Python put this file's folder first; it is replaced by what ``python -m``
   would have put there (the working directory, unless ``-P``/``PYTHONSAFEPATH``), so
   nothing in this folder can shadow a user's module. Our own modules
   (``gpu_lease_caps``, ``gpu_lease_magic``) are served by name by a ``sys.meta_path``
   finder, and only those names.
2. A post-import hook: the same finder wraps the loader of the top-level modules
   ``tensorflow``, ``torch``, ``jax`` and ``cupy``; once one has been executed,
   ``gpu_lease_caps.apply(name, module)`` applies the cap (once; never raising).
3. ``runpy.run_module(MODULE, run_name="__main__", alter_sys=True)`` with ``sys.argv``
   set to ``[MODULE's file, *ARGS]``.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_OWN_MODULES = ("gpu_lease_caps", "gpu_lease_magic")
_FRAMEWORKS = ("tensorflow", "torch", "jax", "cupy")


class _CapLoader:
    """Wraps a framework's loader: executes the module, then applies the cap."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def __getattr__(self, attr):
        return getattr(self._loader, attr)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # put the real loader back first: importlib.resources, pkgutil and
        # friends see the framework's own loader, never this wrapper
        module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None:
            spec.loader = self._loader
        self._loader.exec_module(module)
        try:
            import gpu_lease_caps

            gpu_lease_caps.apply(self._name, module)
        except Exception as exc:  # never break the user's import
            sys.stderr.write(f"gpu-lease: could not apply the {self._name} GPU memory cap: {exc}\n")


class GPULeaseFinder:
    """Serves ``gpu_lease_*`` modules from this folder and hooks framework imports."""

    def __init__(self):
        self._busy = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _OWN_MODULES:
            import importlib.util

            return importlib.util.spec_from_file_location(
                fullname, os.path.join(_HERE, fullname + ".py")
            )
        if fullname not in _FRAMEWORKS or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _CapLoader(spec.loader, fullname)
        return spec


def _fix_sys_path():
    """Replace this folder (put first by Python) with what ``python -m`` puts first."""
    here = os.path.normcase(os.path.realpath(_HERE))
    sys.path[:] = [
        p for p in sys.path if os.path.normcase(os.path.realpath(p or os.curdir)) != here
    ]
    if not getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, os.getcwd())


def install():
    """Install the finder (once) first in ``sys.meta_path``."""
    for finder in sys.meta_path:
        if isinstance(finder, GPULeaseFinder) or type(finder).__name__ == "GPULeaseFinder":
            return finder
    finder = GPULeaseFinder()
    sys.meta_path.insert(0, finder)
    return finder


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 2 and args[0] == "-m":
        module, rest = args[1], args[2:]
    elif args and args[0].startswith("-m") and len(args[0]) > 2:
        module, rest = args[0][2:], args[1:]
    else:
        sys.stderr.write("usage: gpu_lease_launcher.py -m MODULE [ARGS...]\n")
        return 2
    _fix_sys_path()
    install()
    import runpy

    sys.argv[:] = [sys.argv[0], *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
