"""The wheel is the product: built from this checkout, installed into a fresh virtualenv outside it, its `omnirt`
command serves the demo page, the tiny model on its shipped profile, and chat completions. The new environment
borrows the test environment's dependencies through a `.pth` line (a `.pth` file in a path it adds is never read, so
the checkout's editable install stays out), and gets omnirt itself only from the wheel."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port

SHIPPED = ("omnirt/web/index.html", "omnirt/web/app.js", "omnirt/deploy/tiny.yaml",
           "omnirt/deploy/qwen3_omni_moe_1gpu.yaml", "omnirt/deploy/docker/entrypoint.sh",
           "omnirt/app/audio/data/smart-turn-v3.2-cpu.onnx",
           "omnirt/pipeline/models/qwen3_omni/chat_template.jinja", "omnirt/loadtest/data/utterances/manifest.json",
           "omnirt/loadtest/data/utterances/25.flac")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel` of a copy of the checkout's package files (the build writes into its source folder)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "omnirt", src / "omnirt", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=600)
    (built,) = (tmp / "dist").glob("omnirt-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel installed, and the test environment's packages on its path."""
    home = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True, timeout=300)
    python = home / "bin" / "python"
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    (Path(own) / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=600)
    return home


def test_the_wheel_holds_one_package_with_its_page_and_profiles(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"omnirt", wheel.name.split("-py3")[0] + ".dist-info"}
    assert [f for f in SHIPPED if f not in names] == []
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "omnirt = omnirt.app.cli:main" in text and "omnirt-bench = omnirt.loadtest.bench:main" in text


def test_the_installed_package_is_the_wheels_and_nothing_is_named_app_or_pipeline(venv, tmp_path):
    probe = ("import importlib.util, omnirt; print(omnirt.__file__); "
             "print([m for m in ('app', 'pipeline', 'loadtest') if importlib.util.find_spec(m)])")
    done = subprocess.run([venv / "bin" / "python", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          check=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    where, others = done.stdout.splitlines()
    assert Path(where).is_relative_to(venv) and others == "[]", done.stdout


def test_the_installed_command_serves_the_demo_the_profiles_and_chat(venv, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "OMNIRT_THREADS": "1",
           "OMNIRT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([venv / "bin" / "omnirt", "serve", "--model", "tiny", "--deploy-config", "tiny",
                             "--port", str(port), "--log-level", "warning"], cwd=tmp_path, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a guard against a hang, not a bound on start-up
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        assert proc.poll() is None, log.read_text()[-3000:]
        page, script = httpx.get(f"{url}/", timeout=30), httpx.get(f"{url}/app.js", timeout=30)
        assert page.status_code == 200 and "omnirt voice demo" in page.text
        assert script.status_code == 200 and "RTCPeerConnection" in script.text
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant", chat.text
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_missing_profile_names_the_shipped_ones(venv, tmp_path):
    done = subprocess.run([venv / "bin" / "omnirt", "serve", "--deploy-config", "no_such_profile"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin",
                                                                            "HOME": str(tmp_path)})
    assert done.returncode == 1
    shipped = done.stderr.partition("the shipped profiles, by name: ")[2]
    assert "cannot be read" in done.stderr and {"qwen3_omni_moe_1gpu", "tiny"} <= set(shipped.replace(")", "")
                                                                                    .replace(",", " ").split())
