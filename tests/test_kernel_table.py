"""``bench train --kernel-table``'s parts without a GPU: the GPU's idle gaps from kernel intervals, a
kernel's bytes from the profiler's record of its launch (a real CPU trace of the record Inductor makes,
with a kernel event joined to it as the CUDA profiler joins one), and the rows and table built from them."""

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.kernel_table import Launches, in_out_arguments, kernel_rows, launches_from_trace, markdown
from inductor_ext.bench.harness import LAUNCH_GAP_US, Timeline, idle_gaps


def test_idle_gaps_split_launch_gaps_from_host_waits_over_overlapping_streams():
    # [0, 10] and [5, 12] overlap (busy 12); a 3 us gap to [15, 20]; a 30 us gap to [50, 51]
    busy, short, long = idle_gaps([(15.0, 20.0), (0.0, 10.0), (50.0, 51.0), (5.0, 12.0), (16.0, 18.0)])
    assert (busy, short, long) == (18.0, 3.0, 30.0)
    assert idle_gaps([(0.0, 1.0), (1.0 + LAUNCH_GAP_US, 7.0)]) == (1.0 + 7.0 - 1.0 - LAUNCH_GAP_US, LAUNCH_GAP_US, 0.0)
    assert idle_gaps([]) == (0.0, 0.0, 0.0)


def _launch_trace(tmp_path, name, arguments):
    """A CPU profile of Inductor's launch record (``_RecordFunctionFast``, the kernel's name and arguments)
    with a kernel event of that name joined to it by its external id."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch._C._profiler._RecordFunctionFast(name, arguments, {"grid": "grid(64,)"}):
            pass
        with torch._C._profiler._RecordFunctionFast("aten_like_parent", arguments[:1], {}):
            pass
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    trace = json.loads((tmp_path / "trace.json").read_text())
    records = {e["name"]: e for e in trace["traceEvents"] if e.get("cat") == "cpu_op"}
    for kernel, parent in ((name, name), ("a_kernel_of_another_name", "aten_like_parent")):
        external = records[parent]["args"]["External id"]
        trace["traceEvents"].append({"ph": "X", "cat": "kernel", "name": kernel, "ts": 0, "dur": 2.0,
                                     "args": {"External id": external}})  # fmt: skip
    return trace


def test_bytes_are_the_launch_records_tensor_arguments(tmp_path):
    x = torch.empty(64, 128, dtype=torch.bfloat16)
    weight = torch.empty(128, dtype=torch.float32)
    out = torch.empty(64, 128, dtype=torch.bfloat16)
    trace = _launch_trace(tmp_path, "triton_red_fused_add_mean_0", [x, weight, out, 8192, 128, 1e-6])
    found = launches_from_trace(trace)
    # every tensor argument once (the integers and the float are not tensors); the kernel under a record of
    # another name (an eager op's, whose record lists only its inputs) gets no bytes but that record's name
    # and tensor arguments
    assert found.bytes_per_launch == {"triton_red_fused_add_mean_0": 2 * 64 * 128 * 2 + 128 * 4}
    assert found.launched_by == {"a_kernel_of_another_name": "aten_like_parent 64x128 bfloat16"}


def test_a_buffer_updated_in_place_counts_twice(tmp_path):
    summand, other = torch.empty(64, 128, dtype=torch.bfloat16), torch.empty(64, 128, dtype=torch.bfloat16)
    trace = _launch_trace(tmp_path, "triton_poi_fused_add_0", [summand, other, 8192])
    tensor = 64 * 128 * 2
    # in_out_ptr0 += in_ptr0: the first buffer read and written
    found = launches_from_trace(trace, {"triton_poi_fused_add_0": [True, False, False]})
    assert found.bytes_per_launch == {"triton_poi_fused_add_0": 3 * tensor}
    # marks that do not line up with the record's arguments are not guessed at
    found = launches_from_trace(trace, {"triton_poi_fused_add_0": [True, False]})
    assert found.bytes_per_launch == {"triton_poi_fused_add_0": 2 * tensor}


def test_in_out_arguments_are_read_from_the_kernels_inductor_loaded(tmp_path):
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    PyCodeCache.load(
        "def triton_poi_fused_add_view_4(in_out_ptr0, in_ptr0, xnumel, XBLOCK : 'tl.constexpr'):\n"
        "    pass\n"
        "def triton_per_fused_sum_1(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : 'tl.constexpr'):\n"
        "    pass\n"
    )
    # a kernel compiled in a worker process: only its autotuner, which names its source file, is here
    source = tmp_path / "kernel.py"
    source.write_text("def triton_poi_fused_add_7(in_out_ptr0, in_ptr0, in_ptr1, xnumel, XBLOCK : tl.constexpr):\n")
    autotuner = CachingAutotuner.__new__(CachingAutotuner)
    autotuner.filename = str(source)
    found = in_out_arguments()
    assert found["triton_poi_fused_add_view_4"] == [True, False, False]
    assert found["triton_per_fused_sum_1"] == [False, False, False, False]
    assert found["triton_poi_fused_add_7"] == [True, False, False, False]
    del autotuner


def test_rows_rate_each_kernel_against_the_copy_bandwidth_and_the_table_lists_them():
    timeline = Timeline(kernel_us={"triton_poi_fused_add_0": 500.0, "nvjet_gemm": 2000.0},
                        calls={"triton_poi_fused_add_0": 2.0, "nvjet_gemm": 4.0},
                        busy_us=2500.0, launch_gap_us=10.0, host_wait_us=40.0)  # fmt: skip
    launches = Launches({"triton_poi_fused_add_0": 0.5e9}, {"nvjet_gemm": "aten::mm 64x128 bfloat16 128x32 bfloat16"})
    rows = kernel_rows(timeline, launches, copy_gbps=4000.0)
    assert [r["kernel"] for r in rows] == ["nvjet_gemm", "triton_poi_fused_add_0"]
    gemm, add = rows
    assert gemm["class"] == "gemm" and gemm["gb"] is None and gemm["pct_of_copy"] is None
    assert gemm["launched_by"] == "aten::mm 64x128 bfloat16 128x32 bfloat16" and add["launched_by"] is None
    # 2 launches of 0.5 GB in 0.5 ms: 2000 GB/s, half the copy bandwidth
    assert add["gb"] == pytest.approx(1.0) and add["gb_per_s"] == pytest.approx(2000.0)
    assert add["pct_of_copy"] == pytest.approx(50.0) and add["ms"] == pytest.approx(0.5)
    table = markdown(rows).splitlines()
    assert table[0].startswith("| kernel") and len(table) == 4
    cells = [cell.strip() for cell in table[3].strip("|").split("|")]
    assert cells == ["triton_poi_fused_add_0", "other", "2", "0.5", "1", "2000", "50", ""]
    assert table[2].rstrip("| ").endswith("aten::mm 64x128 bfloat16 128x32 bfloat16")
