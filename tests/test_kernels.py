"""kernels.py against fp4.py's reference, bit for bit (RTNE), under Triton's CPU interpreter.

CI has no GPU: TRITON_INTERPRET=1 is set before triton is imported, and the kernels are called
directly on CPU tensors (fp4.py only dispatches CUDA tensors to them)."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import dataclasses  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
pytest.importorskip("triton")
import fp4  # noqa: E402
import kernels  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bitwise import assert_grid_neighbours, assert_same, bits, element_scales, grid_neighbours  # noqa: E402

if not kernels.INTERPRET:  # imported earlier in this process without the interpreter
    pytest.skip("kernels was imported without TRITON_INTERPRET=1", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

FORMATS = list(fp4.FORMATS)


def fmt_of(name, block_2d=False):
    f = fp4.FORMATS[name]
    return dataclasses.replace(f, block_2d=True) if block_2d else f


def assert_qtensor(q, r, what=""):
    assert_same(q.codes, r.codes, what + " codes")
    assert_same(q.scales, r.scales, what + " scales")
    assert_same(q.tensor_scale, r.tensor_scale, what + " tensor_scale")
    assert (q.fmt, tuple(q.shape), q.dtype, q.dim, q.rht) == (r.fmt, tuple(r.shape), r.dtype, r.dim, r.rht)


def check_rtne(x, fmt, dim, rht, dtypes=(torch.float32,)):
    """quantize, dequantize and fake_quant == the reference, bit for bit."""
    what = f"{fmt.name}{'/2d' if fmt.block_2d else ''} dim={dim} rht={rht} shape={tuple(x.shape)}"
    r = fp4.quantize(x, fmt, dim=dim, rht=rht)
    q = kernels.quantize(x, fmt, dim=dim, rht=rht)
    assert_qtensor(q, r, what)
    for dt in dtypes:
        assert_same(kernels.dequantize(q, dt), fp4.dequantize(r, dt).contiguous(), what + f" dequantize {dt}")
        assert_same(kernels.fake_quant(x, fmt, dim=dim, rht=rht, dtype=dt),
                    fp4.fake_quant(x, fmt, dim=dim, rht=rht, dtype=dt).contiguous(), what + f" fake_quant {dt}")


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # a spread of block magnitudes, so blocks differ in scale by orders of magnitude
    x = torch.randn(*shape, generator=g)
    x = x * torch.exp2(torch.randint(-8, 8, shape[:-1] + (1,), generator=g).float())
    return x.to(dtype)


# -----------------------------------------------------------------------------
# RTNE: bit for bit

@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rht", [None, 16])
def test_rtne_rowwise_and_columnwise(name, rht):
    fmt = fmt_of(name)
    for seed, dim in ((1, 1), (2, 0)):
        check_rtne(randn(64, 96, seed=seed), fmt, dim, rht, dtypes=(torch.float32, torch.bfloat16))


@pytest.mark.parametrize("rht", [32, 64, 128])
def test_rtne_large_rht(rht):
    for i, name in enumerate(("ufp4", "nvfp4", "mxfp4")):
        x = randn(128, 128, seed=10 + i)
        for dim in (1, 0):
            check_rtne(x, fmt_of(name), dim, rht)


@pytest.mark.parametrize("name", ["nvfp4", "nvint4", "ufp4"])
def test_rtne_2d_tiles(name):
    fmt = fmt_of(name, block_2d=True)
    x = randn(48, 80, seed=3)
    for dim in (1, 0):
        for rht in (None, 16):
            check_rtne(x, fmt, dim, rht)


def test_rtne_2d_tiles_stacked_experts():
    """2D tiles on stacked expert weights [E, out, in]: over (out, in) for dim 2, (in, out) for dim 1."""
    w = randn(3, 32, 48, seed=16)
    for name in ("nvfp4", "ufp4"):
        for dim in (2, 1):
            check_rtne(w, fmt_of(name, block_2d=True), dim, None)


def test_rtne_nd_and_bf16_input():
    x = randn(16, 32, 48, seed=4)
    for dim in (0, 1, 2):
        check_rtne(x, fmt_of("nvfp4"), dim, None)
    xb = randn(40, 64, seed=5, dtype=torch.bfloat16)
    for name in ("ufp4", "nvfp4", "mxint4"):
        check_rtne(xb, fmt_of(name), 1, 16, dtypes=(torch.bfloat16,))
        check_rtne(xb, fmt_of(name), 1, None, dtypes=(torch.bfloat16,))
    # a custom grid/block/scale combination, and rows that do not fill a tile
    check_rtne(randn(19, 64, seed=6), fp4.get_format("e1m2/32/e4m3"), 1, 32)


def test_row_tiles_of_whole_groups(monkeypatch):
    """bf16 rows a multiple of 512 wide take 4096-element tiles as wide as N allows (8 x 512,
    4 x 1024, 2 x 2048) whose loads hand each thread whole G-groups (row load mode 0: two
    half-groups; mode 2, for 32-groups that are packed or SR: four 8-element pieces): 32-blocks
    (MXFP4, MXINT4) and 16-blocks (NVFP4); RHT off, inside a group and across groups; rows that
    do not fill a tile (masks). RTNE against the reference; SR against the same kernel with plain
    loads (mode 1), whose random bits are the same."""
    metas = []
    launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda k, g, a, meta, *r: (
        metas.append(meta), launch(k, g, a, meta, *r)))
    plain, whole = (8, 512, 4, 1), (8, 512, 4, 2)
    for i, name in enumerate(("mxfp4", "mxint4", "nvfp4")):
        fmt = fmt_of(name)
        x = randn(22, 1024, seed=30 + i, dtype=torch.bfloat16)
        for rht in (None, 16, 64):
            assert kernels._tile(22, 1024, kernels._need(fmt, rht), None) == (4, 1024, 4, 0)
            check_rtne(x, fmt, 1, rht, dtypes=(torch.bfloat16,))
            what = f"{name} rht {rht}"
            assert_qtensor(kernels.quantize(x, fmt, 1, rht=rht, _cfg=whole),
                           fp4.quantize(x, fmt, 1, rht=rht), f"{what} mode 2")
            assert_same(kernels.fake_quant(x, fmt, 1, rht=rht, dtype=torch.bfloat16, _cfg=whole),
                        fp4.fake_quant(x, fmt, 1, rht=rht, dtype=torch.bfloat16), f"{what} mode 2 fake")
            for sides in ((None, plain), (whole, plain)):
                fq = [kernels.fake_quant(x, fmt, 1, "sr", rht, 7, torch.bfloat16, _cfg=c) for c in sides]
                assert_same(fq[0], fq[1], f"{what} SR fake {sides}")
                q = [kernels.quantize(x, fmt, 1, "sr", rht, 7, _cfg=c) for c in sides]
                assert_qtensor(q[0], q[1], f"{what} SR {sides}")
    # two rows of 2048 per tile, five rows (the last tile half empty), modes 0 and 2
    x = randn(5, 2048, seed=35, dtype=torch.bfloat16)
    for name in ("mxfp4", "nvfp4"):
        fmt = fmt_of(name)
        assert kernels._tile(5, 2048, kernels._need(fmt, 16), None) == (2, 2048, 4, 0)
        check_rtne(x, fmt, 1, 16, dtypes=(torch.bfloat16,))
        assert_qtensor(kernels.quantize(x, fmt, 1, rht=16, _cfg=(2, 2048, 4, 2)),
                       fp4.quantize(x, fmt, 1, rht=16), f"{name} 2 x 2048 mode 2")
        fq = [kernels.fake_quant(x, fmt, 1, "sr", 16, 7, torch.bfloat16, _cfg=c) for c in (None, plain)]
        assert_same(fq[0], fq[1], f"{name} 2 x 2048 SR fake")
        q = [kernels.quantize(x, fmt, 1, "sr", 16, 7, _cfg=c) for c in (None, plain)]
        assert_qtensor(q[0], q[1], f"{name} 2 x 2048 SR")
    # 2D blocks (16 x 16 tiles) on bf16 rows keep 16 x 512 tiles (16 x 2048 spills registers)
    metas.clear()
    f2 = fmt_of("nvfp4", block_2d=True)
    check_rtne(randn(32, 2048, seed=36, dtype=torch.bfloat16), f2, 1, None, dtypes=(torch.bfloat16,))
    tiles = [(m["BM"], m["BN"]) for m in metas if "BN" in m]  # (the dequantize's tiles are BR x BK)
    assert tiles and all(bm * bn <= 8192 for bm, bn in tiles), tiles
    # the default launches: mode 2 for 32-blocks packed or SR, mode 0 otherwise; NVFP4's amax pass
    # before each takes plain loads (whole-group loads gave a wrong amax on the H200: docs/kernels.md)
    for name, want in (("mxfp4", [0, 2, 2]), ("nvfp4", [1, 0] * 3)):
        metas.clear()
        x = randn(16, 512, seed=40, dtype=torch.bfloat16)
        kernels.fake_quant(x, name, rht=16)
        kernels.quantize(x, name, rht=16)
        kernels.fake_quant(x, name, rounding="sr", rht=16, seed=1)
        modes = [m.get("ROWLOAD") for m in metas]
        assert modes == want, (name, modes)


# block scales on e4m3 midpoints (with s_enc = 1) and the even neighbour each rounds to
E4M3_TIES = ((1.0625, 1.0), (1.1875, 1.25), (2.5 * 2**-9, 2 * 2**-9), (1.5 * 2**-9, 2 * 2**-9),
             (0.5 * 2**-9, 0.0))


def _tie_tensor(fmt, rows=32, cols=64, seed=0):
    """Blocks whose elements sit exactly on the midpoints between grid levels once divided by
    their (exactly known) block scale; element 0 of each block sets amax = qmax * scale."""
    g = torch.Generator().manual_seed(seed)
    grid = fp4.GRIDS[fmt.grid]
    lv = torch.tensor(grid.levels)
    mids = torch.cat([(lv[:-1] + lv[1:]) / 2, lv])  # ties and exact levels
    nb = cols // fmt.block
    x = mids[torch.randint(0, len(mids), (rows, nb, fmt.block), generator=g)]
    x = x * (torch.randint(0, 2, x.shape, generator=g) * 2 - 1)
    x[..., 0] = grid.qmax
    if fmt.scale == "e4m3":  # scales that e4m3 holds exactly; s_enc = 1 from one block at 448
        scale = torch.tensor([0.25, 0.5, 1.0, 1.25, 1.5, 1.75, 2.0, 3.0, 48.0])
        s = scale[torch.randint(0, len(scale), (rows, nb, 1), generator=g)]
        s[0, 0] = 448.0
        s[1:1 + len(E4M3_TIES), 0, 0] = torch.tensor([t for t, _ in E4M3_TIES])
    else:  # powers of two: exact for fp32 (qmax * s / qmax) and e8m0 scales
        s = torch.exp2(torch.randint(-10, 10, (rows, nb, 1), generator=g).float())
    return (x * s).reshape(rows, cols)


@pytest.mark.parametrize("name", FORMATS)
def test_ties_round_to_even(name):
    fmt = fmt_of(name)
    x = _tie_tensor(fmt)
    # the ties really are ties, and the reference sends them to even grid indices
    r = fp4.quantize(x, fmt)
    check_rtne(x, fmt, 1, None)
    check_rtne(x.t().contiguous(), fmt, 0, None)
    idx = fp4.unpack_codes(r.codes).reshape(x.shape) & 7
    scale = element_scales(r)
    lv = torch.tensor(fp4.GRIDS[fmt.grid].levels, dtype=torch.float64)
    a = x.double().abs() / scale
    tie = ((a[..., None] - (lv[:-1] + lv[1:]) / 2).abs() < 1e-9).any(-1)
    assert tie.sum() > x.numel() // 4, f"{name}: {int(tie.sum())} ties of {x.numel()}"
    assert (idx[tie] % 2 == 0).all(), f"{name}: a tie went to an odd grid index"
    if fmt.scale == "e4m3":  # block scales that tie in e4m3 go to the even neighbour too
        got = r.scales.float().reshape(x.shape[0], -1)[1:1 + len(E4M3_TIES), 0]
        assert got.tolist() == [even for _, even in E4M3_TIES], f"{name}: e4m3 scale ties {got.tolist()}"


def test_tie_values_hand_checked():
    """e2m1 ties: .25->0, .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; int4: .5->0, 1.5->2."""
    for name, ins, outs in (("e2m1", [6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -5, -.25, 0, 0, 0, 0, 0, 0],
                             [6, 0, 1, 1, 2, 2, 4, 4, -4, -0.0, 0, 0, 0, 0, 0, 0]),
                            ("ufp4", [7, .5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, -.5, -1.5, 0, 0, 0, 0, 0, 0],
                             [7, 0, 2, 2, 4, 4, 6, 6, -0.0, -2, 0, 0, 0, 0, 0, 0])):
        x = torch.tensor([ins], dtype=torch.float32)
        y = kernels.fake_quant(x, name, dtype=torch.float32)
        assert_same(y, torch.tensor([outs], dtype=torch.float32), name)


def test_special_values():
    """Zero blocks, saturation, negative zero, NaN / Inf, tiny and huge blocks."""
    for name in FORMATS:
        fmt = fmt_of(name)
        x = randn(32, 128, seed=7)
        x[0] = 0.0                         # all-zero rows: scale 0 -> zeros
        x[1, :32] = 0.0                    # zero blocks next to normal ones
        x[2, :32] = -0.0
        x[3, 1:32] = -1e-9                 # tiny negatives under a big amax -> code 8, -0.0
        x[3, 0] = 1.0
        x[4, :32] = torch.linspace(-7.9, 7.9, 32) * 2.0 ** 5   # e8m0 saturation
        x[5, :32] *= 1e-30                 # tiny blocks (normal fp32 scales)
        x[6, :32] *= 1e30                  # huge blocks
        x[7, :32] *= 2.0 ** -126           # e8m0's smallest scale, 2^-127: a subnormal bf16 stored
        check_rtne(x, fmt, 1, None)
        check_rtne(x, fmt, 1, 16)
        check_rtne(x[:, :64].t().contiguous(), fmt, 0, None)
        zeros = torch.zeros(32, 64)        # an all-zero tensor: amax 0 -> tensor scale 1, not inf
        for dim, rht in ((1, None), (0, None), (1, 16), (0, 16)):
            check_rtne(zeros, fmt, dim, rht)
        y = x.clone()
        y[8, 3] = float("nan")
        y[9, 40] = float("inf")
        y[10, 70] = -float("inf")
        check_rtne(y, fmt, 1, None)
        check_rtne(y, fmt, 0, 16)
        out = kernels.fake_quant(y, fmt, dtype=torch.float32)
        if fmt.scale == "e4m3":    # a non-finite tensor amax: everything NaN
            assert out.isnan().all()
        else:                      # only the blocks that hold NaN/Inf
            assert out[8, :fmt.block].isnan().all() and out[0].eq(0).all()


def test_tiny_tensor_huge_tensor_scale():
    """A tensor whose amax is tiny (1e-18): NVFP4's tensor scale s_enc passes 2^64, where the
    kernels scale it down by a power of two to keep the division by it exact."""
    for name in FORMATS:
        x = randn(32, 128, seed=8) * 1e-20
        for dim, rht in ((1, None), (1, 16), (0, 16)):
            check_rtne(x, fmt_of(name), dim, rht, dtypes=(torch.float32, torch.bfloat16))


def test_tensor_scale_capped_for_the_tiniest_tensors():
    """amax below ~8e-36: qmax 448 / amax overflows fp32, so s_enc is capped at fp32's largest
    value; the tensor's zeros stay zero (0 * inf was NaN) and the kernels match the reference."""
    for scale in (1e-37, 1e-42):
        x = randn(32, 64, seed=9) * (scale / 1024)  # (randn's rows span 2^-8..2^7)
        x[0, :5] = 0
        for name in (n for n, f in fp4.FORMATS.items() if f.scale == "e4m3"):
            for dim, rht in ((1, None), (0, 16)):
                check_rtne(x, fmt_of(name), dim, rht)
            out = kernels.fake_quant(x, name, dtype=torch.float32)
            assert out.isfinite().all() and out[0, :5].eq(0).all(), (name, scale)
            assert kernels.quantize(x, name).tensor_scale == torch.finfo(torch.float32).max


