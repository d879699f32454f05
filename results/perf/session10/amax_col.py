"""NVFP4's tensor-amax pass, second look (after amax_loop.txt): for a pair whose row side has no
RHT (an NVFP4 layer's x and dy: Fprop / Dgrad plain, Wgrad RHT16), the row side's amax is max |x|,
whatever the orientation, so the column-wise load alone can give both amaxes (no second read of
the tile from L2). Variants of the pass, each with TILES tiles per program along M (one atomic
per program), over column tiles (BM, BN, warps), at the shapes of a GPT-2 layer and of the
16k x 4096 linear; plus row-only passes at their default tiles. Timed from CUDA-graph replays;
every variant's amax compared bit for bit with kernels._tensor_amax.
Run from the repo root: python results/perf/session10/amax_col.py
"""
import datetime, statistics, sys
import torch, triton
import triton.language as tl
sys.path[:0] = [".", "scripts"]
import fp4, kernels
from kernels import _load_rows, _load_cols, _rht, _amax
from quant_breakdown import graph_ms


@triton.jit
def _amax_v2(x_ptr, r_part, c_part, M, N, c_signs, BM: tl.constexpr, BN: tl.constexpr,
             DO_ROW: tl.constexpr, ROW_G: tl.constexpr, ROWLOAD: tl.constexpr, DO_COL: tl.constexpr,
             C_RHT: tl.constexpr, C_INV: tl.constexpr, C_SMASK: tl.constexpr, EVEN: tl.constexpr,
             TILES: tl.constexpr):
    """DO_COL: column loads (+ RHT) -> column amax, and the row amax (no RHT) from the same
    values when DO_ROW; else DO_ROW alone: row loads, no RHT."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    a = tl.program_id(2)
    base = a.to(tl.int64) * M * N
    if DO_COL:
        mr = tl.zeros([BN, BM], tl.float32)
        mc = tl.zeros([BN, BM], tl.float32)
    else:
        mr = tl.zeros([BM, BN], tl.float32)
        mc = mr
    for t in range(TILES):
        m0 = (pid_m * TILES + t) * BM
        if DO_COL:
            x = _load_cols(x_ptr, base, m0, pid_n * BN, M, N, BM, BN, 16, EVEN)
            if DO_ROW:
                mr = tl.maximum(mr, tl.abs(x))
            if C_RHT > 0:
                x = _rht(x, c_signs, BN, BM, C_RHT, C_INV, C_SMASK)
            mc = tl.maximum(mc, tl.abs(x))
        else:
            x = _load_rows(x_ptr, base, m0, pid_n * BN, M, N, BM, BN, ROW_G, ROWLOAD, EVEN)
            mr = tl.maximum(mr, tl.abs(x))
    if DO_ROW:
        m = _amax(_amax(mr, 1), 0)
        tl.atomic_max(r_part, tl.where(m != m, 0x7FC00000, m.to(tl.int32, bitcast=True)))
    if DO_COL:
        m = _amax(_amax(mc, 1), 0)
        tl.atomic_max(c_part, tl.where(m != m, 0x7FC00000, m.to(tl.int32, bitcast=True)))


def run_v2(x3, do_row, do_col, BM, BN, nw, mode, tiles):
    A, M, N = x3.shape
    outs = [torch.zeros(1, device=x3.device, dtype=torch.int32) for _ in range(2)]
    signs = kernels._signs(16, x3.device, outs[0])
    _amax_v2[(M // (BM * tiles), N // BN, A)](
        x3, outs[0], outs[1], M, N, signs, BM=BM, BN=BN, DO_ROW=do_row, ROW_G=16, ROWLOAD=mode,
        DO_COL=do_col, C_RHT=16, C_INV=0.25, C_SMASK=kernels._smask(16), EVEN=True, TILES=tiles,
        num_warps=nw, enable_fp_fusion=False)
    return outs


def main():
    print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
          f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(big)
    cbw = 4 * big.numel() / graph_ms(lambda: dst.copy_(big)) / 1e9
    print(f"copy {cbw:.3f} TB/s (read + write); xcopy below: bytes read / time / copy bw", flush=True)
    nv = fp4.get_format("nvfp4")
    print("| shape | pass | tile | variant | us | read xcopy | amax equal |\n|---|---|---|---|---|---|---|")
    for M, N in ((16384, 768), (16384, 2304), (16384, 3072), (16384, 4096), (8192, 8192)):
        t3 = torch.randn(1, M, N, device="cuda", dtype=torch.bfloat16)
        nbytes = t3.numel() * 2

        def show(label, tile, name, fn, want, got):
            us = statistics.median(graph_ms(fn) for _ in range(3)) * 1e3
            print(f"| {M}x{N} | {label} | {tile} | {name} | {us:.1f} | {nbytes / us / 1e6 / cbw:.3f} | {got == want} |", flush=True)

        # pair: row plain + column RHT16, as kernels does it for x (64x64) and dy (16x256)
        for tile in ((64, 64, 4, 1), (16, 256, 4, 0)):
            ref = lambda tile=tile: kernels._tensor_amax(t3, nv, None, False, *tile, col_rht=16)
            want = [int(v) for v in ref()]
            show("pair", tile, "as is", ref, want, want)
        want = [int(v) for v in kernels._tensor_amax(t3, nv, None, False, 64, 64, 4, 1, col_rht=16)]
        for BM, BN, nw in ((64, 64, 4), (32, 128, 4), (64, 128, 4), (128, 64, 4), (64, 128, 8), (32, 64, 4), (128, 128, 8)):
            for tiles in (1, 4, 8, 16):
                if M % (BM * tiles) or N % BN:
                    continue
                fn = lambda: run_v2(t3, True, True, BM, BN, nw, 1, tiles)
                show("pair from col loads", (BM, BN, nw), f"loop {tiles}", fn, want, [int(v) for v in fn()])
        # row-only pass (no RHT) at the row quantize's default tile, and looped
        BM, BN, nw, mode = kernels._tile(M, N, 16, None)
        ref = lambda: kernels._tensor_amax(t3, nv, None, False, BM, BN, nw, mode)
        want = [int(ref())]
        show("row", (BM, BN, nw, mode), "as is", ref, want, want)
        for tiles in (4, 8, 16):
            if M % (BM * tiles) == 0:
                fn = lambda: run_v2(t3, True, False, BM, BN, nw, mode, tiles)
                show("row", (BM, BN, nw, mode), f"loop {tiles}", fn, want, [int(fn()[0])])


if __name__ == "__main__":
    main()
