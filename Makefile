# omnirt: `make serve` and `make test` each set up (or update) the local virtualenv first, with what that
# command needs: serving installs the server and WebRTC; the test and load-test tools come with `make test`
# (and `make loadtest`) only.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
EXTRAS_serve    ?= webrtc
EXTRAS_test     ?= dev,webrtc,loadtest,ray,frameworks
EXTRAS_loadtest ?= webrtc,loadtest
HOST   ?= 127.0.0.1
PORT   ?= 8091
export OMNIRT_THREADS ?= 2

.PHONY: serve test test-fast test-gpu lint venv sysdeps clean loadtest soak fuzz

# torch is installed first and pinned: the local CPU wheel, never a several-GB CUDA build (elsewhere:
# TORCH="torch --index-url https://download.pytorch.org/whl/cpu", see the README).
$(VENV)/.torch:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	@touch $@

$(VENV)/.installed-%: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS_$*)]"
	@touch $@

# xgrammar's metadata requires triton (about 1 GB) on Linux x86_64, yet on the CPU xgrammar never imports it: it
# compiles grammars and fills token masks in C++. So `make serve` and `make loadtest` install xgrammar without its
# dependencies, then the project's and the extras' requirements and xgrammar's other ones by name, then the project
# without dependencies: no triton (`pip check` names it as missing). `make test` keeps it: the tests run the Triton
# kernels in its interpreter. On a GPU, CUDA torch wheels bring triton themselves.
XGRAMMAR  := $(shell sed -n 's/^ *"\(xgrammar[^"]*\)".*/\1/p' pyproject.toml)
LIST_REQS := $(BIN)/python -c 'import sys, tomllib, importlib.metadata as m; \
  p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
  rs = p["dependencies"] + [r for e in sys.argv[1].split(",") for r in p["optional-dependencies"][e]]; \
  rs += [r for r in m.requires("xgrammar") if "extra ==" not in r]; \
  print(*[r for r in rs if not r.startswith(("xgrammar", "triton"))], sep="\n")'

$(VENV)/.installed-serve $(VENV)/.installed-loadtest: $(VENV)/.installed-%: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q --no-deps "$(XGRAMMAR)"
	$(LIST_REQS) $(EXTRAS_$*) | xargs -d '\n' $(BIN)/python -m pip install -q --no-warn-conflicts
	$(BIN)/python -m pip install -q --no-deps -e .
	@touch $@

venv: $(VENV)/.installed-test

# Debian packages the tests use: espeak-ng (real speech for VAD tests), chromium (browser tests).
sysdeps:
	@command -v espeak-ng >/dev/null && command -v chromium >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng chromium >/dev/null)

serve: $(VENV)/.installed-serve
	$(BIN)/omnirt serve --model tiny --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-test sysdeps
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider tests

# The edit loop's tier (under 3 minutes): unit, engine and parity tests; no server, browser or soak. The
# framework tests are not even collected: importing pipecat, LiveKit and the Agents SDK alone adds ~4 s.
test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -p no:cacheprovider -m fast --ignore-glob='tests/test_framework_*' tests

# Locust, headless, against a server it starts on 127.0.0.1; CSV + HTML + raw samples in a run folder
# (bench-results/loadtest-<date>-<time>/, untracked). LOADTEST_OUT=docs/loadtest refreshes the committed report.
LOADTEST_USERS ?= 8
LOADTEST_TIME  ?= 60s
LOADTEST_OUT   ?=
loadtest: $(VENV)/.installed-loadtest
	$(BIN)/python -m omnirt.loadtest.run --users $(LOADTEST_USERS) --spawn-rate 4 --run-time $(LOADTEST_TIME) \
	  $(if $(LOADTEST_OUT),--out $(LOADTEST_OUT))

# The full soaks, chat and Realtime (CI runs 8 chat clients / 6 Realtime clients for 30 s), and a longer
# fuzz run; figures go to tests/artifacts/.
soak: $(VENV)/.installed-test sysdeps
	OMNIRT_SOAK_N=64 OMNIRT_SOAK_S=600 OMNIRT_RT_SOAK_N=64 OMNIRT_RT_SOAK_S=600 OMNIRT_SOAK_CHECK_RSS=1 \
	  $(BIN)/python -m pytest -q -s \
	  -p no:cacheprovider -o timeout=1800 tests/test_soak.py tests/test_realtime_soak.py

fuzz: $(VENV)/.installed-test
	OMNIRT_FUZZ_CASES=20000 OMNIRT_SCHEMA_CASES=3000 OMNIRT_RT_FUZZ_CASES=50000 $(BIN)/python -m pytest -q -s \
	  -p no:cacheprovider -o timeout=3600 tests/test_fuzz.py tests/test_realtime_fuzz.py

lint: $(VENV)/.installed-test
	$(BIN)/ruff check omnirt tests
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache

# The GPU tier, on a CUDA machine from the repository root (no virtualenv: the machine's torch, the wheels carried
# in .whl/): every `gpu`-marked test, tests/test_platform.py, and full-size parity with transformers (its
# negative control included); pass/fail counts, results in OUT (default bench-results/test-gpu/), exit 1 on any
# failure or skip. docs/reliability.md says what it checks.
OUT ?=
test-gpu:
	$(PYTHON) -m omnirt.loadtest.gpu.test_gpu $(if $(OUT),--out $(OUT))
