"""Build the stand-in ``libcuda.so.1`` (``libcuda.c`` beside this file) with the system's cc.

``build(directory, checkpoint=True)`` writes ``directory/libcuda.so.1`` and returns the
directory, to put first on ``LD_LIBRARY_PATH`` (``checkpoint=False``: a driver older than
570, without the checkpoint entry points).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("libcuda.c")


def build(directory: Path, *, checkpoint: bool = True) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("a C compiler (cc) is needed to build the stand-in libcuda")
    directory.mkdir(parents=True, exist_ok=True)
    flags = [] if checkpoint else ["-DNO_CHECKPOINT"]
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            *flags,
            "-o",
            str(directory / "libcuda.so.1"),
            str(SOURCE),
        ],
        check=True,
    )
    return directory
