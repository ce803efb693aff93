"""`make test-gpu` (`python3 -m omnirt.loadtest.gpu.test_gpu --out DIR`): the GPU tier, from the repository root
of a CUDA machine, with the carried wheels (`.whl/`, installed into /tmp/site as `python3 -m omnirt.loadtest.gpu`
does).

1. Every `gpu`-marked test (the tests that need CUDA and the bf16 kernel parametrizations that exist only
   there), then the platform tests that must hold on a machine with CUDA too: junit XML and output.
2. Full-size parity (`omnirt/loadtest/gpu/hf_parity.py`): the 1-GPU profile with dummy weights, teacher-forced
   against transformers, a bound stated in advance, its negative control, Code2Wav, free-running replies.

Each part has a time limit and writes its files whatever the other did; the total keeps under --total-s. At the
end: pass/fail counts, `test-gpu.json`, and exit 1 on any failure, error or skip, or a parity that did not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from omnirt.loadtest.gpu.__main__ import FULL_SIZE, environment, install_wheels
from omnirt.loadtest.gpu.scenarios import PARITY_VARIANT
from omnirt.loadtest.local_server import ROOT
from omnirt.loadtest.variants import serve_args

PARITY_MODEL = " ".join([FULL_SIZE, *serve_args(PARITY_VARIANT)])
MARKERS = ("mark.gpu", "on_cuda(")  # how a test module spells a GPU test
# tests that once assumed no GPU: they must hold where CUDA is present too
NO_GPU_ASSUMED = ("tests/test_platform.py", "tests/test_config.py::test_platform_detection_boundary")


def gpu_test_files() -> list[str]:
    """The test modules that hold GPU tests (collecting the rest would import packages the device lacks)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if any(m in p.read_text() for m in MARKERS))


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def run(name: str, argv: list[str], limit_s: float, out: Path, env: dict) -> int:
    """A part's program, stdout into NAME.txt and stderr into NAME.log; 124 when it ran past its limit."""
    say(f"{name}: {' '.join(argv[1:])} (limit {limit_s:.0f} s)")
    started = time.monotonic()
    with (out / f"{name}.txt").open("w") as stdout, (out / f"{name}.log").open("w") as stderr:
        try:
            rc = subprocess.run(argv, stdout=stdout, stderr=stderr, timeout=max(limit_s, 1), cwd=ROOT,
                                env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    say(f"{name}: rc={rc} after {time.monotonic() - started:.0f} s")
    return rc


def pytest_counts(xml: Path) -> dict:
    """Passed, failed, errors, skipped (with each skip's reason) from a junit XML file."""
    if not xml.exists():
        return {"missing": str(xml.name)}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skips": [], "failures": []}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            counts["failed" if "failure" in kinds else "errors"] += 1
            counts["failures"].append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
            counts["skips"].append(f"{name}: {kinds['skipped'].get('message', '')}")
        else:
            counts["passed"] += 1
    return counts


def parity_summary(path: Path) -> dict:
    """The parity check's summary (its last JSON object), else what its per-prompt lines say."""
    text = path.read_text(errors="replace") if path.exists() else ""
    rows = [json.loads(line)["prompt_result"] for line in text.splitlines() if line.startswith('{"prompt_result"')]
    start = text.rfind("\n{\n") + 1 if "\n{\n" in text else (0 if text.startswith("{\n") else -1)
    try:
        summary = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        summary = None
    if summary is None:
        return {"pass": False, "incomplete": True, "prompts": len(rows), "forced_pass": sum(r["pass"] for r in rows)}
    return summary


def verdict(out: Path, rcs: dict[str, int]) -> dict:
    tests = {name: pytest_counts(out / f"{name}.xml") for name in ("gpu-tests", "platform-tests")}
    parity = parity_summary(out / "hf-parity.txt")
    ok = all("missing" not in t and not (t["failed"] or t["errors"] or t["skipped"]) and t["passed"]
             for t in tests.values()) and bool(parity.get("pass"))
    return {"pass": ok, "rc": rcs, "tests": tests, "parity": parity}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python3 -m omnirt.loadtest.gpu.test_gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench-results" / "test-gpu"))
    p.add_argument("--total-s", type=float, default=530, help="the whole run's time, start-up included")
    p.add_argument("--tests-s", type=float, default=280, help="the pytest parts' time at most (beside the parity "
                   "check's start-up, unless --serial)")
    p.add_argument("--model-args", default=PARITY_MODEL, help="the parity check's model (the tiny one: a CPU try)")
    p.add_argument("--parity-args", default="", help="more hf_parity options (e.g. --prompts 4)")
    p.add_argument("--no-wheels", action="store_true", help="use this environment's packages (a CPU try)")
    p.add_argument("--serial", action="store_true", help="the tests before the parity check, not beside its start-up")
    args = p.parse_args(argv)
    started, out = time.monotonic(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment([] if args.no_wheels else install_wheels())
    py, rcs = sys.executable, {}
    files = gpu_test_files()
    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-o", "timeout=150",
              "--continue-on-collection-errors"]

    def tests() -> None:
        rcs["gpu-tests"] = run("gpu-tests", [*pytest, "-m", "gpu", f"--junitxml={out / 'gpu-tests.xml'}", *files],
                               args.tests_s - 40, out, env)
        rcs["platform-tests"] = run("platform-tests", [*pytest, "-m", "not gpu",
                                                       f"--junitxml={out / 'platform-tests.xml'}", *NO_GPU_ASSUMED],
                                    40, out, env)

    # by default the tests run while the parity check loads and compiles (minutes of host work; a few GiB of
    # device memory beside it)
    beside = threading.Thread(target=tests)
    beside.start()
    if args.serial:
        beside.join()
    left = args.total_s - (time.monotonic() - started)
    # no new prompt within 75 s of the end: the last prompt, the negative control and the summary fit in that
    rcs["hf-parity"] = run("hf-parity", [py, "-m", "omnirt.loadtest.gpu.hf_parity", "--budget-s", f"{left - 75:.0f}",
                                         *args.parity_args.split(), "--", *args.model_args.split()], left, out, env)
    beside.join()
    result = verdict(out, rcs)
    (out / "test-gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    for name, t in result["tests"].items():
        say(f"{name}: " + (t.get("missing") and f"no results ({t['missing']})" or
                           f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"))
        for line in t.get("failures", []) + t.get("skips", []):
            say(f"    {line}")
    par = result["parity"]
    say(f"hf-parity: {'pass' if par.get('pass') else 'FAIL'} ({par.get('prompts')} prompts, forced pass "
        f"{par.get('forced_pass')}, negative control caught: {(par.get('negative_control') or {}).get('caught')})")
    say(f"test-gpu: {'PASS' if result['pass'] else 'FAIL'} in {time.monotonic() - started:.0f} s; files in {out}")
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()
