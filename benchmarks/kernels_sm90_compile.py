"""Compile the Triton kernels for Hopper (sm_90a) on a machine without a GPU, and report what came out.

    python benchmarks/kernels_sm90_compile.py [--json out.json]

For every autotune config of the symmetric kernel (bf16) and for the fused Dion3 kernels: whether
Triton emitted wgmma, how many shared-memory buffers the K loop is pipelined over, shared memory per
program, and registers / spills from the bundled ptxas. Arguments are specialized as the JIT would
for realistic shapes (pointers and sizes divisible by 16, unit inner strides). A static check only:
it says the kernels build for Hopper as intended, nothing about their speed. Needs triton, not CUDA;
relies on Triton's compiler API (``ASTSource``, ``triton.compile``), tested with triton 3.9.0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from orthoptim.kernels import triton_dion3, triton_symmetric

TARGET = GPUTarget("cuda", 90, 32)


def build(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    names = fn.arg_names
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t[0] == "*" or t == "i32"}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=aligned)
    kernel = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    buffers = [int(b) for b in re.findall(r"!ttg.memdesc<(\d+)x\d+x\d+x", ttgir)]
    return {"kernel": fn.__name__, "num_warps": num_warps, "num_stages": num_stages,
            **{k: v for k, v in constexprs.items() if k.isupper()},
            "wgmma": "wgmma.mma_async" in ptx, "pipelined_buffers": max(buffers, default=1),
            "shared_bytes": kernel.metadata.shared,
            # approximate fp32 division / square root (Dion3's coefficients must round like torch's)
            "approx_div_sqrt": len(re.findall(r"\b(?:div\.full|div\.approx|sqrt\.approx)\.f32", ptx)),
            **ptxas_info(ptx)}  # fmt: skip


def ptxas_info(ptx: str) -> dict:
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the PTX version Triton emits
        exe = os.path.join(bindir, name)
        if not os.path.exists(exe):
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        out = subprocess.run([exe, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
        os.unlink(f.name)
        text = out.stdout + out.stderr
        regs = re.search(r"Used (\d+) registers", text)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        if out.returncode == 0 and regs:
            return {"registers": int(regs.group(1)), "spill_bytes": int(spills.group(1)) + int(spills.group(2))}
    return {"registers": None, "spill_bytes": None}


def symmetric_rows() -> list[dict]:
    signature = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "K": "i32",
                 "alpha": "fp32", "beta": "fp32", "diag": "fp32"}  # fmt: skip
    for operand in "abco":
        signature[f"stride_{operand}b"] = signature[f"stride_{operand}m"] = "i32"
    rows = []
    for config in triton_symmetric._autotune_configs():
        constexprs = {"stride_ak": 1, "stride_bk": 1, "stride_cn": 1, "stride_on": 1, "HAS_C": True,
                      "DOT_FP32": False, "EMULATE_BF16": False, "PRECISION": "tf32", **config.kwargs}  # fmt: skip
        rows.append(build(triton_symmetric._syrk_kernel, signature, constexprs, config.num_warps, config.num_stages))
    return rows


def dion3_rows() -> list[dict]:
    block = {"BLOCK_R": triton_dion3.BLOCK_ROWS, "BLOCK_N": triton_dion3.BLOCK_COLS}
    rows = [build(triton_dion3._row_sumsq_kernel,
                  {"o_ptr": "*bf16", "index_ptr": "*i64", "position_ptr": "*i32", "sumsq_ptr": "*fp32", "k": "i32",
                   "n": "i32", "stride_ob": "i32", "stride_ok": "i32", "stride_ib": "i32", "stride_pb": "i32"},
                  {"stride_on": 1, "COMPUTE_SUMSQ": True, **block}, 4, 3),
            build(triton_dion3._row_coefficient_kernel,
                  {"sumsq_ptr": "*fp32", "v_ptr": "*fp32", "v_new_ptr": "*fp32", "coef_ptr": "*fp32", "k": "i32",
                   "n": "fp32", "step": "fp32", "beta2": "fp32", "eps": "fp32", "tiny": "fp32"},
                  {"BLOCK": triton_dion3.STATS_BLOCK}, 4, 3)]  # fmt: skip
    for is_list in (True, False):
        for selected_only in (True, False):
            rows.append(build(triton_dion3._apply_kernel,
                              {"x_ptr": "*bf16", "x_ptrs": "*i64", "o_ptr": "*bf16", "index_ptr": "*i64",
                               "position_ptr": "*i32", "coef_ptr": "*fp32", "m": "i32", "n": "i32", "k": "i32",
                               "decay": "fp32", "stride_xb": "i32", "stride_xm": "i32", "stride_ob": "i32",
                               "stride_ok": "i32", "stride_ib": "i32", "stride_pb": "i32"},
                              {"stride_xn": 1, "stride_on": 1, "X_IS_LIST": is_list, "SELECTED_ONLY": selected_only,
                               "EMULATE_BF16": False, **block}, 4, 3))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = symmetric_rows() + dion3_rows()
    for r in rows:
        flags = {k: v for k, v in r.items() if k.isupper() and k not in ("DOT_FP32", "EMULATE_BF16", "PRECISION")}
        print(f"{r['kernel']:<24} warps {r['num_warps']} stages {r['num_stages']} {flags}  wgmma={r['wgmma']}"
              f"  buffers={r['pipelined_buffers']}  smem={r['shared_bytes']}  regs={r['registers']}"
              f"  spills={r['spill_bytes']}  approx_div_sqrt={r['approx_div_sqrt']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "target": "sm_90a", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