# -----------------------------------------------------------------------------
# Both orientations from one read

@pytest.mark.parametrize("packed", [False, True])
def test_quantize_both_matches_two_calls(packed):
    cases = [  # (row fmt, col fmt, row rht, col rht)
        ("nvfp4", "nvfp4", None, 16),     # NVIDIA: W Fprop row-wise, Wgrad column-wise with RHT
        ("ufp4", "ufp4", 16, 16),
        ("mxfp4", "e2m1", None, None),
        (fmt_of("nvfp4", True), fmt_of("nvfp4", True), None, None),  # 2D weight tiles
    ]
    x = randn(64, 96, seed=8)
    for fr, fc, rr, rc in cases:
        row, col = kernels.quantize_both(x, fr, fc, rht=rr, rht_col=rc, packed=packed,
                                         dtype=torch.float32)
        if packed:
            assert_qtensor(row, fp4.quantize(x, fr, dim=1, rht=rr), f"{fr} row")
            assert_qtensor(col, fp4.quantize(x, fc, dim=0, rht=rc), f"{fc} col")
        else:
            assert_same(row, fp4.fake_quant(x, fr, dim=1, rht=rr, dtype=torch.float32), f"{fr} row")
            assert_same(col, fp4.fake_quant(x, fc, dim=0, rht=rc, dtype=torch.float32).contiguous(),
                        f"{fc} col")


def test_quantize_both_per_side_outputs_and_seeds():
    # what the layer asks for: x fake row-wise + packed column-wise (Fprop, Wgrad), dy fake both
    # ways with SR (Dgrad, Wgrad); seeds in memory; the bits of the two one-sided calls
    seeds = torch.arange(6) + 31
    for name, rr, rc, shape in (("ufp4", 16, 16, (64, 96)), ("nvfp4", None, 16, (64, 96)),
                                ("nvfp4", 16, 16, (64, 96)), ("e2m1", None, 32, (64, 96)),
                                ("ufp4", 16, 16, (48, 256))):
        # 256 wide, 16-bit: the 16 x 256 tiles with mode-0 row loads
        x = randn(*shape, seed=15, dtype=torch.bfloat16 if shape[1] == 256 else torch.float32)
        for rounding in (("rtne", None), ("sr", None), ("rtne", "sr"), ("sr", "rtne")):
            rnd = (rounding[0], rounding[1] or rounding[0])  # None: the row side's
            for packed in ((False, True), (True, False), (False, False)):
                row, col = kernels.quantize_both(x, name, rounding=rounding[0], rounding_col=rounding[1],
                                                 rht=rr, rht_col=rc, seed=seeds[2], seed_col=seeds[4],
                                                 packed=packed, dtype=torch.float32)
                one = [(kernels.quantize(x, name, d, rd, r, s) if p else
                        kernels.fake_quant(x, name, d, rd, r, s, torch.float32))
                       for d, rd, r, s, p in ((1, rnd[0], rr, 33, packed[0]), (0, rnd[1], rc, 35, packed[1]))]
                what = f"{name} {rnd} rht {rr}/{rc} packed {packed}"
                for got, want, side in zip((row, col), one, ("row", "col")):
                    if isinstance(want, fp4.QTensor):
                        assert_qtensor(got, want, f"{what} {side}")
                    else:
                        assert_same(got, want, f"{what} {side}")
                if rnd == ("rtne", "rtne"):  # and the reference's
                    ref = fp4.quantize_both(x, name, rht=rr, rht_col=rc, packed=packed, dtype=torch.float32)
                    for got, want in zip((row, col), ref):
                        if isinstance(want, fp4.QTensor):
                            assert_qtensor(got, want, what)
                        else:
                            assert_same(got, want.contiguous(), what)


def test_quantize_both_with_other_blocks_per_side():
    # the shared tensor-amax pass reads each side in that side's G-groups (e4m3 scales, blocks 32
    # and 16, the RHT on one side or both, of other sizes: a pass tile that is not square)
    e2m1_32 = fp4.Format("e2m1/32/e4m3", "e2m1", 32, "e4m3")
    x = randn(64, 256, seed=18, dtype=torch.bfloat16)
    for fr, fc, rr, rc in ((e2m1_32, "nvfp4", None, 16), ("nvfp4", e2m1_32, 16, None), (e2m1_32, "nvfp4", 32, 16),
                           ("nvfp4", "nvfp4", 128, 16)):
        row, col = kernels.quantize_both(x, fr, fc, rht=rr, rht_col=rc, dtype=torch.float32)
        assert_same(row, fp4.fake_quant(x, fr, 1, rht=rr, dtype=torch.float32), f"{fr} row")
        assert_same(col, fp4.fake_quant(x, fc, 0, rht=rc, dtype=torch.float32).contiguous(), f"{fc} col")


def test_tensor_amax_pass_every_load_plan():
    """NVFP4's amax pass gives max |RHT(x)| for each side: from row loads, from column loads, from
    both (an RHT on each side), and for a side without RHT the plain max of the other's loads;
    with several tiles per program (row loads, column loads, both), the last program partly outside x,
    tiles that are not square; NaN anywhere gives NaN."""
    nv = fp4.FORMATS["nvfp4"]

    def want(x3, rht, dim):
        return (fp4.rht_transform(x3, rht, dim) if rht else x3.float()).abs().amax().item()

    def same(got, w, what):
        g = got.view(torch.float32).item()
        assert (math.isnan(g) and math.isnan(w)) or g == w, (what, g, w)

    plans = [  # (row RHT, column RHT or None for one side, col flag, cfg)
        (16, None, False, None), (None, None, False, None), (16, None, True, None),
        (None, 16, False, None), (16, 0, False, None), (16, 32, False, None), (None, 0, False, None),
        (16, None, False, (8, 64, 4, 1, 8)), (None, 16, False, (32, 64, 4, 1, 2)),
        (128, 16, False, None), (16, 32, False, (32, 64, 4, 1, 2)), (32, 16, False, (64, 32, 4, 1, 3))]
    for shape, dtype in (((1, 96, 512), torch.bfloat16), ((2, 160, 192), torch.float32)):
        for nan in (False, True):
            x3 = randn(*shape, seed=21, dtype=dtype)
            if nan:
                x3[-1, -1, 5] = float("nan")  # in x's last row
            for rr, rc, col, cfg in plans:
                if shape[2] % (rr or 1):
                    continue  # (an RHT of 128 along 192)
                what = (shape, nan, rr, rc, col, cfg)
                got = kernels._tensor_amax(x3, nv, rr, col, col_rht=rc, cfg=cfg)
                if rc is None:
                    same(got, want(x3, rr, 1 if col else 2), what)
                else:
                    same(got[0], want(x3, rr, 2), what)
                    same(got[1], want(x3, rc or None, 1), what)
    # the default plans: row loads plain (mode 1: whole-group loads gave a wrong amax on the H200),
    # four tiles per program when M allows; column loads alone 128 x 64
    assert kernels._amax_tile(96, 512, 16, None, 2) == (8, 512, 4, 1, 4)
    assert kernels._amax_tile(80, 512, 16, None, 2)[4] == 1
    assert kernels._amax_tile(96, 512, None, 16, 2) == (128, 64, 4, 1, 1)


