"""What a GPU scenario is made of, and how it runs: the steps of `omnirt/loadtest/gpu/scenarios.py`, one after another.

A step is a program with no server (`Check`), a start that must fail (`MustFail`), one server of a named variant
with clients against it in turn (`Serve`), or steps once per word of a parameter (`ForEach`). Every string may
name the scenario's parameters in braces (`{concurrency}`), and `{out}`, `{python}`, `{model}` (the served model's
name), `{model_args}` (the server's model, weights and profile), `{each}` (the word of a ForEach), `{url}` (in a
client). A client is a verb and its arguments:

    chat ARGS     omnirt bench against the server, --name and --out filled in, {chat_args} last
    voice ARGS    omnirt bench realtime against it, over 8 client processes, {voice_args} last
    run ARGV      any program ({url} the server)
    metrics P...  the server's /metrics lines that start with one of P, into NAME.txt
    points W...   one bench per word: N (N sessions cancelled at first audio), convN (N conversing sessions,
                  replies capped at 50 frames), cN (chat at concurrency N); each point's span is printed ("W from T",
                  "W until T": `python -m omnirt.loadtest.step_log --spans`), then what the compilers wrote during it

Output: each program's stdout in OUT (a check's in NAME.txt with its stderr in NAME.log, a bench's reports as
NAME.json/.md/.png); the bench rows, errors and summaries on the driver's stdout, each line led by its step.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from omnirt.loadtest.local_server import ROOT, LocalServer
from omnirt.loadtest.variants import serve_args

SHOWN = re.compile(r"^\| [0-9]|^- |Error|error|Traceback")  # what a bench prints that the driver passes on
HEADER = ("| sessions", "| prompt")
SWITCH_PATH = Path(__file__).with_name("switch")  # sitecustomize: SWITCH_MS in every process of a server


@dataclass(frozen=True)
class Check:
    """`{python} ARGV` (or ARGV as given when it does not start with -m), stdout into `out`."""
    name: str
    argv: str
    limit_s: int | str = 300  # seconds it may take (a value in braces allowed)
    env: str = ""  # KEY=VALUE ...
    variant: str = ""  # its serve arguments appended
    out: str = ""  # default NAME.txt
    show: int = 30  # stdout lines printed at the end


@dataclass(frozen=True)
class MustFail:
    """`omnirt serve` that must stop with exit 1 and one `omnirt: ` line naming the key."""
    name: str
    args: str


@dataclass(frozen=True)
class Serve:
    """One server of a variant from a checkout, its clients in turn, then stopped."""
    variant: str
    clients: tuple[tuple[str, str, int | str], ...]  # (name, verb and arguments, seconds it may take)
    args: str = ""  # more serve arguments
    src: str = "."  # the checkout the server runs from
    name: str = "{variant}"
    log_level: str = "warning"
    log_grep: str = ""  # lines of the server's log printed after it stops


@dataclass(frozen=True)
class ForEach:
    """The steps once per word of a parameter: `{each}`, and for KEY=VALUE words `{each_key}`, `{each_value}`."""
    param: str
    steps: tuple


@dataclass(frozen=True)
class Scenario:
    about: str
    steps: tuple
    params: dict[str, str] = field(default_factory=dict)


class Runner:
    """Runs steps with the given values; `dry` prints the commands instead."""

    def __init__(self, values: dict[str, str], out: Path, env: dict[str, str], dry: bool = False,
                 pack: str | None = None):
        self.values, self.out, self.env, self.dry, self.pack_to = values, out, env, dry, pack
        self.failed: list[str] = []  # steps that exited non-zero, servers that did not start

    def fill(self, text: str, **more: str) -> str:
        """`{name}` of a value filled in (a value may name others); other braces (JSON) are left as written."""
        values = {**self.values, **more}
        for _ in range(4):
            text, before = re.sub(r"\{(\w+)\}", lambda m: values.get(m[1], m[0]), text), text
            if text == before:
                break
        return text

    def argv(self, text: str, **more: str) -> list[str]:
        args = shlex.split(self.fill(text, **more))
        return [self.values["python"], *args] if args[:1] == ["-m"] else args

    def pairs(self, text: str, **more: str) -> dict[str, str]:
        return dict(kv.split("=", 1) for kv in shlex.split(self.fill(text, **more)))

    def say(self, name: str, text: str) -> None:
        for line in text.splitlines():
            print(f"{name} {line}", flush=True)

    def run_all(self, steps: tuple) -> None:
        for step in steps:
            self.run(step)

    def run(self, step, **more: str) -> None:
        if isinstance(step, ForEach):
            for word in self.fill("{" + step.param + "}", **more).split():
                key, _, value = word.partition("=")
                for inner in step.steps:
                    self.run(inner, **{**more, "each": word, "each_key": key, "each_value": value})
        elif isinstance(step, Check):
            self.check(step, **more)
        elif isinstance(step, MustFail):
            self.must_fail(step, **more)
        else:
            self.serve(step, **more)
        self.pack()

    def program(self, name: str, argv: list[str], limit_s: int, stdout: Path, env: dict | None = None) -> int:
        if self.dry:
            print(f"{name}: {shlex.join([*(f'{k}={v}' for k, v in (env or {}).items()), *argv])}  > {stdout.name}",
                  flush=True)
            return 0
        with stdout.open("w") as out, (self.out / f"{name}.log").open("w") as err:
            try:
                return subprocess.run(argv, stdout=out, stderr=err, timeout=limit_s, cwd=ROOT,
                                      env={**self.env, **(env or {})}).returncode
            except subprocess.TimeoutExpired:
                print(f"{name}: stopped at its limit of {limit_s} s", flush=True)
                return 124
            except OSError as exc:  # a program this machine lacks (nvidia-smi on a CPU)
                print(f"{name}: {exc}", flush=True)
                return 127

    def note(self, name: str, rc: int) -> None:
        if rc:
            self.failed.append(f"{name} (exit {rc})")

    def check(self, step: Check, **more: str) -> None:
        name = self.fill(step.name, **more)
        argv = self.argv(step.argv, **more) + (serve_args(self.fill(step.variant, **more))
                                               if step.variant else [])
        env = self.pairs(step.env, **more)
        path = self.out / (self.fill(step.out, **more) or f"{name}.txt")
        rc = self.program(name, argv, int(self.fill(str(step.limit_s), **more)), path, env)
        self.note(name, rc)
        if not self.dry:
            with path.open("a") as f:
                print(f"{name} rc={rc}", file=f)  # ends a run of the file (omnirt.loadtest.plot steps)
            self.say(name, "\n".join(path.read_text(errors="replace").splitlines()[-step.show:]))
            log = (self.out / f"{name}.log").read_text(errors="replace")
            self.say(name, "\n".join([line for line in log.splitlines() if SHOWN.search(line)][-3:]))

    def must_fail(self, step: MustFail, **more: str) -> None:
        name = self.fill(step.name, **more)
        argv = [self.values["python"], "-m", "omnirt.app.cli", "serve", *self.argv("{model_args}"), "--port", "0",
                "--log-level", "warning", *self.argv(step.args, **more)]
        rc = self.program(name, argv, 300, self.out / f"server-{name}.log")
        if not self.dry:
            why = [line for line in (self.out / f"server-{name}.log").read_text().splitlines()
                   if line.startswith("omnirt: ")]
            print(f"{name}: exit {rc} (expected 1): {why[-1] if why else '-'}", flush=True)

    def serve(self, step: Serve, **more: str) -> None:
        variant = self.fill(step.variant, **more)
        name = self.fill(step.name, **{**more, "variant": variant})
        src = Path(self.fill(step.src, **more))
        src = src if src.is_absolute() else ROOT / src
        env = self.pairs("{server_env}", **more)  # the tree it runs from replaces this one on the path
        path = [str(src) if p == str(ROOT) else p for p in self.env["PYTHONPATH"].split(":")]
        env["PYTHONPATH"] = ":".join([str(SWITCH_PATH)] * ("SWITCH_MS" in env) + path)
        log = self.out / f"server-{self.values['scenario']}-{name}.log"
        server = LocalServer(variant, [*self.argv("{model_args}"), "--log-level", self.fill(step.log_level, **more)],
                             self.argv(f"{step.args} {{serve_args}}", **more), src=src, log=log,
                             env={**self.env, **env}, python=self.values["python"])
        if self.dry:
            print(f"server {name}: {shlex.join(server.cmd)}  (from {src})", flush=True)
        else:
            try:
                print(f"server {name} ready after {server.start(float(self.values['start_limit'])):.0f} s", flush=True)
            except RuntimeError as exc:
                print(exc, flush=True)
                self.failed.append(f"server {name}")
                return
            self.say(name, _gpu_memory())
        try:
            for client in step.clients:
                self.client(server, *client, live=log.name, **more)
        finally:
            server.stop()
        if (grep := self.fill(step.log_grep, **more)) and not self.dry:
            text = log.read_text(errors="replace").replace("\r", "\n")  # progress bars end their lines with \r
            self.say(name, "\n".join(dict.fromkeys(x for x in text.splitlines() if re.search(grep, x))))

    def client(self, server: LocalServer, name: str, spec: str, limit_s: int | str, live: str, **more: str) -> None:
        """One client against the server (a spec "?PARAM VERB ..." runs only where PARAM is not empty)."""
        name, limit_s = self.fill(name, **more), int(self.fill(str(limit_s), **more))
        if spec.startswith("?"):
            param, _, spec = spec[1:].partition(" ")
            if not self.fill("{" + param + "}", **more).strip():
                return
        verb, _, rest = spec.partition(" ")
        if verb == "points":
            for i, word in enumerate(self.fill(rest, **more).split(), 1):
                self.point(server, f"{name}-{i}-{word}", word, limit_s, live, **more)
            return
        if verb == "metrics":
            if self.dry:
                print(f"{name}: GET {server.url}/metrics, lines starting {rest}  > {name}.txt", flush=True)
            else:
                lines = [x for x in _get(f"{server.url}/metrics").splitlines() if x.startswith(tuple(rest.split()))]
                (self.out / f"{name}.txt").write_text("\n".join(lines) + "\n")
                self.say(name, "\n".join(lines))
            return
        bench = {"chat": f"-m omnirt.app.cli bench --url {{url}} --model {{model}} --name {name} --out {{out}}",
                 "voice": f"-m omnirt.app.cli bench realtime --url {{url}} --model {{model}} --clients 8 --name {name} "
                          "--out {out}", "run": ""}[verb]
        argv = self.argv(f"{bench} {rest} {{{verb}_args}}", url=server.url, **{"run_args": "", **more})
        rc = self.program(name, argv, limit_s, self.out / f"{name}.out")
        self.note(name, rc)
        if not self.dry:
            lines = (self.out / f"{name}.out").read_text(errors="replace").splitlines()
            shown = lines[-40:] if verb == "run" else dict.fromkeys(  # a voice bench prints each point twice
                x for x in lines if SHOWN.search(x) and not x.startswith(HEADER))
            self.say(name, "\n".join(shown))
            if rc:  # a bench that failed says so here, not only in its log
                errors = (self.out / f"{name}.log").read_text(errors="replace").splitlines()
                self.say(name, f"exit {rc}: {errors[-1] if errors else '-'}")
            self.pack(live)

    def point(self, server: LocalServer, name: str, word: str, limit_s: int, live: str, **more: str) -> None:
        """One point of `points`: its span, its bench, what the compilers wrote meanwhile."""
        if word.startswith("c"):
            spec = f"chat --prompt-lens 160 --concurrency {word[1:]} --wave --repeat-prompt --greedy " \
                   "--requests-per-point 2 --rounds 1 --warmup 2"
        else:
            n = word.removeprefix("conv")
            mode = "--mode converse --reply-frames 50 --reply-tokens 40" if word.startswith("conv") else "--mode cancel"
            spec = f"voice --sessions {n} --turns 3 --turn-timeout 30 {mode}"
        mark = time.time()
        print(f"{word} from {mark:.6f}", flush=True)
        self.client(server, name, spec, limit_s, live, **more)
        print(f"{word} until {time.time():.6f}", flush=True)
        if not self.dry:
            print(f"{word} compiled: {_written_since(mark)}", flush=True)

    def pack(self, keep: str = "") -> None:
        """With --pack: what the steps wrote so far, into one tar in OUT (but `keep`, a running server's log)."""
        if not self.pack_to or self.dry:
            return
        files = [p.name for p in self.out.iterdir() if p.is_file() and p.suffix != ".tar" and p.name != keep]
        if files:
            subprocess.run(["tar", "rf", self.pack_to, "--remove-files", *files], cwd=self.out, check=False)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _gpu_memory() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _written_since(mark: float) -> str:
    """Triton kernels and inductor files written since `mark` (a compile while serving holds the engine's
    interpreter lock)."""
    triton = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    kernels = [p.stem for p in triton.rglob("*.json") if not p.name.startswith("__grp__") and p.stat().st_mtime > mark]
    inductor = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor"))
    files = sum(1 for p in inductor.rglob("*") if p.is_file() and p.stat().st_mtime > mark)
    return f"{len(kernels)} Triton kernels ({', '.join(sorted(set(kernels))[:5])}), {files} inductor files"
