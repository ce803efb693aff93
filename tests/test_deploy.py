"""The container recipe, as far as it runs here (no GPU image is built in CI): the build context that
.dockerignore leaves serves the tiny model through the image's entrypoint and passes its health check; the
entrypoint passes the environment and extra flags to `omnirt serve`; the Dockerfile and the compose example
agree with each other and with the repository."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tests.conftest import ROOT, free_port

ENTRYPOINT = ROOT / "omnirt" / "deploy" / "docker" / "entrypoint.sh"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "omnirt" / "deploy" / "docker" / "compose.yaml").read_text())


def build_context() -> list[str]:
    """The repository's files that .dockerignore lets into the build context (its last matching line wins)."""
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()

    def matches(path: str, pattern: str) -> bool:
        """Docker's rule: a pattern names a path from the context's root (or a folder above the file);
        one that starts with `**/` names it at any depth."""
        parts = path.split("/")
        if pattern.startswith("**/"):
            return any(fnmatch.fnmatch(p, pattern[3:]) for p in parts)
        return any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))

    def included(path: str) -> bool:
        keep = True
        for rule in rules:
            if matches(path, rule.lstrip("!").rstrip("/")):
                keep = rule.startswith("!")
        return keep

    return [f for f in files if included(f) and (ROOT / f).is_file()]


def env_line(name: str) -> str:
    return re.search(rf"\b{name}=(\S+)", DOCKERFILE).group(1)


def test_the_context_holds_what_the_dockerfile_copies_and_nothing_for_tests():
    context = build_context()
    copied = [src for line in DOCKERFILE.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]]
    assert copied and all(any(f == src or f.startswith(f"{src}/") for f in context) for src in copied), copied
    assert not [f for f in context if f.startswith(("tests/", "docs/", "omnirt/loadtest/", ".venv", "bench-results"))]
    assert f"omnirt/deploy/{env_line('OMNIRT_PROFILE')}.yaml" in context  # a shipped profile, by name
    assert "omnirt/deploy/docker/entrypoint.sh" in context


def test_the_image_installs_serving_only_and_torch_first():
    installs = [line for line in DOCKERFILE.splitlines() if "pip install" in line]
    assert "torch==" in installs[0] and "--index-url" in installs[0]  # a CUDA build from PyTorch's index
    assert installs[1].split()[-1] == '".[webrtc]"'  # no dev, loadtest or ray extra
    assert f"EXPOSE {env_line('OMNIRT_PORT')}" in DOCKERFILE
    assert "WORKDIR /opt/omnirt" in DOCKERFILE
    assert 'ENTRYPOINT ["/opt/omnirt/omnirt/deploy/docker/entrypoint.sh"]' in DOCKERFILE
    health = r'HEALTHCHECK .*\n\s+CMD \["/opt/omnirt/omnirt/deploy/docker/entrypoint.sh", "health"\]'
    assert re.search(health, DOCKERFILE)


def test_the_compose_example_builds_this_dockerfile_with_a_gpu_a_model_volume_and_a_key():
    service = COMPOSE["services"]["omnirt"]
    context = (ROOT / "omnirt" / "deploy" / "docker" / service["build"]["context"]).resolve()
    assert context == ROOT and (context / service["build"]["dockerfile"]).is_file()
    volume = service["volumes"][0]
    assert volume.startswith("${MODELS_DIR:?") and volume.endswith(":/models:ro")
    assert service["environment"]["OMNIRT_MODEL"].startswith("/models/")
    assert (ROOT / "omnirt" / "deploy" / f"{service['environment']['OMNIRT_PROFILE']}.yaml").is_file()
    assert service["environment"]["OMNIRT_API_KEY"].startswith("${OMNIRT_API_KEY:?")
    assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


@pytest.fixture()
def stub_omnirt(tmp_path):
    """`omnirt` on PATH as a script that prints its arguments, one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "omnirt").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (bin_dir / "omnirt").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def entrypoint(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=60, env=env)


def test_the_entrypoint_passes_the_environment_and_extra_flags(stub_omnirt):
    base = {k: v for k, v in stub_omnirt.items() if not k.startswith("OMNIRT_")}
    assert entrypoint(base).stdout.split("\n")[:-1] == ["serve", "--host", "0.0.0.0", "--port", "8091", "--model",
                                                        "tiny"]
    env = {**base, "OMNIRT_MODEL": "/models/Qwen3 Omni", "OMNIRT_PROFILE": "deploy/my profile.yaml",
           "OMNIRT_PORT": "9000", "OMNIRT_HOST": "10.0.0.2"}
    assert entrypoint(env, "--api-key", "sk-1", "--port", "9001").stdout.split("\n")[:-1] == [
        "serve", "--host", "10.0.0.2", "--port", "9000", "--model", "/models/Qwen3 Omni", "--deploy-config",
        "deploy/my profile.yaml", "--api-key", "sk-1", "--port", "9001"]  # later flags win in argparse


def test_the_health_check_fails_without_a_server():
    done = entrypoint({**os.environ, "OMNIRT_PORT": str(free_port())}, "health")
    assert done.returncode == 1 and "unhealthy" in done.stderr


def test_the_build_context_alone_serves_the_tiny_model_through_the_entrypoint(tmp_path):
    """The files the image gets, and nothing else of the checkout (`python -m omnirt.app.cli` in the copy imports the
    copy's omnirt/app/ and omnirt/pipeline/): `entrypoint.sh` serves the tiny model, and `entrypoint.sh health` turns
    healthy once it answers."""
    context = tmp_path / "context"
    for f in build_context():
        (context / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, context / f)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "omnirt").write_text(f'#!/bin/sh\nexec {sys.executable} -m omnirt.app.cli "$@"\n')  # the image's script
    (bin_dir / "omnirt").chmod(0o755)
    port = free_port()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(context),
           "OMNIRT_HOST": "127.0.0.1", "OMNIRT_PORT": str(port), "OMNIRT_MODEL": "tiny",
           "OMNIRT_PROFILE": "tiny", "OMNIRT_THREADS": "1"}
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(["sh", str(context / "omnirt/deploy/docker/entrypoint.sh"), "--log-level", "warning"],
                            cwd=context, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while (health := entrypoint(env, "health")).returncode != 0 and proc.poll() is None:
            assert time.time() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        assert health.returncode == 0, log.read_text()[-2000:]
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=30)  # the demo, from the context's omnirt/web/
        assert page.status_code == 200 and "omnirt voice demo" in page.text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