def test_flat_amax_any_length_dtype_and_tiling():
    """_flat_amax (an FP8 side's plain amax, fp8_from_packed's largest block scale) is max |t| as
    int32 bits: lengths that end inside a block and inside a program's run of tiles, negative
    maxima, every 16/32-bit float dtype, several tilings; NaN anywhere gives NaN, Inf gives Inf;
    an empty tensor gives 0."""
    for n in (1, 63, 64, 1000, 3 * 4096 + 5):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for cfg in (None, (64, 3, 4), (128, 1, 4)):
                t = randn(n, seed=n, dtype=dtype)
                t[n // 2] = -2 * t.float().abs().amax()  # the largest magnitude is negative
                for poison in (None, float("nan"), float("inf")):
                    if poison is not None:
                        t[-1] = poison
                    got = kernels._flat_amax(t, cfg).view(torch.float32).item()
                    want = t.float().abs().amax().item()
                    assert got == want or (math.isnan(got) and math.isnan(want)), (n, dtype, cfg, poison, got)
    assert kernels._flat_amax(torch.zeros(0)).item() == 0


def test_pair_tiles_for_16_bit_inputs_256_wide():
    assert kernels._tile(48, 256, 16, 16, esize=2) == (16, 256, 4, 0)
    assert kernels._tile(48, 256, 16, 16, esize=2, packed=True) == (64, 64, 4, 1)
    assert kernels._tile(48, 256, 16, 16, esize=4)[3] == 1  # fp32 inputs: plain loads


def test_fake_column_side_alone_takes_16_x_256_tiles():
    # 16-bit input, 16-groups, N a multiple of 256, not heavy; else the 32 x 128 rule
    assert kernels._tile(16384, 768, None, 16, esize=2) == (16, 256, 4, 1)
    assert kernels._tile(16384, 760, None, 16, esize=2)[:2] == (32, 128)
    assert kernels._tile(16384, 768, None, 16, esize=4)[:2] == (32, 128)
    assert kernels._tile(16384, 768, None, 32, esize=2)[0] % 32 == 0
    assert kernels._tile(16384, 768, None, 16, esize=2, heavy=True)[:2] == (16, 128)
    assert kernels._tile(16384, 768, None, 16, esize=2, packed=True)[:2] == (128, 64)
    x = randn(64, 256, seed=31, dtype=torch.bfloat16)
    for name in ("ufp4", "nvfp4"):
        got = kernels.fake_quant(x, name, dim=0, rht=16, dtype=torch.float32)
        assert_same(got, fp4.fake_quant(x, name, dim=0, rht=16, dtype=torch.float32).contiguous(), name)
        # SR's counters follow the element, not the tile: the same draws as in 32 x 128 tiles
        sr = lambda cfg: kernels.fake_quant(x, name, dim=0, rht=16, rounding="sr", seed=4, _cfg=cfg)  # noqa: E731
        assert_same(sr(None), sr((32, 128, 4)), name + " SR")


def test_2d_tiles_same_for_w_and_wt():
    """Without RHT, 16x16 tiles give the same Q(W) seen row-wise and column-wise."""
    fmt = fmt_of("nvfp4", True)
    w = randn(48, 64, seed=9)
    row, col = kernels.quantize_both(w, fmt, dtype=torch.float32)
    assert_same(row, col)


# -----------------------------------------------------------------------------
# Stochastic rounding: same distribution, not the same bits

def _sr_tensor(fmt, rows, seed=0):
    """Rows that repeat one base row: every row has the same blocks and scales, and (for e4m3)
    the same tensor amax, so the rows are independent draws of Q(base). Each block starts with
    qmax and three grid levels, so its scale is 1 (fp32, e8m0; e4m3 under the tensor scale) and
    those four values are exact grid points."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 64, generator=g)
    lv = fp4.GRIDS[fmt.grid].levels
    blocks = base.view(1, 64 // fmt.block, fmt.block)
    blocks[..., :4] = torch.tensor([lv[-1], -lv[2], lv[3], -lv[4]])
    return base.expand(rows, 64).contiguous(), base


@pytest.mark.parametrize("name", ["ufp4", "e2m1", "nvfp4", "mxfp4"])
def test_sr_unbiased(name):
    fmt = fmt_of(name)
    n = 2048
    for dim, rht in ((1, None), (0, 16)):
        x, base = _sr_tensor(fmt, n, seed=1)
        if dim == 0:
            x = x.t().contiguous()
        y = kernels.fake_quant(x, fmt, dim=dim, rounding="sr", rht=rht, seed=123, dtype=torch.float32)
        if dim == 0:
            y = y.t()
        ref = fp4.rht_transform(base, rht) if rht else base
        lo = fp4.fake_quant(ref, fmt, dtype=torch.float32)  # scales known: RTNE grid of the same blocks
        # every draw is one of the two grid neighbours; the mean converges to x
        mean, sd = y.double().mean(0), y.double().std(0)
        scale, _, below, above = (v[0] for v in grid_neighbours(ref, fmt))
        lv = fp4.GRIDS[fmt.grid].levels
        # unbiased w.r.t. x clamped to the block's range (an e4m3 scale rounded down saturates)
        qmax = fp4.GRIDS[fmt.grid].qmax
        target = torch.maximum(torch.minimum(ref[0].double(), qmax * scale), -qmax * scale)
        err = (mean - target).abs()
        # 5 standard errors of a draw between x's two neighbours (its sd is at most half their gap)
        bound = 5 * (above - below) * scale / 2 / math.sqrt(n) + 1e-7 * ref.abs().max()
        assert (err <= bound).all(), f"{name} dim={dim}: max err/bound {(err / bound).max():.2f}"
        assert (y.unique(dim=0).shape[0] > 1)
        # every draw is a grid value of its block
        levels = torch.tensor(lv, dtype=torch.float64)
        gap = ((y.double().abs() / scale)[..., None] - levels).abs().amin(-1)
        assert (gap <= 1e-6).all(), f"{name} dim={dim}: off-grid draws, worst {gap.max():.3g}"
        # exact grid points never move: without the RHT the planted ones; after it, only each
        # block's largest value, where the scale is its amax / qmax (e8m0 and e4m3 scales round it)
        exact = (lo[0] == ref[0]) & (ref[0] != 0)
        want = 4 if not rht else 1 if fmt.scale == "fp32" else 0   # exact points per block
        assert exact.sum() >= want * (64 // fmt.block), f"{name}: {int(exact.sum())} exact points"
        if want:
            assert (y[:, exact] == ref[0, exact]).all()
            assert (sd[exact] == 0).all()


@pytest.mark.parametrize("bits", [8, 16])
def test_sr_probability_matches_fraction(bits, monkeypatch):
    """ufp4, scale 1: value k + f rounds up with probability round(2^b f) / 2^b for b random bits
    (kernels.SR_BITS): within 2^-(b+1) of f; f = 0.001 never rounds up with 8 bits (2^-9 = 0.00195),
    and with 16 bits about 0.001 of the time."""
    monkeypatch.setattr(kernels, "SR_BITS", bits)
    n = 4096
    fracs = torch.tensor([0.0, 0.001, 0.1, 0.25, 0.5, 0.7, 0.9, 0.999])
    row = torch.cat([torch.tensor([7.0]), 2 + fracs, -3 - fracs[:7]])  # 16 = one block
    x = row.repeat(n, 4)
    y = kernels.fake_quant(x, "ufp4", rounding="sr", seed=5, dtype=torch.float32)
    p_up = (y.abs() - x.abs().floor()).double().mean(0)
    f = (x.abs() - x.abs().floor())[0].double()  # the fractions as fp32 holds them
    want = torch.floor(f * 2**bits + 0.5) / 2**bits
    tol = 5 * torch.sqrt(want * (1 - want) / n) + 1e-9
    assert ((p_up - want).abs() <= tol).all(), (p_up - want).abs().max()
    # the tolerance cannot tell 16 bits from 8 at f = 0.001: about 16 of its 16k draws round up
    # with 16 bits (none up with probability e^-16), none ever with 8
    ups = (y.abs() - x.abs().floor())[:, (f - 0.001).abs() < 1e-5].sum()
    assert (ups > 0) == (bits == 16), f"{bits} bits: f = 0.001 rounded up {int(ups)} times"


@triton.jit
def _uniform_probe(u_ptr, w_ptr, seed, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr):
    """kernels._uniform's [R, C] draws and the Philox words they came from ([R, C BITS / 128, 4])."""
    K: tl.constexpr = C * BITS // 128
    roff = tl.arange(0, R)[:, None] * K + tl.arange(0, K)[None, :]
    tl.store(u_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :],
             kernels._uniform(seed, roff, R, C, 10, BITS))
    r0, r1, r2, r3 = tl.randint4x(seed, roff, 10)
    tl.store(w_ptr + roff * 4, r0.to(tl.int32, bitcast=True))
    tl.store(w_ptr + roff * 4 + 1, r1.to(tl.int32, bitcast=True))
    tl.store(w_ptr + roff * 4 + 2, r2.to(tl.int32, bitcast=True))
    tl.store(w_ptr + roff * 4 + 3, r3.to(tl.int32, bitcast=True))


