"""dev/quant_counters.py: ncu's raw CSV is read in its own units and matched to the launches the
layer made, in order (the counters themselves need a GPU: docs/kernels.md)."""
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev"))
import quant_counters as qc  # noqa: E402

UNITS = {"us": "ns", "dram": "byte/s", "regs": "register/thread", "inst": "inst"}


def ncu_csv(rows):
    """ncu --csv --page raw output for rows of (kernel name, {metric key: value as ncu prints it})."""
    names = ["ID", "Kernel Name", *qc.METRICS.values()]
    units = ["", "", *(UNITS.get(k, "%" if "pct" in m else "inst") for k, m in qc.METRICS.items())]
    lines = ["==PROF== Connected to process 1", "==PROF== Disconnected from process 1",
             ",".join(f'"{n}"' for n in names), ",".join(f'"{u}"' for u in units)]
    for i, (kernel, vals) in enumerate(rows):
        cells = [str(i), kernel, *(vals.get(k, "1") for k in qc.METRICS)]
        lines.append(",".join(f'"{c}"' for c in cells))
    return "\n".join(lines) + "\n"


def test_parse_converts_units_and_keeps_launch_order():
    text = ncu_csv([("_flat_amax_kernel", {"us": "9,216", "dram": "2,735,111,111,111.11"}),
                    ("_quant_kernel", {"us": "24,032", "inst": "16539648", "issue": "75.1",
                                       "alu": "n/a"})])
    amax, quant = qc.parse_ncu_csv(text)
    assert amax["kernel"] == "_flat_amax_kernel" and quant["kernel"] == "_quant_kernel"
    assert amax["us"] == pytest.approx(9.216) and amax["dram"] == pytest.approx(2.735, abs=1e-3)
    assert quant["us"] == pytest.approx(24.032) and quant["inst"] == 16539648
    assert quant["issue"] == pytest.approx(75.1) and math.isnan(quant["alu"])


def test_table_rows_per_launch_with_instructions_per_element():
    text = ncu_csv([("_quant_kernel", {"us": "24,032", "inst": "16539648", "not_selected": "3.3",
                                       "math_pipe_throttle": "2.0", "wait": "0.6"})])
    label = dict(recipe="mxfp4", layer="qkv", phase="forward", kernel="_quant_kernel", what="x",
                 elements=16384 * 768)
    out = qc.table([label], qc.parse_ncu_csv(text)).splitlines()
    assert len(out) == 3 and out[0].count("|") == out[2].count("|") == 15
    cells = [c.strip() for c in out[2].strip("|").split("|")]
    assert cells[:7] == ["mxfp4", "qkv", "forward", "_quant_kernel: x", "12582912", "24.0", "42.1"]
    assert cells[-1].startswith("not_selected 3.30, math_pipe_throttle 2.00")


def test_table_refuses_launches_that_do_not_match():
    text = ncu_csv([("_quant_kernel", {}), ("_flat_amax_kernel", {})])
    label = dict(recipe="ufp4", layer="fc", phase="forward", kernel="_quant_kernel", what="x", elements=1)
    with pytest.raises(SystemExit, match="other launches"):
        qc.table([label, dict(label, kernel="_dequant_kernel")], qc.parse_ncu_csv(text))
