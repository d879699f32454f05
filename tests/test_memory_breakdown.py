"""Tests for scripts/memory_breakdown.py's replay of the allocator's event trace (the GPU part,
recording the trace, runs on the GPU only)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from memory_breakdown import main, replay  # noqa: E402
from test_profile_step import test_bad_input_or_no_gpu_is_one_line as check_command_line  # noqa: E402


def test_bad_input_or_no_gpu_is_one_line():
    check_command_line(main)


def frame(line):
    return [{"filename": "/repo/fp4.py", "line": line, "name": "f"}]


def test_replay_finds_the_peak_and_what_is_alive_there():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frame(1)},        # step 1
        {"action": "alloc", "addr": 2, "size": 50, "frames": frame(2)},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},                   # not a second free
        {"action": "free_requested", "addr": 99, "size": 30},                   # from before recording
        {"action": "alloc", "addr": 3, "size": 40, "frames": frame(3)},         # step 2 starts here
        {"action": "free_requested", "addr": 2, "size": 50},
    ]
    marks = [(0, "step1 fwd1"), (5, "step2 fwd1")]
    peaks = replay(trace, marks, base=1000, last_step=5)
    peak, at, live, before = peaks["whole run"]
    assert peak == 1150 and at == "step1 fwd1 fp4.py:2 f" and before == 1000
    assert sorted(live.values()) == [(50, "step1 fwd1 fp4.py:2 f"), (100, "step1 fwd1 fp4.py:1 f")]
    # the last step starts with 1000 - 30 + 50 alive and reaches 1060 with its own block
    peak, at, live, before = peaks["last step"]
    assert peak == 1060 and at == "step2 fwd1 fp4.py:3 f" and before == 970
    assert sorted(s for s, _ in live.values()) == [40, 50]


def test_replay_counts_a_last_step_without_events_and_older_traces():
    trace = [{"action": "alloc", "addr": 1, "size": 10, "frames": []},
             {"action": "free_completed", "addr": 1, "size": 10}]  # a trace without free_requested
    peaks = replay(trace, [(0, "step1 fwd1"), (2, "step2 fwd1")], base=5, last_step=2)
    assert peaks["whole run"][0] == 15
    assert peaks["last step"][:2] == (5, "the start of the last step")