@pytest.mark.parametrize("bits", [8, 16])
def test_uniform_uses_each_random_bit_once(bits):
    """Each draw is 1 + (r + 0.5) / 2^bits with r one whole byte (or 16-bit half) of its counter's
    four Philox words, and the counter's 128 / bits draws use each byte (half) exactly once: no
    shared or shifted bits between draws."""
    R, C = 4, 64
    u = torch.empty(R, C)
    w = torch.empty(R, C * bits // 128, 4, dtype=torch.int32)
    _uniform_probe[(1,)](u, w, 1234, R, C, bits)
    r = (u.double() - 1) * 2**bits - 0.5
    assert torch.equal(r, r.round()) and r.min() >= 0 and r.max() < 2**bits
    words = w.long() & 0xFFFFFFFF
    parts = torch.stack([(words >> (bits * j)) & (2**bits - 1) for j in range(32 // bits)], -1)
    per_counter = 128 // bits
    got = r.long().view(R, C // per_counter, per_counter).sort(-1).values
    assert torch.equal(got, parts.view(R, C // per_counter, per_counter).sort(-1).values)


@pytest.mark.parametrize("bits", [8, 16])
def test_sr_draws_independent_across_elements_tiles_and_rows(bits, monkeypatch):
    """Every element of a multi-tile tensor, row-wise, column-wise and column-wise in a batch of
    two (A = 2), draws from its own counter: with f = 0.5 (2.5 on UFP4's grid, scale 1) each
    element's up/down decisions over 40 seeds form a 40-bit pattern, and no two patterns are equal
    (a counter, a Philox word or a byte used twice, within a tile, across tiles, rows or the batch,
    gives equal patterns; test_uniform_uses_each_random_bit_once checks the bits within a counter).
    Neighbouring elements along and across the blocks are also uncorrelated."""
    monkeypatch.setattr(kernels, "SR_BITS", bits)
    x = torch.full((32, 128), 2.5)
    x[:, ::16] = 7.0  # one exact 7 per block: scale 1
    x3 = torch.full((2, 32, 32), 2.5)
    x3[:, ::16] = 7.0
    seeds = range(40)
    # 2 x 2 tiles of x either way; x3 along dim 1: 2 tiles along N, A = 2
    for xx, dim, cfg in ((x, 1, (16, 64, 4)), (x.t().contiguous(), 0, (64, 16, 4)), (x3, 1, (32, 16, 4))):
        up = []
        for s in seeds:
            y = kernels.fake_quant(xx, "ufp4", dim=dim, rounding="sr", seed=s, dtype=torch.float32, _cfg=cfg)
            assert ((y == 2) | (y == 3))[xx == 2.5].all() and (y[xx == 7] == 7).all()
            up.append((y == 3).long())
        up = torch.stack(up)  # [seed, *xx.shape]
        shift = torch.arange(len(seeds)).view(-1, *[1] * xx.dim())
        pattern = (up << shift).sum(0)[xx == 2.5]
        assert pattern.unique().numel() == pattern.numel(), f"{tuple(xx.shape)} dim={dim}: elements share random bits"
        assert abs(up[:, xx == 2.5].float().mean().item() - 0.5) < 0.03
        if xx.dim() == 2:
            pm = (2 * up - 1).float()
            pm[:, xx == 7] = 0  # pairs with an exact element have no randomness
            along = (pm[:, :, 1:] * pm[:, :, :-1]).mean((0, 1))  # columns j, j+1 across seeds and rows
            across = (pm[:, 1:, :] * pm[:, :-1, :]).mean((0, 2))  # rows i, i+1 across seeds and columns
            assert along.abs().max() < 0.15 and across.abs().max() < 0.15, (dim, along.abs().max(), across.abs().max())


def test_sr_seeds_and_consistency():
    x = randn(64, 64, seed=11)
    for name in ("nvfp4", "ufp4"):
        a = kernels.fake_quant(x, name, rounding="sr", seed=1, dtype=torch.float32)
        b = kernels.fake_quant(x, name, rounding="sr", seed=1, dtype=torch.float32)
        c = kernels.fake_quant(x, name, rounding="sr", seed=2, dtype=torch.float32)
        assert_same(a, b)
        assert not torch.equal(a, c)
        # 64-bit seeds stay apart: 0 and 2^31 - 1, and step * 2^32 + layer (2^32 + 0 and 0 + 2),
        # met modulo 2^31 - 1
        for s1, s2 in ((0, 2**31 - 1), (2, 2**32)):
            assert not torch.equal(kernels.fake_quant(x, name, rounding="sr", seed=s1),
                                   kernels.fake_quant(x, name, rounding="sr", seed=s2))
        # the packed path draws the same bits for the same seed
        q = kernels.quantize(x, name, rounding="sr", seed=1)
        assert_same(kernels.dequantize(q, torch.float32), a)
        # the reference's scales, and every draw one of the two grid levels around x
        assert_same(q.scales, fp4.quantize(x, name).scales)
        assert_grid_neighbours(a, x, name, name)
        # column-wise SR with seeds
        ca = kernels.quantize_both(x, name, rounding="sr", seed=3, seed_col=4, rht_col=16,
                                   dtype=torch.float32)
        cb = kernels.quantize_both(x, name, rounding="sr", seed=3, seed_col=4, rht_col=16,
                                   dtype=torch.float32)
        assert_same(ca[0], cb[0])
        assert_same(ca[1], cb[1])


def test_sr_on_grids_of_several_uniform_pieces(monkeypatch):
    """SR on a grid of two or three uniform pieces (no format uses one yet; the kernels take up
    to three): every value lands on one of the two grid levels around x / scale, most often the
    nearer one, and the packed path draws the same values; RTNE equals the reference."""
    grids = {"pieces2": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0),
             "pieces3": (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 4.0, 6.0)}
    for name, levels in grids.items():
        monkeypatch.setitem(fp4.GRIDS, name, fp4.Grid(name, levels))
        fmt = f"{name}/16/fp32"
        x = randn(64, 64, seed=17)
        assert_same(kernels.fake_quant(x, fmt, dtype=torch.float32), fp4.fake_quant(x, fmt, dtype=torch.float32))
        scale, t, lo, hi = grid_neighbours(x, fmt)
        near = torch.where(t - lo <= hi - t, lo, hi)
        hits, seen_lo, seen_hi = 0, torch.zeros_like(t, dtype=torch.bool), torch.zeros_like(t, dtype=torch.bool)
        for seed in range(8):
            y = kernels.fake_quant(x, fmt, rounding="sr", seed=seed, dtype=torch.float32)
            m = y.abs() / scale  # (the level, to an ulp of the fp32 scale's round trip)
            on = lambda v: (m - v).abs() <= 1e-5 * levels[-1]  # noqa: E731
            assert (on(lo) | on(hi)).all(), (name, seed)
            hits += on(near).float().mean().item() / 8
            seen_lo, seen_hi = seen_lo | on(lo), seen_hi | on(hi)
            assert_same(kernels.dequantize(kernels.quantize(x, fmt, rounding="sr", seed=seed), torch.float32), y)
        assert hits > 0.6, (name, hits)
        # random, not nearest: 8 draws of a value between two levels give both for about 7 in 9
        both = (seen_lo & seen_hi)[hi > lo].float().mean().item()
        assert both > 0.5, (name, both)


def test_sr_saturates_blocks_with_subnormal_scales():
    # amax / qmax below the normal range loses bits, so x / scale can pass qmax: SR must still
    # saturate (a code past qmax would flip the sign when packed), packed and fake agreeing
    tiny = 2.0 ** -149
    x = torch.zeros(64, 16)
    x[:, 0], x[:, 1] = 10 * tiny, 3 * tiny
    # ufp4: scale 10/7 tiny rounds to 1 tiny, x / scale = 10 saturates to 7; e2m1: 10/6 rounds to
    # 2 tiny, x / scale = 5 draws 4 or 6 (codes 6, 7)
    for name, amax_codes in (("ufp4", {7}), ("e2m1", {6, 7})):
        q = kernels.quantize(x, name, rounding="sr", seed=1)
        codes = fp4.unpack_codes(q.codes).reshape(x.shape)
        assert set(codes[:, 0].tolist()) == amax_codes and not (codes & 8).any(), name
        fake = kernels.fake_quant(x, name, rounding="sr", seed=1, dtype=torch.float32)
        assert_same(fake, kernels.dequantize(q, torch.float32), name)
        assert (fake <= fp4.GRIDS[fp4.FORMATS[name].grid].qmax * q.scales.repeat_interleave(16, -1)).all()


def test_tensor_seed_read_on_device_gives_the_int_seeds_bits():
    # the layer ops pass seeds as device tensors (views into one int64 [6]), which a CUDA graph
    # replays afresh: the kernel must draw exactly what the same int seed draws
    x = randn(64, 96, seed=12)
    seeds = torch.arange(6) + 977
    for dim, name in ((1, "ufp4"), (0, "nvfp4")):
        want = kernels.fake_quant(x, name, dim=dim, rounding="sr", rht=16, seed=982, dtype=torch.float32)
        got = kernels.fake_quant(x, name, dim=dim, rounding="sr", rht=16, seed=seeds[5], dtype=torch.float32)
        assert_same(got, want)
        q = kernels.quantize(x, name, dim=dim, rounding="sr", rht=16, seed=seeds[5])
        assert_same(kernels.dequantize(q, torch.float32), want)
        assert not torch.equal(got, kernels.fake_quant(x, name, dim=dim, rounding="sr", rht=16,
                                                       seed=seeds[4], dtype=torch.float32))
    row, col = kernels.quantize_both(x, "ufp4", rounding="sr", seed=seeds[0], seed_col=seeds[1],
                                     dtype=torch.float32)
    assert_same(row, kernels.fake_quant(x, "ufp4", 1, "sr", seed=977, dtype=torch.float32))
    assert_same(col, kernels.fake_quant(x, "ufp4", 0, "sr", seed=978, dtype=torch.float32))
    with pytest.raises(ValueError, match="one integer"):
        kernels.fake_quant(x, "ufp4", rounding="sr", seed=seeds)


@pytest.mark.parametrize("heavy", [False, True])
def test_tile_shapes_fit_the_blocks(heavy):
    # every default tile holds whole blocks (and RHT chunks) of the side(s) it quantizes
    for M, N in ((16384, 2304), (16384, 3072), (768, 3072), (64, 96), (16, 16)):
        for row, col in ((16, None), (32, None), (None, 16), (None, 32), (16, 16), (32, 32),
                         (64, None), (128, None), (None, 64), (None, 128)):
            for packed in (False, True):
                BM, BN, nw, mode = kernels._tile(M, N, row, col, esize=2, heavy=heavy, packed=packed)
                assert BN % (row or 1) == 0 and BM % (col or 1) == 0, (M, N, row, col, BM, BN)
                assert nw in (4, 8) and mode in (0, 1)


@pytest.mark.parametrize("name", FORMATS)
def test_packed_column_side_alone_on_16_bit_input(name):
    # the 128 x 64 tile of a packed column side (kernels._tile): every format, RHT sizes, 2D
    # blocks, fewer rows than the tile
    for shape in ((64, 96), (160, 64)):
        for rht in (None, 32):
            for b2d in (False, True):
                x = randn(*shape, seed=3, dtype=torch.bfloat16)
                fmt = fmt_of(name, b2d)
                assert kernels._tile(*shape, None, math.lcm(rht or 1, fmt.block, 16), esize=2, packed=True)[:2] == (128, 64)
                check_rtne(x, fmt, 0, rht, dtypes=(torch.bfloat16,))


def test_heavy_tiles_only_for_sr_on_e2m1_with_fp32_scales(monkeypatch):
    # 16-row tiles help e2m1's SR, hurt ufp4's and nvfp4's (docs/kernels.md, tiles)
    x = randn(64, 128, seed=13)
    seen = []
    real, sig = kernels._tile, inspect.signature(kernels._tile)

    def spy(*a, **k):  # heavy, for the calls with a column side
        args = sig.bind(*a, **k)
        args.apply_defaults()
        if args.arguments["col"]:
            seen.append(args.arguments["heavy"])
        return real(*a, **k)
    monkeypatch.setattr(kernels, "_tile", spy)
    for name, rounding in (("e2m1", "sr"), ("e2m1", "rtne"), ("ufp4", "sr"), ("nvfp4", "sr")):
        kernels.fake_quant(x, name, dim=0, rounding=rounding, seed=1, dtype=torch.float32)
    monkeypatch.undo()
    assert seen == [True, False, False, False]
    assert kernels._tile(16384, 2304, None, 16, heavy=True)[:2] == (16, 128)


def test_launch_cache_reuses_a_compiled_kernel_only_for_the_same_specialization(monkeypatch):
    # the GPU launch path (_launch's fast path, _quant_meta), with compilation stubbed: a wrong
    # cache hit would run a kernel compiled for other constexprs (silently wrong on the GPU)
    compiled = []

    class Compiled:
        def __init__(self, meta):
            self.meta, self.launches = meta, []

        def __getitem__(self, grid):
            return lambda *args: self.launches.append(args)

    def run(*args, grid=None, warmup=False, **meta):
        compiled.append(Compiled(meta))
        return compiled[-1]
    monkeypatch.setattr(kernels, "INTERPRET", False)
    monkeypatch.setattr(kernels, "_FAST", {})
    monkeypatch.setattr(kernels._quant_kernel, "run", run)
    x = randn(64, 128, seed=14)
    seeds = torch.arange(6) + 5
    calls = [("ufp4", "rtne", 3), ("ufp4", "rtne", 3), ("e2m1", "rtne", 3), ("ufp4", "sr", 3),
             ("ufp4", "sr", 4), ("ufp4", "sr", seeds[2]), ("ufp4", "sr", seeds[4]), ("ufp4", "sr", seeds[1])]
    for name, rounding, seed in calls:
        kernels.fake_quant(x, name, rounding=rounding, seed=seed, dtype=torch.float32)
    kernels.fake_quant(randn(64, 256, seed=15), "ufp4", rounding="rtne", dtype=torch.float32)
    # compiles: ufp4 rtne, e2m1 rtne, ufp4 sr with an int seed, ufp4 sr with a seed in memory at a
    # 16-byte aligned address (seeds[2], seeds[4]) and at an unaligned one (seeds[1]: Triton
    # specializes pointers on alignment), ufp4 rtne on a wider x (the row length is a constant)
    assert len(compiled) == 6
    assert [c.meta["R_SR"] for c in compiled] == [False, False, True, True, True, False]
    assert [c.meta["R_SEEDPTR"] for c in compiled] == [False, False, False, True, True, False]
    assert [c.meta["N"] for c in compiled] == [128] * 5 + [256]
    assert compiled[0].meta["R_NSEG"] == 1 and compiled[1].meta["R_NSEG"] == 3
    # cache hits pass the constexprs in the kernel's argument order, as the compile saw them
    names = kernels._quant_kernel.arg_names
    for c in compiled:
        for args in c.launches:
            n = len(args) - sum(1 for k in names if k in c.meta)
            assert tuple(args[n:]) == tuple(c.meta[k] for k in names[n:])
    assert [len(c.launches) for c in compiled] == [1, 0, 1, 1, 0, 0]  # the first launch is the compile's


# -----------------------------------------------------------------------------
# The quantized layer with its quantizers dispatched to the kernels (what CUDA runs)

def _layer_grads(recipe, counts=None, tokens=40):
    """y, dx, dW of fp4.fp4_linear (dense, or grouped with counts) on fixed data."""
    g = torch.Generator().manual_seed(16)
    x = torch.randn(tokens, 64, generator=g).requires_grad_()
    w_shape = (32, 64) if counts is None else (len(counts), 32, 64)
    w = torch.randn(*w_shape, generator=g).requires_grad_()
    torch.manual_seed(17)
    y = fp4.fp4_linear(x, w, recipe, counts=counts)
    y.backward(torch.randn(y.shape, generator=g))
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("name", ["ufp4", "nvfp4"])
def test_fp4_linear_through_kernels(name, monkeypatch):
    """Every quantize / fake_quant / dequantize of the layer through kernels.py, Wgrad's x saved
    packed by kernels.quantize and dequantized by kernels.dequantize: the reference's bits
    (RTNE); with SR on x and dy, packed == quantizing x in backward (the same kernel seed)."""
    rtne = fp4.make_recipe(name, sr_dy=False)
    sr = fp4.replace(fp4.RECIPES[name], wgrad=fp4.replace(fp4.RECIPES[name].wgrad, sr_b=True))
    # 64 tokens: x and dy each quantized both ways by one kernel; 40: Wgrad pads them (two calls)
    for counts, tokens in ((None, 64), (None, 40), (torch.tensor([7, 0, 33]), 40)):
        want = _layer_grads(rtne, counts, tokens)
        monkeypatch.setattr(fp4, "kernels_for", lambda t: kernels)
        got = _layer_grads(rtne, counts, tokens)
        for a, b, nm in zip(got, want, ("y", "dx", "dW")):
            if nm == "dx" and counts is not None:  # same operands, but the kernel's Q(W) along
                # dim 1 is contiguous, the reference's a transposed view: the CPU grouped GEMM
                # sums in another order for each layout
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            else:
                assert_same(a, b, f"{name} counts={counts} tokens={tokens} {nm}")
        packed = _layer_grads(sr, counts, tokens)
        monkeypatch.setattr(fp4, "_packs_wgrad_x", lambda recipe, pack_x: False)
        for a, b, nm in zip(_layer_grads(sr, counts, tokens), packed, ("y", "dx", "dW")):
            assert_same(a, b, f"{name} SR counts={counts} tokens={tokens} {nm}")
        monkeypatch.undo()


def test_fp4_linear_reads_x_and_dy_once_with_the_same_bits(monkeypatch):
    """On the Triton path a dense layer quantizes x (Fprop row-wise, Wgrad column-wise packed) and
    dy (Dgrad row-wise, Wgrad column-wise, SR) with one kernel each: the same y, dx, dW bits as
    one call per operand, SR included (the same seeds)."""
    monkeypatch.setattr(fp4, "kernels_for", lambda t: kernels)
    real, calls = kernels.quantize_both, []
    monkeypatch.setattr(kernels, "quantize_both", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    for name in ("ufp4", "nvfp4", "e2m1"):
        calls.clear()
        fused = _layer_grads(fp4.RECIPES[name], tokens=64)
        assert calls == [(64, 64), (64, 32)], calls
        with monkeypatch.context() as m:
            m.setattr(fp4, "_unpadded", lambda *a: False)
            separate = _layer_grads(fp4.RECIPES[name], tokens=64)
        assert len(calls) == 2  # the separate run made no fused call
        for a, b, nm in zip(fused, separate, ("y", "dx", "dW")):
            assert_same(a, b, f"{name} {nm}")
    calls.clear()
    _layer_grads(fp4.RECIPES["ufp4"], tokens=40)  # 40 tokens: Wgrad pads them to 48
    _layer_grads(fp4.RECIPES["ufp4"], torch.tensor([7, 0, 33]))  # experts: Wgrad pads each group
    assert calls == []


# -----------------------------------------------------------------------------
# FP4 GEMM over packed operands

def _bf16_operand(q):
    """What the GEMM multiplies: grid value x block scale rounded to bf16 (no tensor scale)."""
    return fp4.dequantize(dataclasses.replace(q, tensor_scale=None), torch.bfloat16).double()


@pytest.fixture
def tma_paths(monkeypatch):
    """What each fp4_matmul call's _tma_descriptors returned (None: the pointer loads)."""
    paths = []
    find = kernels._tma_descriptors
    monkeypatch.setattr(kernels, "_tma_descriptors", lambda *args: paths.append(find(*args)) or paths[-1])
    return paths


def _check_mm(out, qa, qw, what):
    """out == the operands' bf16 values (value x block scale) multiplied in float64, / tensor
    scales, within fp32 summation error."""
    assert out.shape == (qa.shape[0], qw.shape[0]) and out.dtype == torch.float32
    ref = _bf16_operand(qa) @ _bf16_operand(qw).t()
    mag = _bf16_operand(qa).abs() @ _bf16_operand(qw).abs().t()
    for q in (qa, qw):
        if q.tensor_scale is not None:
            ref, mag = ref / q.tensor_scale.double(), mag / q.tensor_scale.double()
    err = (out.double() - ref).abs()
    assert (err <= 1e-5 * mag + 1e-30).all(), f"{what}: {(err / mag).max()}"


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("K", [128, 96])
def test_fp4_matmul(name, K, tma_paths):
    """K = 128: the operands' rows are 16-byte aligned and the GEMM reads them through TMA
    descriptors; K = 96: the scales' rows (6 fp32) are not, and it falls back to pointer loads."""
    M, N = 40, 48
    a = randn(M, K, seed=12)
    w = randn(N, K, seed=13)
    fa = fmt_of(name)
    fw = fmt_of(name, block_2d=name.startswith("nv"))
    paths = tma_paths
    for rht in (None, 16):
        qa = kernels.quantize(a, fa, rht=rht)
        qw = kernels.quantize(w, fw, rht=rht)
        out = kernels.fp4_matmul(qa, qw, dtype=torch.float32)
        assert (paths[-1] is not None) == (K == 128), f"{name} K={K}: TMA {paths[-1] is not None}"
        _check_mm(out, qa, qw, f"{name} rht={rht}")
        # and vs fake quant + mm, within the bf16 rounding of fp32 block scales
        fq = (fp4.fake_quant(a, fa, rht=rht, dtype=torch.float32).double()
              @ fp4.fake_quant(w, fw, rht=rht, dtype=torch.float32).double().t())
        rel = (out.double() - fq).norm() / fq.norm()
        assert rel < (4e-3 if fa.scale == "fp32" else 1e-5), f"{name}: {rel}"


def test_fp4_matmul_at_the_gpu_tile(monkeypatch, tma_paths):
    """The GPU's 128 x 128 x 128 tile through TMA: M, N and K end inside a tile (the descriptors
    fill past the edges with zeros), 2D-block scales of 16 and of 32, mixed formats; empty
    outputs; codes that are a strided view (copied, not read with the wrong row stride)."""
    monkeypatch.setattr(kernels, "_mm_config", lambda fa, fb: (128, 128, 128, 8, 4, 1))
    paths = tma_paths
    M, N = 136, 224
    # (2D 32-blocks' scale rows are K / 8 bytes: 16-byte aligned only where K % 128 == 0)
    for fa, fw, K in (("ufp4", "ufp4", 192), ("nvfp4", fmt_of("nvfp4", block_2d=True), 192),
                      ("mxfp4", fmt_of("mxfp4", block_2d=True), 384), ("mxfp4", "nvfp4", 192)):
        a, w = randn(M, K, seed=21), randn(N, K, seed=22)
        qa, qw = kernels.quantize(a, fa, rht=16), kernels.quantize(w, fw, rht=16)
        _check_mm(kernels.fp4_matmul(qa, qw, dtype=torch.float32), qa, qw, f"{fa} x {fw}")
        assert paths[-1] is not None, f"{fa} x {fw}: took the pointer loads"
    padded = torch.zeros(N, K // 2 + 8, dtype=torch.uint8)[:, :K // 2]  # rows 104 bytes apart: pointer loads
    qv = dataclasses.replace(qw, codes=padded.copy_(qw.codes))
    _check_mm(kernels.fp4_matmul(qa, qv, dtype=torch.float32), qa, qv, "strided codes")
    for m, n in ((0, N), (M, 0)):
        out = kernels.fp4_matmul(kernels.quantize(a[:m], "ufp4"), kernels.quantize(w[:n], "ufp4"))
        assert out.shape == (m, n)


def _ptx_reference(grid, scales):
    """What the GEMM's dequantize must give for every code byte (low nibble first) and scale:
    sign-magnitude grid value x scale in fp32, rounded to bf16 (bits as int32, 0..0xFFFF).
    On this thread alone: torch's worker threads flush subnormals for good once a train.main()
    in this process has created them (see train.py), and these products go down to 2^-128."""
    c = torch.arange(256)
    levels = torch.tensor(fp4.GRIDS[grid].levels, dtype=torch.float32)
    out, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for nib in (c & 15, c >> 4):
            v = levels[nib & 7] * torch.where(nib >= 8, -1.0, 1.0)
            v = v[:, None] * scales[None, :]
            out.append(bits(v.to(torch.bfloat16)).int() & 0xFFFF)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("asm, grid, scale", [("_DEQ_E2M1_BF16", "e2m1", "e4m3"),
                                               ("_DEQ_E2M1_BF16", "e2m1", "e8m0"),
                                               ("_DEQ_INT4_F32", "int4", "fp32")])
def test_gemm_dequantize_ptx_emulated(asm, grid, scale):
    """The GEMM's dequantize on the GPU is inline PTX, which the interpreter does not run:
    tests/ptx_emu.py runs the same strings instruction by instruction, for every code byte and
    every e4m3 value / every e8m0 power / fp32 scales from tiny to huge, with NaN and 0."""
    import numpy as np
    import ptx_emu
    if scale == "e4m3":
        sc = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    elif scale == "e8m0":
        sc = torch.exp2(torch.arange(-127, 128, dtype=torch.float64)).float()
    else:
        g = torch.Generator().manual_seed(5)
        sc = torch.cat([torch.rand(200, generator=g) * 10.0 ** torch.randint(-38, 38, (200,), generator=g),
                        torch.tensor([0.0, 1e-45, 1.17e-38, 3.4e38, 1.0 / 7.0])]).float()
    sc = torch.cat([sc, torch.tensor([float("nan")])])
    ref_lo, ref_hi = _ptx_reference(grid, sc)
    code = np.repeat(np.arange(256, dtype=np.uint32), len(sc))
    if scale == "fp32":  # the kernel passes the fp32 scale's bits
        s = np.tile(sc.numpy().view(np.uint32), 256)
    else:  # and a bf16 pair of an e4m3 / e8m0 scale (exact in bf16)
        h = (bits(sc.to(torch.bfloat16)).int() & 0xFFFF).numpy().astype(np.uint32)
        s = np.tile(h | (h << 16), 256)
    src = getattr(kernels, asm)
    out = ptx_emu.run(getattr(src, "value", src), {"$2": code, "$3": s})
    for got, ref, half in ((out["$0"], ref_lo, "low"), (out["$1"], ref_hi, "high")):
        got = torch.from_numpy(got.astype(np.int64)).view(256, len(sc))
        ref = ref.long()
        nan = ((ref & 0x7FFF) > 0x7F80)
        assert (((got & 0x7FFF) > 0x7F80) == nan).all(), f"{asm} {half} nibble: NaN positions"
        bad = (got != ref) & ~nan
        assert not bad.any(), (f"{asm} {half} nibble, {scale} scales: {int(bad.sum())} differ, e.g. "
                               f"byte {bad.nonzero()[0, 0].item()}, scale {sc[bad.nonzero()[0, 1]].item()}")


def test_fp4_matmul_bf16_out_and_zero_blocks():
    a = randn(33, 64, seed=14)
    a[5] = 0
    w = randn(17, 64, seed=15)
    qa, qw = kernels.quantize(a, "nvfp4"), kernels.quantize(w, "nvfp4")
    out = kernels.fp4_matmul(qa, qw)
    assert out.dtype == torch.float32 and out.shape == (33, 17)
    assert (out[5] == 0).all()
    qa16 = kernels.quantize(a.bfloat16(), "mxfp4")
    qw16 = kernels.quantize(w.bfloat16(), "mxfp4")
    o16 = kernels.fp4_matmul(qa16, qw16)
    assert o16.dtype == torch.bfloat16
    ref = fp4.dequantize(qa16, torch.float32) @ fp4.dequantize(qw16, torch.float32).t()
    assert ((o16.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()  # ref rounded to bf16


def test_fp4_matmul_rejects_operands_it_cannot_multiply():
    a, w = randn(32, 64, seed=1), randn(16, 64, seed=2)
    qa, qw = kernels.quantize(a, "ufp4"), kernels.quantize(w, "ufp4")
    bad = [((kernels.quantize(a, "ufp4", rht=16), qw), "same RHT"),
           ((qa, kernels.quantize(randn(16, 96, seed=3), "ufp4")), "inner dims differ"),
           ((kernels.quantize(a.t().contiguous(), "ufp4", dim=0), qw), "quantized along dim 1"),
           ((qa, kernels.quantize(randn(2, 16, 64, seed=4), "ufp4")), "2D QTensors"),
           ((dataclasses.replace(qa, scales=qa.scales[:, :2]), qw), "needs uint8 codes"),
           ((qa, dataclasses.replace(qw, codes=qw.codes[:, :16])), "needs uint8 codes")]
    for (x, y), match in bad:
        with pytest.raises(ValueError, match=match):
            kernels.fp4_matmul(x, y)
    with pytest.raises(TypeError, match="expected an fp4.QTensor"):
        kernels.fp4_matmul(a, qw)


def test_module_surface(monkeypatch):
    assert kernels.AVAILABLE == (kernels.HAVE_TRITON and torch.cuda.is_available())
    # SR's default draw is 8 bits: README's figures and tests/test_sass_count.py's SR limits assume it
    assert kernels.SR_BITS == 8
    monkeypatch.setattr(kernels, "SR_BITS", 12)
    with pytest.raises(ValueError, match="8 or 16"):
        kernels.fake_quant(torch.randn(8, 32), "ufp4", rounding="sr", seed=1)
    monkeypatch.undo()
    # the setter (fp4's, next to set_backend) validates and is what the kernels read
    with pytest.raises(ValueError, match="sr_bits must be one of"):
        fp4.set_sr_bits(12)
    assert kernels.SR_BITS == 8
    try:
        fp4.set_sr_bits(16)
        assert kernels.SR_BITS == 16
    finally:
        fp4.set_sr_bits(8)
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        kernels.quantize(torch.randn(8, 24), "ufp4")
    with pytest.raises(ValueError, match="unknown rounding 'up'"):
        kernels.fake_quant(torch.randn(8, 32), "ufp4", rounding="up")


# -----------------------------------------------------------------------------
# FP8 operands (power-of-two block scales)

@pytest.mark.parametrize("name", ["mxfp4", "mxint4", "int4/16/e8m0"])
@pytest.mark.parametrize("fp8", [fp4.E4M3, fp4.E5M2])
@pytest.mark.parametrize("dim,rht", [(-1, None), (0, None), (-1, 16), (0, 32)])
def test_to_fp8_matches_reference(name, fp8, dim, rht):
    torch.manual_seed(zlib.crc32(f"{name} {fp8} {dim} {rht}".encode()))  # hash() differs per process
    # rows spread over 2^-12..2^12: some blocks fall out of e4m3's window (same bits all the same)
    x = (torch.randn(64, 96) * torch.exp2(torch.randint(-12, 12, (64, 1)).float())).to(torch.bfloat16)
    v, s = kernels.to_fp8(x, name, dim=dim, rht=rht, fp8=fp8)
    rv, rs = fp4.to_fp8(x, name, dim=dim, rht=rht, fp8=fp8)
    assert v.dtype == fp8 and v.shape == x.shape and v.stride() == rv.stride()
    assert v.stride(dim) == 1, "the blocked dim is contiguous (the FP8 GEMM's operand layout)"
    assert torch.equal(bits(v), bits(rv)) and torch.equal(s, rs)


@pytest.mark.parametrize("name", ["mxfp4", "mxint4"])
def test_to_fp8_blocks_far_below_the_top(name):
    """Blocks down to fp32's subnormals, 200 binades below the tensor's top: the kernel folds the
    inverse tensor scale into each block's scale, whose products differ from the reference's only
    below fp32's normal range, where FP8 gives +-0 either way; zero rows keep their sign."""
    torch.manual_seed(5)
    x = torch.randn(64, 96) * torch.exp2(torch.randint(-150, 60, (64, 1)).float())
    x[7] = -0.0
    for dim in (-1, 0):
        for fp8 in (fp4.E4M3, fp4.E5M2):
            v, s = kernels.to_fp8(x, name, dim=dim, fp8=fp8)
            rv, rs = fp4.to_fp8(x, name, dim=dim, fp8=fp8)
            assert torch.equal(bits(v), bits(rv)) and torch.equal(s, rs), (dim, fp8)
            (a, sa), (b, sb) = kernels.quantize_both(x, name, fp8=fp8)
            assert torch.equal(bits(a), bits(fp4.to_fp8(x, name, dim=-1, fp8=fp8)[0]))
            assert torch.equal(bits(b), bits(fp4.to_fp8(x, name, dim=0, fp8=fp8)[0]))


def test_to_fp8_tiny_tensors():
    """A tensor near or below fp32's smallest normal: its power-of-two scale stops at 2^-126
    rather than going subnormal; the same bits and scale as the reference (at 2^-140 every block
    scale is e8m0's smallest and the values round to zero)."""
    torch.manual_seed(6)
    for name in ("mxfp4", "mxint4"):
        for tiny in (2.0 ** -120, 2.0 ** -140):
            x = torch.randn(32, 64) * tiny
            for dim, fp8, rht in ((-1, fp4.E4M3, None), (0, fp4.E5M2, None), (0, fp4.E4M3, 16)):
                v, s = kernels.to_fp8(x, name, dim=dim, rht=rht, fp8=fp8)
                rv, rs = fp4.to_fp8(x, name, dim=dim, rht=rht, fp8=fp8)
                what = f"{name} {tiny} dim={dim} {fp8} rht={rht}"
                assert torch.equal(bits(v), bits(rv)) and torch.equal(s, rs), what
                assert 2.0 ** -126 <= s.item() <= 2.0 ** -125, what
                assert v.float().any() == (tiny > 2.0 ** -126), what


@pytest.mark.parametrize("name", ["mxfp4", "mxint4"])
def test_to_fp8_sr_and_pair_equal_fake_quant(name):
    """SR draws differ from the reference's: the kernel's FP8 values times the scale equal its own
    fake_quant with the same seed; quantize_both gives both sides from one read."""
    x = torch.randn(64, 128).to(torch.bfloat16)
    (a, sa), (b, sb) = kernels.quantize_both(x, name, rounding="sr", rht_col=16, seed=7,
                                             seed_col=7, fp8=(fp4.E5M2, fp4.E5M2))
    fa = kernels.fake_quant(x, name, dim=1, rounding="sr", seed=7, dtype=torch.float32)
    fb = kernels.fake_quant(x, name, dim=0, rounding="sr", rht=16, seed=7, dtype=torch.float32)
    assert_same(a.float() * sa, fa, "row")
    assert_same(b.float() * sb, fb, "col")
    v, s = kernels.to_fp8(x, name, dim=0, rounding="sr", rht=16, seed=7, fp8=fp4.E5M2)
    assert torch.equal(bits(v), bits(b)) and torch.equal(s, sb)


@pytest.mark.parametrize("name", ["mxfp4", "mxint4", "int4/16/e8m0"])
@pytest.mark.parametrize("fp8,scale", [(fp4.E5M2, 1.0), (fp4.E4M3, 2.0 ** -3)])
@pytest.mark.parametrize("dim,rht", [(-1, None), (0, 16)])
def test_to_fp8_at_a_given_scale_matches_reference(name, fp8, scale, dim, rht):
    """A given decode scale (Fprop's x under fp8_x_scale 'unit'): no amax pass, the reference's
    bits; blocks above the scale's window are NaN (never clipped), blocks inside it equal
    fake_quant, blocks below it round to FP8's subnormals; quantize_both gives the same."""
    torch.manual_seed(zlib.crc32(f"{name} {fp8} {dim} {rht}".encode()))
    spread = torch.randint(-26, 22, (64, 1) if dim else (1, 96)).float()   # per block, not in it
    x = (torch.randn(64, 96) * torch.exp2(spread)).to(torch.bfloat16)
    v, s = kernels.to_fp8(x, name, dim=dim, rht=rht, fp8=fp8, scale=scale)
    rv, rs = fp4.to_fp8(x, name, dim=dim, rht=rht, fp8=fp8, scale=scale)
    assert v.dtype == fp8 and v.stride() == rv.stride() and s.item() == rs.item() == scale
    assert torch.equal(bits(v), bits(rv))   # NaN bytes too
    fake = fp4.fake_quant(x.float(), name, dim=dim, rht=rht)
    top = fake.abs().movedim(dim, -1).reshape(64 if dim else 96, -1, fp4.get_format(name).block).amax(-1)
    blocks = (rv.float() * rs).movedim(dim, -1).reshape(top.shape + (-1,))
    over = top > 7 * scale * 2.0 ** fp4.FP8_ROOM[fp8]   # (the largest grid value is 6 or 7)
    assert over.any() and blocks[over].isnan().all() and not blocks[~over].isnan().any()
    room, window = scale * 2.0 ** fp4.FP8_ROOM[fp8], {fp4.E4M3: 15, fp4.E5M2: 29}[fp8]  # (binades)
    inside = (top <= 6 * room) & (top >= room * 2.0 ** (4 - window))
    exact = (blocks == fake.movedim(dim, -1).reshape(blocks.shape)).all(-1)
    below = top < room * 2.0 ** (-2 - window)
    assert inside.any() and exact[inside].all() and below.any() and not exact[below].all()
    both = dict(rht=None, rht_col=rht, fp8=fp8, fp8_scale=(scale, None) if dim else (None, scale))
    (a, sa), (b, sb) = kernels.quantize_both(x, name, **both)
    given, amaxed = ((a, sa), (b, sb)) if dim else ((b, sb), (a, sa))
    assert torch.equal(bits(given[0]), bits(v)) and given[1].item() == scale and amaxed[1].item() != scale
    for got, want in zip((a, sa, b, sb), (t for side in fp4.quantize_both(x, name, **both) for t in side)):
        assert torch.equal(bits(got), bits(want)), "fp4.quantize_both (the reference) gives the same"


@pytest.mark.parametrize("name", ["mxfp4", "mxint4"])
def test_to_fp8_at_a_given_scale_keeps_the_window_top(name):
    """e5m2 at scale 1: a block scale of 2^13 is the window's top (its largest value 57344 for the
    int4 grid, 49152 for e2m1; block maxima up to just under 2^16 clip to them as fake_quant does);
    2^14 is NaN."""
    x = torch.randn(4, 64) * 0.1
    x[0, 0], x[1, 0], x[2, 0], x[3, 32] = 7 * 2.0 ** 13, 65535.0, 65536.0, 6 * 2.0 ** 13
    v, s = kernels.to_fp8(x, name, fp8=fp4.E5M2, scale=1.0)
    rv, _ = fp4.to_fp8(x, name, fp8=fp4.E5M2, scale=1.0)
    assert torch.equal(bits(v), bits(rv))
    nan = v.float().isnan().view(4, 2, 32).all(-1)
    assert nan.tolist() == [[False, False], [False, False], [True, False], [False, False]]
    kept = ~v.float().isnan()
    assert torch.equal(v.float()[kept], fp4.fake_quant(x, name)[kept])
    assert v.float()[kept].abs().max() == (7 if name == "mxint4" else 6) * 2.0 ** 13


@pytest.mark.parametrize("special", [float("nan"), float("inf")])
def test_to_fp8_at_a_given_scale_on_nonfinite_and_empty_tensors(special):
    """At a given scale a NaN or Inf makes its own block NaN (the reference's bits; the scale
    stays the one given, and so do the other blocks); an empty tensor gets the given scale."""
    x = torch.randn(32, 64)
    x[3, 5] = special
    for dim in (0, -1):
        v, s = kernels.to_fp8(x, "mxint4", dim=dim, fp8=fp4.E5M2, scale=0.5)
        rv, rs = fp4.to_fp8(x, "mxint4", dim=dim, fp8=fp4.E5M2, scale=0.5)
        nan = rv.float().isnan()
        assert s.item() == rs.item() == 0.5 and nan.sum() == 32 and nan[3, 5]
        assert torch.equal(bits(v), bits(rv))
    assert kernels.to_fp8(torch.zeros(0, 64), "mxfp4", fp8=fp4.E5M2, scale=2.0)[1].item() == 2.0


def test_to_fp8_given_scale_errors():
    x = torch.randn(32, 64)
    for bad in (3.0, 0.0, -1.0, float("inf"), True, 2.0 ** -140, 2.0 ** 127):
        for f in (fp4.to_fp8, kernels.to_fp8):
            with pytest.raises(ValueError, match="power of two"):
                f(x, "mxfp4", fp8=fp4.E5M2, scale=bad)
    with pytest.raises(ValueError, match="not FP8"):
        kernels.quantize_both(x, "mxfp4", packed=(False, True), fp8=(fp4.E5M2, None),
                              fp8_scale=(1.0, 1.0))


@pytest.mark.parametrize("special", [float("nan"), float("inf")])
def test_to_fp8_zero_empty_and_nonfinite_tensors(special):
    for z in (torch.zeros(32, 64), torch.zeros(0, 64)):
        v, s = kernels.to_fp8(z, "mxfp4")
        assert s.item() == 1.0 and not v.float().any()
    x = torch.randn(32, 64)
    x[3, 5] = special
    for dim, fp8 in ((0, fp4.E4M3), (-1, fp4.E5M2)):
        v, s = kernels.to_fp8(x, "mxint4", dim=dim, fp8=fp8)
        rv, rs = fp4.to_fp8(x, "mxint4", dim=dim, fp8=fp8)
        assert s.isnan() and rs.isnan(), "a non-finite tensor gets a NaN scale, never a finite one"
        assert torch.equal(bits(v), bits(rv))


@pytest.mark.parametrize("name", ["mxfp4", "mxint4"])
def test_fp8_from_packed_through_kernels(name, monkeypatch):
    """kernels.fp8_from_packed (the scales' max, then the dequantize kernel writing the FP8 values
    and the scale; or with that max given): the reference's bits and scale, blocks out of e4m3's
    window included (rows over 2^-12..2^12, one block 2^-30 below; rows over 2^-150..2^60);
    zero, empty, NaN and tiny tensors."""
    x = torch.randn(64, 96) * torch.exp2(torch.randint(-12, 12, (64, 1)).float())
    x[:32, 7] *= 2.0 ** -30
    nan = x.clone()
    nan[5, 9] = float("nan")
    # blocks 200 binades below the top: the kernel folds the FP8 scale into the block scales,
    # whose products go below fp32's normal range there (FP8: +-0 either way)
    wide = torch.randn(64, 96) * torch.exp2(torch.randint(-150, 60, (64, 1)).float())
    wide[3] = -0.0
    cases = [(x, 0, 16, fp4.E4M3), (x, -1, None, fp4.E5M2), (x, 0, None, fp4.E4M3),
             (torch.zeros(64, 32), 0, None, fp4.E4M3), (torch.zeros(0, 32), -1, None, fp4.E4M3),
             (nan, 0, None, fp4.E5M2), (wide, 0, None, fp4.E4M3), (wide, -1, None, fp4.E5M2),
             (torch.randn(64, 32) * 2.0 ** -125, -1, None, fp4.E4M3)]  # the FP8 scale stops at 2^-126
    for x, dim, rht, fp8 in cases:
        q = fp4.quantize(x, name, dim=dim, rht=rht)
        want = fp4.fp8_from_packed(q, fp8)
        with monkeypatch.context() as m:
            m.setattr(fp4, "kernels_for", lambda t: kernels)
            got = fp4.fp8_from_packed(q, fp8)
            given = fp4.fp8_from_packed(q, fp8, top=fp4.largest_block_scale(q))  # (no pass for it)
        for g, how in ((got, ""), (given, " (largest scale given)")):
            assert g[0].stride() == want[0].stride() and g[0].dtype == fp8
            assert torch.equal(bits(g[0]), bits(want[0])), f"{name} dim={dim} values{how}"  # NaN bytes too
            assert torch.equal(bits(g[1]), bits(want[1])), f"{name} dim={dim} scale{how}"


@pytest.mark.parametrize("wgrad_x", ["packed", "fp8"])
def test_fp8_layer_through_kernels_keeps_x_packed(monkeypatch, wgrad_x):
    """A layer on FP8 GEMMs through kernels.py: Wgrad's x saved packed (codes and scales, no FP8
    copy), turned into FP8 by the dequantize kernel in backward, or saved as FP8 (fp8_wgrad_x):
    the reference's y, dx, dW bits, with x quantized by one kernel for both GEMMs (64 tokens) or
    by two (40, padded for Wgrad)."""
    r = fp4.make_recipe("mxint4", fp8_gemm=True, sr_dy=False, fp8_wgrad_x=wgrad_x)
    for tokens in (64, 40):
        want = _layer_grads(r, None, tokens)
        with monkeypatch.context() as m:
            m.setattr(fp4, "kernels_for", lambda t: kernels)
            got = _layer_grads(r, None, tokens)
            lin = fp4.FP4Linear(64, 32, bias=False, recipe=r)
            padded = tokens + (-tokens % 32)
            kept = padded * 64 // 2 + padded // 32 * 64 * 2 if wgrad_x == "packed" else padded * 64 + 4
            assert fp4.saved_bytes(lin, torch.randn(tokens, 64)) == kept + 6 * 8
        for a, b, nm in zip(got, want, ("y", "dx", "dW")):
            assert_same(a, b, f"{tokens} tokens {nm}")


def test_packed_weight_cache_through_kernels(monkeypatch):
    """fp8_weight_cache='packed': the weight's cached codes and scales made FP8 by the dequantize
    kernel in each call give the reference's FP8 cache's y, dx, dW bit for bit (dy rounded to
    nearest: the kernels' SR draws differ from the reference's), with the cached largest block
    scales: no pass over the weight's scales in a call (the flat amax launches of the FP8 cache:
    dy's and Wgrad's packed x's)."""
    outs, launches = [], []
    real = kernels._flat_amax
    monkeypatch.setattr(kernels, "_flat_amax", lambda *a, **k: launches.append(1) or real(*a, **k))
    for cache, through_kernels in (("fp8", True), ("packed", True), ("fp8", False)):
        torch.manual_seed(3)
        recipe = fp4.make_recipe("mxfp4", fp8_gemm=True, sr_dy=False, fp8_weight_cache=cache)
        lin = fp4.FP4Linear(64, 32, bias=False, recipe=recipe)
        x = torch.randn(40, 64, requires_grad=True)
        with monkeypatch.context() as m:
            if through_kernels:
                m.setattr(fp4, "kernels_for", lambda t: kernels)
            assert fp4.cache_weights(lin) == 1
            launches.clear()
            y = lin(x)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(4)))
        assert lin.weight_dgrad.dtype == (torch.uint8 if cache == "packed" else fp4.E4M3)
        outs.append((y.detach(), x.grad, lin.weight.grad, len(launches)))
    assert outs[0][3] == outs[1][3] > 0
    for ref in (outs[0], outs[2]):  # the packed cache on the kernels against the FP8 cache on both
        for a, b, nm in zip(outs[1][:3], ref[:3], ("y", "dx", "dW")):
            assert_same(a, b, nm)


def test_fp8_unit_x_scale_gives_the_same_layer_without_x_amax(monkeypatch):
    """fp8_x_scale='unit': Fprop's x in e5m2 at scale 1 needs no amax pass (one flat amax launch
    fewer per layer call: the weight's and dy's stay), and gives the same y, dx, dW bit for bit as
    e4m3 scaled by x's amax while x's blocks lie in both windows: dense (x quantized for both GEMMs
    by one kernel, or padded for Wgrad) and grouped, on the kernels and on the reference."""
    launches = []
    real = kernels._flat_amax
    monkeypatch.setattr(kernels, "_flat_amax", lambda *a, **k: launches.append(1) or real(*a, **k))
    for counts, tokens in ((None, 64), (None, 40), (torch.tensor([7, 0, 33]), 40)):
        for through_kernels in (False, True):
            out, n = {}, {}
            for how in ("amax", "unit"):
                r = fp4.make_recipe("mxint4", fp8_gemm=True, fp8_x_scale=how)
                launches.clear()
                with monkeypatch.context() as m:
                    if through_kernels:
                        m.setattr(fp4, "kernels_for", lambda t: kernels)
                    out[how] = _layer_grads(r, counts, tokens)
                n[how] = len(launches)
            what = f"counts={counts} tokens={tokens} kernels={through_kernels}"
            for a, b, nm in zip(out["amax"], out["unit"], ("y", "dx", "dW")):
                assert_same(a, b, f"{what} {nm}")
            assert n["unit"] == n["amax"] - through_kernels, (what, n)


def _state_bits(state):  # a kept NaN amax as one pattern (the kernels store the canonical NaN)
    kept = fp4.step_state_amax(state).reshape(1)
    return torch.cat([torch.where(kept.isnan(), float("nan"), kept).view(torch.int32), state[1:]])


@pytest.mark.parametrize("room", [fp4.FP8_STEP_ROOM, fp4.max_step_room(16)])
def test_step_state_through_kernels(monkeypatch, room):
    """kernels.to_fp8 and quantize_both with a step scale (fp4.StepScale: fp4.step_fp8_scale's),
    at the default room and at the largest with RHT 16: the reference's FP8 values, scales and
    state bit for bit over calls that find the amax, keep it, pass its room (NaN blocks), find it
    again after a reset (a zero tensor, a NaN, an empty one); a pair shares one state (Dgrad's row
    side, Wgrad's column side with RHT; RTNE: the kernels' SR draws differ from the reference's)
    and one amax launch, whose programs leave the state unread once its flag is clear."""
    launches = []
    real = kernels._flat_amax
    monkeypatch.setattr(kernels, "_flat_amax", lambda *a, **k: launches.append(1) or real(*a, **k))
    base = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    nan = base.clone()
    nan[3, 7] = float("nan")
    past = base * 2.0 ** (room + 4)  # past the room, with the RHT's bound's slack
    calls = (base, base * 3, past, "reset", past, torch.zeros(64, 96), "reset", nan, "reset", base[:0])
    states = [fp4.new_step_state("cpu") for _ in range(4)]
    for i, x in enumerate(calls):
        if isinstance(x, str):
            for st in states:
                fp4.reset_step_state(st)
            continue
        got = {}
        for name, mod, (one, pair) in (("ref", fp4, states[:2]), ("kernels", kernels, states[2:])):
            launches.clear()
            one_out = mod.to_fp8(x, "mxint4", fp8=fp4.E5M2, scale=fp4.StepScale(one, room), rht=16)
            pair_out = mod.quantize_both(x, "mxfp4", rht=None, rht_col=16, fp8=fp4.E5M2,
                                         fp8_scale=fp4.StepScale(pair, room))
            got[name] = (one_out, *pair_out, _state_bits(one), _state_bits(pair), len(launches))
        ref, ker = got["ref"], got["kernels"]
        for k, nm in enumerate(("to_fp8", "row", "col")):
            assert_same(ker[k][0].float(), ref[k][0].float(), f"call {i} {nm} values")
            assert_same(ker[k][1], ref[k][1], f"call {i} {nm} scale")
        assert_same(ker[3], ref[3], f"call {i} to_fp8 state")
        assert_same(ker[4], ref[4], f"call {i} pair state")
        assert ker[5] == 2, (i, ker[5])  # one amax call per state
        if i == 2:  # past on base's kept amax: past the room (an amax launch that read x
            assert ker[0][0].float().isnan().any()  # would have raised the kept amax: state above)


def test_fp8_dy_scale_step_through_kernels(monkeypatch):
    """fp8_dy_scale='step' with its quantize calls on the kernels or the reference: the amax
    scale's dx and dW bit for bit over a reset, a second micro-step and another reset (dense with
    dy quantized both ways by one kernel, padded for Wgrad, and grouped), the kernels' states the
    reference's; RTNE dy (the kernels' SR draws differ from the reference's)."""
    for counts, tokens in ((None, 64), (None, 40), (torch.tensor([7, 0, 33]), 40)):
        states = []
        for through_kernels in (False, True):
            out = {}
            for how in ("amax", "step"):
                r = fp4.make_recipe("mxfp4", fp8_gemm=True, sr_dy=False, fp8_dy_scale=how)
                torch.manual_seed(0)
                layer = (fp4.FP4Linear(64, 32, bias=False, recipe=r) if counts is None
                         else fp4.GroupedLinear(3, 64, 32, recipe=r))
                out[how] = []
                with monkeypatch.context() as m:
                    if through_kernels:
                        m.setattr(fp4, "kernels_for", lambda t: kernels)
                    for k, mult in enumerate((1.0, 2.0, 0.5)):
                        if k != 1:
                            fp4.cache_weights(layer)
                        g = torch.Generator().manual_seed(k)
                        x = torch.randn(tokens, 64, generator=g, requires_grad=True)
                        y = layer(x) if counts is None else layer(x, counts)
                        y.backward(torch.randn(y.shape, generator=g) * mult)
                        out[how] += [x.grad, layer.weight.grad.clone()]
                        layer.weight.grad = None
                        if how == "step":
                            states.append(_state_bits(layer.dy_state))
            what = f"counts={counts} tokens={tokens} kernels={through_kernels}"
            for k, (a, b) in enumerate(zip(out["amax"], out["step"])):
                assert_same(b, a, f"{what} #{k}")
        for k, (a, b) in enumerate(zip(states[:3], states[3:])):
            assert_same(b, a, f"counts={counts} tokens={tokens} state #{k}")
            assert a[1] == 0 and a[0] != 0


def test_every_launch_has_a_three_dimensional_grid(monkeypatch):
    """kernels._launch's fast path (GPU only, from a kernel's second call on) launches the compiled
    kernel with grid[0], grid[1] and grid[2]: a shorter grid fails there and nowhere else."""
    real, grids = kernels._launch, []
    monkeypatch.setattr(kernels, "_launch", lambda k, grid, *a, **kw: grids.append((k, grid)) or real(k, grid, *a, **kw))
    monkeypatch.setattr(fp4, "kernels_for", lambda t: kernels)
    for r in (fp4.make_recipe("mxint4", fp8_gemm=True), fp4.RECIPES["nvfp4"], fp4.RECIPES["ufp4"]):
        for tokens in (64, 40):
            _layer_grads(r, None, tokens)
    for r in (fp4.RECIPES["ufp4"], fp4.make_recipe("mxint4", fp8_gemm=True)):
        _layer_grads(r, torch.tensor([7, 0, 33]))
    assert {k.fn.__name__ for k, _ in grids} == {"_amax_kernel", "_quant_kernel", "_dequant_kernel",
                                                 "_flat_amax_kernel", "_grouped_fp8_rows_kernel",
                                                 "_grouped_fp8_k_kernel"}  # all but the packed GEMM's
    assert all(len(g) == 3 for _, g in grids), {k.fn.__name__: g for k, g in grids if len(g) != 3}


def _fp8_grid_values(shape, fp8, seed):
    """FP8 values q * 2^e (q an int in -7..7, e in -2..2): every fp32 sum of their products is
    exact, so any summation order gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-7, 8, shape, generator=g).float()
    return (q * 2.0 ** torch.randint(-2, 3, shape, generator=g).float()).to(fp8)


def test_fp8_grouped_mm_matches_reference():
    """kernels.fp8_grouped_mm == fp4.fp8_grouped_mm (the exact products in fp32) bit for bit, in
    both forms: row groups (Fprop, Dgrad: a row tile spans two groups; an empty group; a last
    tile past the rows) into bf16, and groups along K (Wgrad: K steps cut by group ends, an empty
    group written as zeros; no tokens at all) into fp32; e5m2 x e4m3 operands, the scales applied
    once. (The interpreter sums in fp32 whatever the accumulation mode: the GPU check tests
    fast against promoted.)"""
    counts = torch.tensor([16, 0, 48, 32, 16])  # multiples of 16 along K, as group_multiple makes them
    offs = torch.cumsum(counts, 0).to(torch.int32)
    T = int(counts.sum())
    sa, sb = torch.tensor(2.0 ** -3), torch.tensor(2.0 ** 5)
    a = (_fp8_grid_values((T, 64), fp4.E5M2, 1), sa)
    b = (_fp8_grid_values((5, 48, 64), fp4.E4M3, 2).transpose(1, 2), sb)  # [E, K, M], K contiguous
    row_offs = torch.cumsum(torch.tensor([5, 0, 21, 50, 36]), 0).to(torch.int32)  # any row counts
    got = kernels.fp8_grouped_mm(a, b, row_offs, torch.bfloat16)
    want = fp4.fp8_grouped_mm(a, b, row_offs, torch.bfloat16)
    assert got.shape == (T, 48) and got.dtype == torch.bfloat16
    assert_same(got, want, "row groups")
    at = (_fp8_grid_values((40, T), fp4.E5M2, 3), sa)
    bt = (_fp8_grid_values((24, T), fp4.E4M3, 4).t(), sb)  # [T, N], T contiguous
    got = kernels.fp8_grouped_mm(at, bt, offs, torch.float32)
    want = fp4.fp8_grouped_mm(at, bt, offs, torch.float32)
    assert got.shape == (5, 40, 24) and not got[1].any()
    assert_same(got, want, "groups along K")
    none = kernels.fp8_grouped_mm((at[0][:, :0], sa), (bt[0][:0], sb), torch.zeros(5, dtype=torch.int32),
                                  torch.float32)
    assert none.shape == (5, 40, 24) and not none.any()
    with pytest.raises(ValueError, match="K contiguous"):
        kernels.fp8_grouped_mm(a, (b[0].contiguous(), sb), row_offs, torch.bfloat16)
    with pytest.raises(ValueError, match="T contiguous"):
        kernels.fp8_grouped_mm(at, (bt[0].contiguous(), sb), offs, torch.float32)
    # a narrower view, or group ends that stop short, run past or are too few, are refused
    # (the kernels would read past them: a full-size product or unwritten rows, no error)
    wide = (_fp8_grid_values((T, 128), fp4.E5M2, 5), sa)
    for args, msg in (((( wide[0][:, :32], sa), b, row_offs), "do not multiply"),
                      ((at, (bt[0][:T - 16], sb), offs), "do not multiply"),
                      ((a, b, row_offs - 8), r"must rise from 0 to 112"),
                      ((a, b, row_offs[:4]), "must be 5 group ends"),
                      ((a, b, row_offs.clone().index_fill_(0, torch.tensor([4]), 4096)), "must rise"),
                      ((at, bt, offs + 16), "to at most 112 in multiples of 16"),
                      ((at, bt, offs.flip(0)), "must rise"),
                      ((at, bt, offs - 1), "in multiples of 16"),
                      ((a, (b[0][:0], sb), torch.zeros(0, dtype=torch.int32)), "must rise from 0 to 112")):
        with pytest.raises(ValueError, match=msg):
            kernels.fp8_grouped_mm(*args, torch.float32)


def _grouped_grads(recipe, counts, aligned):
    """y, dx, dW of a GroupedLinear (3 experts, 64 -> 32) on fixed data."""
    g = torch.Generator().manual_seed(16)
    x = torch.randn(int(counts.sum()), 64, generator=g).requires_grad_()
    torch.manual_seed(17)
    layer = fp4.GroupedLinear(3, 64, 32, recipe=recipe)
    y = layer(x, counts, aligned=aligned)
    y.backward(torch.randn(y.shape, generator=g))
    return y.detach(), x.grad, layer.weight.grad


def test_fp8_experts_through_kernels(monkeypatch):
    """GroupedLinear's three GEMMs on FP8 operands through kernels.py (the quantize kernels and
    the grouped FP8 GEMM) == the torch reference: y, dx, dW to fp32 summation order, with
    unaligned groups (the layer pads Wgrad's) and aligned ones (x and dy quantized both ways by
    one kernel each); the FP8 GEMM runs three times a call."""
    r = fp4.make_recipe("mxint4", fp8_gemm=True, sr_dy=False)
    calls = []
    real = kernels.fp8_grouped_mm
    monkeypatch.setattr(kernels, "fp8_grouped_mm", lambda *a, **k: calls.append(a[0][0].dtype) or real(*a, **k))
    for counts, aligned in ((torch.tensor([7, 0, 33]), False), (torch.tensor([32, 0, 64]), True)):
        want = _grouped_grads(r, counts, aligned)
        with monkeypatch.context() as m:
            m.setattr(fp4, "kernels_for", lambda t: kernels)
            got = _grouped_grads(r, counts, aligned)
        for a, b, nm in zip(got, want, ("y", "dx", "dW")):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=nm)
    assert calls == [fp4.E4M3, fp4.E5M2, fp4.E5M2] * 2  # Fprop's x, Dgrad's dy, Wgrad's dy^T


def test_bad_input_gives_the_references_errors():
    """The kernels' entry points refuse what fp4.py refuses, with its messages."""
    ints = torch.arange(64 * 64, dtype=torch.int32).reshape(64, 64)
    x = torch.randn(64, 64)
    for mod in (kernels, fp4):
        for fn in (mod.quantize, mod.fake_quant, mod.to_fp8, mod.quantize_both):
            with pytest.raises(TypeError, match="floating-point tensor"):
                fn(ints, "mxfp4")
            with pytest.raises(ValueError, match="rht must be None or a Python int RHT size"):
                fn(x, "mxfp4", rht=True)
        for fn in (mod.fake_quant, mod.quantize_both):
            with pytest.raises(TypeError, match="dtype must be None"):
                fn(x, "mxfp4", dtype=torch.int32)
        q = mod.quantize(x, "ufp4")   # dequantize: floats of 16+ bits and the two FP8 dtypes
        for dtype in (torch.int32, torch.bool, "bfloat16"):
            with pytest.raises(TypeError, match="dtype must be None.*use fp8_from_packed"):
                mod.dequantize(q, dtype)
        assert mod.dequantize(q, torch.float8_e5m2).dtype == torch.float8_e5m2
        for fn in (mod.quantize, mod.fake_quant, mod.to_fp8, mod.quantize_both):
            for seed in (2**64, -2**63 - 1, 1.5, True, "7"):
                with pytest.raises(ValueError, match=r"seed must be None, an int in \[-2\*\*63, 2\*\*64\)"):
                    fn(x, "mxfp4", rounding="sr", seed=seed)
            with pytest.raises(ValueError, match="tensor seed must be one integer"):
                fn(x, "mxfp4", rounding="sr", seed=torch.tensor([1.0]))
            for seed in (2**64 - 1, -2**63, np.int64(7), torch.tensor(7)):  # the edges, numpy and tensors pass
                fn(x, "mxfp4", rounding="sr", seed=seed)
        q = fp4.quantize(x, "mxfp4")
        for fn in (mod.dequantize, mod.fp8_from_packed):
            with pytest.raises(ValueError, match="QTensor of shape"):
                fn(dataclasses.replace(q, scales=q.scales[:, :1]))


def test_kernel_outputs_are_outside_autograd():
    x = torch.randn(64, 64, requires_grad=True)
    assert not kernels.fake_quant(x, "ufp4", rht=16).requires_grad
    assert not kernels.quantize(x, "nvfp4").tensor_scale.requires_grad


def test_empty_tensors_match_the_reference():
    for name in ("ufp4", "nvfp4", "mxfp4"):
        e = torch.empty(0, 64)
        assert_qtensor(kernels.quantize(e, name), fp4.quantize(e, name), name)
        assert kernels.fake_quant(e, name).shape == fp4.fake_quant(e, name).shape == (0, 64)
        for mod in (kernels, fp4):  # an empty tensor launches nothing, but its arguments are checked
            with pytest.raises(ValueError, match="unknown rounding 'bogus'"):
                mod.fake_quant(e, name, rounding="bogus")


def test_quantize_both_rejects_a_side_both_packed_and_fp8():
    for mod in (kernels, fp4):
        with pytest.raises(ValueError, match="packed or FP8"):
            mod.quantize_both(torch.randn(64, 64), "mxint4", packed=True, fp8=(fp4.E4M3, None))


# -----------------------------------------------------------------------------
# Writes stay inside the outputs

@pytest.fixture
def write_guard(monkeypatch):
    """Under the interpreter: every store and atomic a kernel makes lands inside one of the tensors
    it was passed. (A write past an output goes unseen by value checks; on the GPU it overwrites
    whatever the allocator put next to it.) Yields a one-element list: the writes checked."""
    from triton.runtime import interpreter as ti
    spans, seen = [], [0]
    call, store, rmw = ti.GridExecutor.__call__, ti.InterpreterBuilder.create_masked_store, \
        ti.InterpreterBuilder.create_atomic_rmw

    def extent(t):
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else -1
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    def guarded_call(self, *args, **kwargs):
        spans[:] = [extent(t) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        return call(self, *args, **kwargs)

    def check(ptrs, mask, size):
        p = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.int64)
        inside = np.zeros(p.shape, bool)
        for lo, hi in spans:
            inside |= (p >= lo) & (p + size <= hi)
        assert inside.all(), f"{(~inside).sum()} of {p.size} writes fall outside the kernel's tensors"
        seen[0] += p.size

    def guarded_store(self, ptrs, value, mask, *a):
        check(ptrs, mask, value.data.dtype.itemsize)
        return store(self, ptrs, value, mask, *a)

    def guarded_rmw(self, op, ptr, val, mask, *a):
        check(ptr, mask, val.data.dtype.itemsize)
        return rmw(self, op, ptr, val, mask, *a)

    monkeypatch.setattr(ti.GridExecutor, "__call__", guarded_call)
    monkeypatch.setattr(ti.InterpreterBuilder, "create_masked_store", guarded_store)
    monkeypatch.setattr(ti.InterpreterBuilder, "create_atomic_rmw", guarded_rmw)
    return seen


def test_write_guard_catches_a_write_past_the_output(write_guard):
    @triton.jit
    def spill(out_ptr, N, BLOCK: tl.constexpr):
        off = tl.arange(0, BLOCK)
        tl.store(out_ptr + off, off.to(tl.float32), mask=off < N + 1)  # one element too many

    buf = torch.zeros(40)
    with pytest.raises(Exception, match="1 of 33 writes fall outside"):
        spill[(1,)](buf[:32], 32, BLOCK=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_kernels_write_only_inside_their_outputs(dtype, write_guard):
    """Every quantize path the layer takes (FP8 operands alone and in pairs, both orientations,
    RHT, SR; packed; NVFP4's amax pass) on shapes of several tiles each way, each of the row load
    modes on 16-bit input."""
    x = randn(32, 3072, seed=3, dtype=dtype)
    for name in ("mxfp4", "mxint4"):
        for dim, rht, rounding, f8 in ((-1, None, "rtne", fp4.E4M3), (0, 16, "sr", fp4.E5M2),
                                       (-1, None, "sr", fp4.E5M2), (0, None, "rtne", fp4.E4M3)):
            kernels.to_fp8(x, name, dim=dim, rht=rht, rounding=rounding, seed=5, fp8=f8)
        kernels.quantize_both(x, name, rounding="sr", rht_col=16, seed=1, seed_col=2,
                              fp8=(fp4.E5M2, fp4.E5M2))
        kernels.quantize_both(x, name, rht_col=16, fp8=(fp4.E4M3, fp4.E4M3))
    kernels.quantize_both(x, "ufp4", rounding="sr", rht_col=16, seed=1, packed=(False, True))
    kernels.fake_quant(x, "nvfp4", dim=0, rht=16)
    kernels.quantize(x, "nvfp4")
    assert write_guard[0] > 10 * x.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_grad_matches_the_reference(dtype):
    """model.softmax_grad_'s kernel: rows longer than one 2048-wide tile with a partial last one,
    targets at both ends of the vocabulary and ignored rows. An online logsumexp rounds otherwise
    than torch's: the losses within fp32 rounding, the bf16 gradients bit for bit here."""
    import model
    R, V = 7, 5000
    z = (torch.randn(R, V) * 4).to(dtype)
    targets = torch.randint(0, V, (R,))
    targets[[0, 3, 6]] = torch.tensor([0, -1, V - 1])
    scale = torch.tensor(1 / 6)
    ref, out = z.clone(), z.clone()
    rows_ref, rows = model.softmax_grad_(ref, targets, scale), kernels.softmax_grad_(out, targets, scale)
    torch.testing.assert_close(rows, rows_ref, rtol=1e-6, atol=1e-5)
    assert rows[3] == 0 and (out[3] == 0).all()
    if dtype == torch.bfloat16:
        assert_same(out, ref, "bf16 gradient")
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="contiguous 2-D logits"):
        kernels.softmax_grad_(z.t(), targets, scale)


def test_softmax_grad_flags_a_target_outside_the_vocabulary():
    """A target the logits have no class for gives its row a NaN loss and gradient, as the
    reference does, not a number read from another class (or from past the buffer: the last row's
    target lies far beyond it); the other rows equal the reference."""
    import model
    R, V = 5, 3000
    z = torch.randn(R, V)
    targets = torch.tensor([5, V, -2, V - 1, V + 10**9])
    scale = torch.tensor(0.25)
    ref, out = z.clone(), z.clone()
    rows_ref, rows = model.softmax_grad_(ref, targets, scale), kernels.softmax_grad_(out, targets, scale)
    bad = torch.tensor([1, 2, 4])
    assert rows[bad].isnan().all() and out[bad].isnan().all()
    assert rows_ref[bad].isnan().all() and ref[bad].isnan().all()
    torch.testing.assert_close(rows, rows_ref, rtol=1e-6, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-8, equal_nan=True)
    assert not rows[[0, 3]].isnan().any() and not out[[0, 3]].isnan().any()


def test_linear_cross_entropy_on_the_kernel(monkeypatch):
    """The training loss in chunks with the Triton backend (the softmax gradient kernel) against
    the torch one: the same loss and gradients to fp32 rounding."""
    import model
    calls = []
    kernel = kernels.softmax_grad_
    monkeypatch.setattr(kernels, "softmax_grad_", lambda *a: calls.append(1) or kernel(*a))
    x = torch.randn(40, 32, requires_grad=True)
    w = (torch.randn(3000, 32) * 0.2).requires_grad_()
    targets = torch.randint(0, 3000, (40,))
    targets[7] = -1
    grads = []
    for backend in (None, kernels):   # (fp4 sends only CUDA tensors to kernels.py)
        monkeypatch.setattr(fp4, "kernels_for", lambda t, k=backend: k)
        x.grad = w.grad = None
        loss = model.linear_cross_entropy(x, w, targets, 16)
        loss.backward()
        grads.append((loss.detach(), x.grad, w.grad))
    assert len(calls) == 3   # 40 tokens in chunks of 16, on the kernel the second time only
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
