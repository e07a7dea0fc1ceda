"""One user's Jupyter server side, for ``tests/test_mps_users.py``: run as that user.

Starts the kernel of ``argv[1]`` (a GPU kernelspec with ``enforcement=mps``) through the
GPU lease provisioner, as a Jupyter server would (the environment holds the broker's URL
and this user's token), prints ``LEASED``, runs a CUDA allocation in the kernel (the
stand-in CuPy: it connects to the GPU's MPS daemon, as real CUDA does), prints
``ON-MPS uid=<uid>``, then waits for a line on stdin and shuts the kernel down
(``DONE``). The provisioner's log (INFO) goes to stderr, with the queue's reasons.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from jupyter_client.manager import AsyncKernelManager

from provisioner.devtools.testing import execute

CODE = "import os, cupy; x = cupy.empty(1 << 20); print('ON-MPS uid=%d' % os.getuid())"


async def main(kernel_name: str) -> int:
    km = AsyncKernelManager(kernel_name=kernel_name)
    km.log.setLevel(logging.INFO)
    await km.start_kernel()
    print("LEASED", km.kernel_id, flush=True)
    try:
        out, reply = await execute(km, CODE, timeout=120)
        print(out.strip() if reply["status"] == "ok" else f"FAILED {out}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    finally:
        await km.shutdown_kernel(now=False)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    sys.exit(asyncio.run(main(sys.argv[1])))
