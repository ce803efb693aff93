"""The GPU tier as CI sees it: `pytest -m gpu` selects exactly the tests that need CUDA and the bf16 kernel
parametrizations that exist only there, they skip on the CPU each with its reason, and `make test-gpu`'s verdict
passes only a run with nothing failed, errored or skipped and a parity check that passed."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from omnirt.loadtest.gpu.test_gpu import gpu_test_files, parity_summary, pytest_counts, verdict
from tests.conftest import ROOT


def _collected(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only", *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_pytest_m_gpu_selects_exactly_the_gpu_tier():
    """Six tests that need CUDA, and the bf16 parametrizations of the three kernels (attention 4, fused
    experts 10, SnakeBeta convolution 11), which exist only there; `make test-gpu`'s files hold them all."""
    everywhere = _collected("-m", "gpu", "tests")
    assert sorted(everywhere) == sorted(_collected("-m", "gpu", *gpu_test_files()))
    named = {i for i in everywhere if "[" not in i}
    assert named == {"tests/test_attention.py::test_host_staging_reuses_its_pinned_regions_round_robin",
                     "tests/test_cudagraph.py::test_cuda_graphs_match_eager_on_the_tiny_model",
                     "tests/test_grammar.py::test_the_mask_replays_in_a_captured_graph",
                     "tests/test_platform.py::test_cuda_platform_is_detected_and_runs_here",
                     "tests/test_transport.py::test_device_tensors_cross_processes_on_the_device",
                     "tests/test_units.py::test_the_host_tier_round_trips_a_slot_through_pinned_memory_in_stream_order"}
    kernels = [i for i in everywhere if "[" in i]
    assert all(re.search(r"[\[-]bf16[\]-]", i) for i in kernels)
    per_file = {f: sum(i.startswith(f"tests/{f}") for i in kernels) for f in ("test_attention", "test_moe",
                                                                             "test_snake_conv")}
    assert per_file == {"test_attention": 4, "test_moe": 10, "test_snake_conv": 11}
    assert len(everywhere) == 31


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine they run (make test-gpu)")
def test_on_the_cpu_the_gpu_tier_skips_each_test_with_its_reason(tmp_path):
    xml = tmp_path / "gpu.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "gpu",
                    f"--junitxml={xml}", *gpu_test_files()], capture_output=True, cwd=ROOT, timeout=600)
    counts = pytest_counts(xml)
    assert counts["skipped"] == 31 and counts["passed"] == counts["failed"] == counts["errors"] == 0
    assert all(re.search(r"CUDA|GPU", s.split(": ", 1)[1]) for s in counts["skips"])


def test_the_verdict_reads_a_parity_run_cut_short(tmp_path):
    path = tmp_path / "hf-parity.txt"
    path.write_text('{"prompt_result": {"prompt": 0, "pass": true}}\n{"prompt_result": {"prompt": 1, "pass": false}}\n')
    assert parity_summary(path) == {"pass": False, "incomplete": True, "prompts": 2, "forced_pass": 1}
    path.write_text(path.read_text() + '{\n "prompts": 2,\n "pass": true\n}\n')
    assert parity_summary(path) == {"prompts": 2, "pass": True}


def _junit(path, passed: int, skipped: int = 0, failed: int = 0) -> None:
    cases = [f'<testcase classname="t" name="p{i}"/>' for i in range(passed)]
    cases += [f'<testcase classname="t" name="s{i}"><skipped message="needs CUDA"/></testcase>' for i in range(skipped)]
    cases += [f'<testcase classname="t" name="f{i}"><failure message="no"/></testcase>' for i in range(failed)]
    path.write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")


@pytest.mark.parametrize("skipped, failed, parity, ok", [
    (0, 0, True, True), (1, 0, True, False), (0, 1, True, False), (0, 0, False, False)])
def test_the_verdict_passes_only_a_clean_run(tmp_path, skipped, failed, parity, ok):
    _junit(tmp_path / "gpu-tests.xml", 30 - skipped - failed, skipped, failed)
    _junit(tmp_path / "platform-tests.xml", 18)
    (tmp_path / "hf-parity.txt").write_text(json.dumps({"prompts": 16, "pass": parity}, indent=1) + "\n")
    result = verdict(tmp_path, {})
    assert result["pass"] is ok
    assert result["tests"]["gpu-tests"]["skipped"] == skipped and result["tests"]["platform-tests"]["passed"] == 18
    (tmp_path / "platform-tests.xml").unlink()  # a part that wrote nothing fails the run too
    assert not verdict(tmp_path, {})["pass"]
