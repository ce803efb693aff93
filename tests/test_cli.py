"""The command line a newcomer meets: start-up errors that name the flag or key (with the file and line)
and what is accepted, before torch is imported or the model loaded; help with a default for every flag;
`--version`; a quiet, honest start on a free port."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import OMNIRT, ROOT


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory):
    """An environment in which importing torch fails loudly: what still works there never imported it."""
    fake = tmp_path_factory.mktemp("no_torch")
    (fake / "torch").mkdir()
    (fake / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    return {**os.environ, "PYTHONPATH": str(fake)}


def omnirt(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*OMNIRT, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.parametrize("profile,error", [
    ("stages:\n  - stage_id: 1\n    max_num_seqs: lots\n",
     "deploy profile {path}, line 3: stages[1].max_num_seqs must be an integer, got 'lots'"),
    ("model: tiny\nstages: [unclosed\n", "deploy profile {path}, line 3, column 1: is not valid YAML"),
    ("dtype: int4\n", "deploy profile {path}, line 1: dtype must be one of float32, bfloat16, float16"),
])
def test_a_bad_profile_stops_the_server_before_torch(tmp_path, no_torch, profile, error):
    path = tmp_path / "mine.yaml"
    path.write_text(profile)
    done = omnirt("serve", "--deploy-config", str(path), env=no_torch)
    assert done.returncode == 1 and done.stderr.startswith(f"omnirt: {error.format(path=path)}"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


@pytest.mark.parametrize("args,error", [
    (["--stage-overrides", "{bad"], "argument --stage-overrides: not JSON"),
    (["--port", "70000"], "argument --port: must be an integer >= 0 and <= 65535, got 70000"),
    (["--realtime-max-sessions", "0"], "argument --realtime-max-sessions: must be an integer >= 1, got 0"),
    (["--api-workers", "0"], "argument --api-workers: must be an integer >= 1 and <= 64, got 0"),
    (["--webrtc-max-input-lag-s", "0"], "argument --webrtc-max-input-lag-s: must be a number > 0, got 0"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8' (choose from "),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be a number > 0 and <= 1, got 1.5"),
    (["--gpu-memory-utilization", "nan"], "argument --gpu-memory-utilization: must be a number > 0 and <= 1, got nan"),
    (["--webrtc-ice-servers", '[{"urls": "turn:turn.example.org"}]'], "a TURN server needs a username"),
    (["--webrtc-advertise-address", "my.host"], "'my.host' is not an IP address"),
])
def test_a_bad_flag_is_refused_by_name(no_torch, args, error):
    done = omnirt("serve", *args, env=no_torch)
    assert done.returncode == 2 and error in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 2  # the short usage line, then the error


@pytest.mark.parametrize("args,error", [
    (["--stage-overrides", '{"talker": {"max_num_seqs": "8"}}'],
     "--stage-overrides: stages[1].max_num_seqs must be an integer, got '8'"),
    (["--stage-overrides", '{"vocoder": {}}'], "--stage-overrides: 'vocoder' is not a stage: 0..2 (thinker, talker, "
                                                "code2wav) or *"),
    (["--set", "stages.talker.max_num_seqs=8x"], "--set stages.talker.max_num_seqs=8x: stages[1].max_num_seqs must "
                                                 "be an integer, got '8x'"),
])
def test_a_bad_stage_key_names_the_flag_and_the_model_s_stages(no_torch, args, error):
    """Stage names come from the model's declaration, checked with the profile (before torch)."""
    done = omnirt("serve", *args, env=no_torch)
    assert done.returncode == 1 and done.stderr.strip() == f"omnirt: {error}", done.stderr


@pytest.mark.parametrize("flag,replacement", [
    (["--no-async-chunk"], "--set async_chunk=false"),
    (["--no-prefix-caching"], "--set 'stages.*.prefix_caching=false'"),
    (["--engine", "reference"], "--set engine=reference"),
    (["--moe-backend=triton"], "--set moe_backend=VALUE"),
])
def test_a_removed_ablation_flag_names_its_replacement(no_torch, flag, replacement):
    """The ablations moved to profile keys: the old flags fail at once, saying what replaces them."""
    done = omnirt("serve", *flag, env=no_torch)
    assert done.returncode == 2 and f"{flag[0].split('=')[0]} was removed: use {replacement}" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_serve_help_shows_no_removed_flag():
    done = omnirt("serve", "--help")
    assert done.returncode == 0 and "--set KEY=VALUE" in done.stdout
    assert not any(flag in done.stdout for flag in ("--no-async", "--moe-backend", "--engine ", "--conv-backend"))


