"""`python3 -m omnirt.loadtest.gpu SCENARIO [SCENARIO...] [KEY=VALUE...]`: the GPU measurements, from the repository
root.

    python3 -m omnirt.loadtest.gpu --list               the scenarios, what each does, its parameters
    python3 -m omnirt.loadtest.gpu full-picture         the page's sweep, unseen prompts, voice sessions
    python3 -m omnirt.loadtest.gpu ablation reference variants="profile no-graphs"
                                                        a server per variant, then generate()
    python3 -m omnirt.loadtest.gpu diag variants="profile unfused-steps" diag_env=DIAG_STEPS=1 --dry-run

The server is the full-size architecture with dummy weights on the 1-GPU profile (`--tiny`: the tiny model, to
try a scenario on a CPU). Results go to --out (default: $OUT, else bench-results/gpu-<date>-<time>/). Python
packages the GPU machine lacks travel as wheels in `.whl/` (CPython 3.12, manylinux, one version each; never
fetched from the network there): they are installed once into /tmp/site, again when the set of wheels changes
(not with --tiny, which runs on this machine's own packages).
It exits non-zero, naming them, where a step failed or a server did not start; the other steps still run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from omnirt.loadtest.gpu.driver import Runner
from omnirt.loadtest.gpu.scenarios import SCENARIOS
from omnirt.loadtest.local_server import ROOT

FULL_SIZE = "--model qwen3-omni-30b-a3b --load-format dummy --deploy-config qwen3_omni_moe_1gpu"
SITE = Path("/tmp/site")  # where the carried wheels are installed
# values every scenario may use: more flags of every server, chat point and voice point, the servers' environment
COMMON = {"serve_args": "", "chat_args": "", "voice_args": "", "server_env": "", "start_limit": "600"}
ENV = {"PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1"}  # NVLink multicast off
CACHES = {"OMNIRT_CACHE": "/tmp/omnirt-cache", "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"}


def install_wheels() -> list[str]:
    """The carried wheels into /tmp/site, unless that set is there already; the path entries they need."""
    wheels = sorted(str(p) for p in (ROOT / ".whl").glob("*.whl"))
    if not wheels:
        return []
    marker = SITE / ".installed"
    if not marker.exists() or marker.read_text() != "\n".join(wheels):
        shutil.rmtree(SITE, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], check=True)
        marker.write_text("\n".join(wheels))
    return [str(SITE)]


def environment(site: list[str]) -> dict[str, str]:
    env = {**os.environ, **ENV, **{k: v for k, v in CACHES.items() if k not in os.environ}}
    env["PYTHONPATH"] = ":".join([*site, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # a given one last
    return env


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="python3 -m omnirt.loadtest.gpu", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("words", nargs="*", metavar="SCENARIO|KEY=VALUE")
    p.add_argument("--list", action="store_true", help="the scenarios, their steps' purpose and parameters")
    p.add_argument("--dry-run", action="store_true", help="print each step's commands, run nothing")
    p.add_argument("--out", default=os.environ.get("OUT"), help="where results go")
    p.add_argument("--pack", action="store_true", help="move each step's files into one tar in --out as it ends "
                   "(for a machine that brings back a few files)")
    p.add_argument("--tiny", action="store_true", help="serve the tiny model instead (a CPU check of a scenario)")
    args = p.parse_args(argv)
    names = [w for w in args.words if "=" not in w]
    given = dict(w.split("=", 1) for w in args.words if "=" in w)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not (names or args.list):
        p.error(f"scenarios: {', '.join(SCENARIOS)}" + (f" (not {', '.join(unknown)})" if unknown else ""))
    used = {k for n in names for k in SCENARIOS[n].params} | set(COMMON)
    if stray := set(given) - used:
        p.error(f"{', '.join(sorted(stray))}: no parameter of {', '.join(names)} (theirs: {', '.join(sorted(used))})")
    return args, given


def listing() -> str:
    lines = []
    for name, s in SCENARIOS.items():
        lines.append(f"{name}: {s.about}")
        lines += [f"    {k}={v!r}" for k, v in s.params.items()]
    lines.append(f"every scenario: {', '.join(f'{k}={v!r}' for k, v in COMMON.items())}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args, given = parse(argv)
    if args.list:
        print(listing())
        return
    names = [w for w in args.words if "=" not in w]
    out = Path(args.out or ROOT / "bench-results" / f"gpu-{'-'.join(names)}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    env = environment([] if args.dry_run or args.tiny else install_wheels())  # the wheels are the device's (3.12)
    model, model_args = ("tiny", "--model tiny --threads 1") if args.tiny else ("qwen3-omni-30b-a3b", FULL_SIZE)
    runners = [(name, Runner({**COMMON, **SCENARIOS[name].params, **given, "python": sys.executable, "out": str(out),
                              "model": model, "model_args": model_args, "scenario": name}, out, env, args.dry_run,
                             f"results-{'-'.join(names)}.tar" if args.pack else None)) for name in names]
    with contextlib.redirect_stdout(io.StringIO()):  # a variant or value that does not resolve stops here
        for name, runner in runners:
            Runner(runner.values, out, env, dry=True).run_all(SCENARIOS[name].steps)
    for name, runner in runners:
        print(f"== {name}: {SCENARIOS[name].about}", flush=True)
        runner.run_all(SCENARIOS[name].steps)
    print(f"results: {out}")
    if failed := [step for _, runner in runners for step in runner.failed]:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
