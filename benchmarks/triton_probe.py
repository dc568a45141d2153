"""One tiny Triton kernel, launched: can Triton compile and launch here (benchmarks/gpu_check.sh)?

Triton builds its launcher with the host's C compiler and Python headers on first use; without them
every kernel of orthoptim.kernels would fall back to torch. (A file of its own: @triton.jit reads the
source of the function it compiles, which code fed to ``python -`` does not have.)

    python benchmarks/triton_probe.py [--device cuda]      prints "ok" or the error; exit 0 / 1
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch


def probe(device: str = "cuda") -> str:
    """"ok", or the error's type and message."""
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(x_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

        x = torch.zeros(100, device=device)
        add_one[(1,)](x, 100, BLOCK=128)
        if x.is_cuda:
            torch.cuda.synchronize()
        return "ok" if bool((x == 1).all()) else "wrong result"
    except Exception as error:
        traceback.print_exc()
        return f"{type(error).__name__}: {str(error)[:300]}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    verdict = probe(parser.parse_args().device)
    print(verdict)
    sys.exit(0 if verdict == "ok" else 1)