def test_a_memory_plan_that_cannot_fit_stops_the_start_naming_the_key():
    done = omnirt("serve", "--gpu-memory-utilization", "0.0001", "--port", "0", "--threads", "1")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith(
        "omnirt: memory plan: gpu_memory_utilization gives thinker + talker + code2wav "), done.stderr
    assert "but max_num_seqs x max_model_len needs " in last and "Traceback" not in done.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_stops_the_server_before_the_model_loads(no_torch, workers):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = omnirt("serve", "--port", str(port), "--api-workers", workers, env=no_torch)
    assert done.returncode == 1 and done.stderr.strip() == (
        f"omnirt: port {port} on 127.0.0.1 is in use (another server?); pick another with --port (make serve: PORT=)")


def test_a_host_address_the_machine_lacks_is_named_as_such(no_torch):
    done = omnirt("serve", "--host", "192.0.2.1", "--port", "0", env=no_torch)  # TEST-NET-1: no machine's
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith(  # after --api-workers auto's
        "omnirt: --host 192.0.2.1 is not an address of this machine ("), done.stderr
    assert "--port" not in done.stderr


def test_api_workers_need_the_engine_core_process(no_torch):
    done = omnirt("serve", "--api-workers", "2", "--engine-process", "inproc", env=no_torch)
    assert done.returncode == 1 and done.stderr.strip() == (
        "omnirt: --api-workers needs the engine core in a process of its own (--engine-process auto or core), "
        "not inproc"), done.stderr


def test_version(no_torch):
    from omnirt.app import __version__

    done = omnirt("--version", env=no_torch)
    assert done.returncode == 0 and done.stdout.strip() == f"omnirt {__version__}" and __version__[0].isdigit()


def _parsers():
    from omnirt.app.flags import build_parser
    from omnirt.loadtest import bench, realtime_bench, run

    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {"omnirt serve": serve, "omnirt bench": bench.build_parser(),
            "omnirt bench realtime": realtime_bench.build_parser(), "make loadtest": run.build_parser()}


@pytest.mark.parametrize("name", ["omnirt serve", "omnirt bench", "omnirt bench realtime", "make loadtest"])
def test_every_flag_has_help_that_shows_its_default(name):
    parser = _parsers()[name]
    flags = [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS
             and not isinstance(a, argparse._HelpAction | argparse._VersionAction)]
    assert flags, name
    formatter = parser.formatter_class(prog=parser.prog)
    for action in flags:
        text = formatter._expand_help(action)
        assert action.help and "default" in text, (name, action.option_strings, text)


def test_serve_help_runs_without_torch(no_torch):
    done = omnirt("serve", "--help", env=no_torch)
    assert done.returncode == 0 and "--realtime-max-sessions" in done.stdout and "(default: 1000)" in done.stdout


def test_a_quiet_start_on_any_free_port(tmp_path):
    """`--port 0`: the server says the port it got; the start-up log carries no third-party noise (transformers'
    rope warnings, its weight-loading progress bar)."""
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([*OMNIRT, "serve", "--port", "0", "--threads", "1"], cwd=ROOT,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while "omnirt ready" not in log.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.3)
        ready = next(line for line in log.read_text().splitlines() if line.startswith("omnirt ready"))
        url = ready.split()[2].rstrip("/")
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
        assert "model 'tiny' on cpu" in ready
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    text = log.read_text()
    assert proc.returncode in (0, -signal.SIGTERM), text[-3000:]  # uvicorn re-raises the SIGTERM it drained on
    assert "rope_parameters" not in text and "Loading weights" not in text and "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("command", [["bench"], ["bench", "realtime", "--help"]])
def test_bench_without_the_loadtest_extra_says_what_to_install(command):
    """As after the quick start, which installs no `loadtest` extra: aiohttp cannot be imported."""
    script = f"import sys; sys.modules['aiohttp'] = None; from omnirt.app.cli import main; main({command!r})"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.splitlines() == ["omnirt bench needs the loadtest extra (aiohttp not installed): "
                                        "pip install 'omnirt[loadtest]'"]


def test_the_bench_check_asks_only_for_packages_of_the_loadtest_extra():
    import tomllib

    from omnirt.app.cli import LOADTEST_MODULES

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["loadtest"]
    names = {re.split(r"[<>=\[ ;]", req)[0].lower() for req in extra}
    assert set(LOADTEST_MODULES) <= names
