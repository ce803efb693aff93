"""The GPU measurements, as data: `python -m omnirt.loadtest.gpu SCENARIO [SCENARIO...] [KEY=VALUE...]` runs them.

Each scenario is a list of steps (`omnirt/loadtest/gpu/driver.py`) and the parameters it reads, with their defaults; a
KEY=VALUE on the command line changes a parameter for every scenario of the run. Servers are named variants
(`omnirt/loadtest/variants.py`); what they serve is the full-size architecture with dummy weights on the 1-GPU profile.
"""

from __future__ import annotations

from omnirt.loadtest.gpu.driver import Check, ForEach, MustFail, Scenario, Serve

# a diagnostic point of `omnirt bench`, the older shape: one repeated prompt, greedy, 2 warm-up requests, then one
# wave of c requests at concurrency c (2 requests at c=1); labelled diagnostic in its report
WAVE = "--wave --repeat-prompt --greedy --requests-per-point 2 --rounds 1 --warmup 2"
VOICE_SERVER = "--realtime-max-sessions 160"
NVIDIA_SMI = "run nvidia-smi --query-gpu=memory.used,memory.free,memory.total --format=csv,noheader"

# the steady state (the default of `omnirt bench`): per point 20 s of warm-up, then a window of >= 60 s and
# >= 8 requests a worker; distinct random prompts, the Thinker sampled
STEADY = ("steady", "chat --prompt-lens {steady_prompts} --concurrency {concurrency}", "{steady_limit}")
STEADY_PARAMS = {"steady_prompts": "16-640", "concurrency": "1 16 64", "steady_limit": "500"}
SWEEP = ("sweep", f"chat --prompt-lens {{prompts}} --concurrency {{concurrency}} {WAVE}", "{sweep_limit}")
DISTINCT = ("distinct", "chat --prompt-lens 160 --concurrency 64 --wave --greedy --requests-per-point 2 --rounds 1 "
            "--warmup 2", 120)
VOICE = ("voice", "voice --sessions {sessions} --turns 3 --mode cancel", "{voice_limit}")  # diagnostic
VOICE_CONVERSE = ("voice-converse", "voice --sessions {converse_sessions} --turns 5 --mode converse --reply-frames "
                  "{reply_frames} --reply-tokens 40", "{voice_limit}")
VOICE_PARAMS = {"sessions": "1 32 64", "converse_sessions": "32", "reply_frames": "50", "voice_limit": "200"}
SWEEP_PARAMS = {"prompts": "10 160 320 640", "concurrency": "1 16 32 64", "sweep_limit": "330"}

# semantic_vad and noise reduction at the front end's points (`front-end`): name, bench flags
FRONT_END_MODELS = (("semantic", "--turn-detection semantic_vad"), ("near-field", "--noise-reduction near_field"),
                    ("both", "--turn-detection semantic_vad --noise-reduction near_field"))

ABLATION = ForEach("variants", (Serve(
    "{each}", (("ablation-{each}", f"chat --prompt-lens {{prompt}} --concurrency {{concurrency}} {WAVE}",
                "{point_limit}"),), log_level="{log_level}", log_grep="{log_grep}"),))
ABLATION_PARAMS = {"concurrency": "64", "prompt": "160", "point_limit": "200", "log_level": "warning", "log_grep": ""}


# the server's precision and memory
PRECISION_LINES = "quantization|fp8:|weights of|memory plan|KV cache:|graphs captured"
# what prefix reuse did: prompt tokens computed and reused, resident slots, the host tier behind them, how each
# request got its slot and how many resident ones were given up
PREFIX_METRICS = ("omnirt_stage_prefill omnirt_stage_resident omnirt_stage_offloaded omnirt_stage_restored "
                  "omnirt_stage_placements omnirt_stage_given_up")
PARITY_VARIANT = "four-requests"  # the parity check's server (omnirt/loadtest/variants.py)


def check(name: str, argv: str, out: str = "", limit_s: int | str = 300, **more) -> Check:
    return Check(name, argv, limit_s, out=out, **more)


GRAMMAR_KERNELS = check("grammar-kernels", "-m omnirt.loadtest.gpu.grammar_check", "grammar-kernels.jsonl")

SCENARIOS: dict[str, Scenario] = {
    # checks of the device's kernels and paths against the plain ones
    "gpu-tests": Scenario("the GPU tests: Triton attention, MoE and FP8 kernels, pinned staging, graphs against eager",
                          (check("gpu-tests", "-m pytest -q -p no:cacheprovider {tests}"),),
                          {"tests": "tests/test_attention.py tests/test_moe.py tests/test_fp8.py "
                                    "tests/test_cudagraph.py -k 'kernel or staging or cuda or fused or align'"}),
    "graph-check-tiny": Scenario("the tiny model served as on the device (graphs) against eager, same weights",
                                 (check("graph-check-tiny", "-m omnirt.loadtest.gpu_check --num-requests 6 -- "
                                        "--model tiny --dtype float32", "graph-check-tiny.json", 150),)),
    "graph-check": Scenario("full size: the served path against eager, dense attention, uncompiled layers; where "
                            "greedy replies part, the top-2 logit gaps", (check(
                                "graph-check", "-m omnirt.loadtest.gpu_check --num-requests 8 --thinker-tokens 32 "
                                "--frames 16 -- {model_args}", "graph-check.json", variant="{variant}"),),
                            {"variant": "profile"}),
    "test-gpu": Scenario("`make test-gpu`: the gpu-marked tests, the platform tests, then hf-parity, with pass/fail "
                         "counts and a verdict (omnirt/loadtest/gpu/test_gpu.py)",
                         (check("test-gpu", "-m omnirt.loadtest.gpu.test_gpu --out {out}", limit_s=590, show=12),)),
    "hf-parity": Scenario("full size: the engine as served, teacher-forced on transformers' tokens, against "
                          "transformers' logits with a bound stated in advance, and its negative control",
                          (check("hf-parity", "-m omnirt.loadtest.gpu.hf_parity --budget-s {parity_budget} "
                                 "{parity_args} -- {model_args}", "hf-parity.json", "{parity_limit}",
                                 variant="{variant}"),),
                          {"parity_budget": "480", "parity_limit": "560", "parity_args": "",
                           "variant": PARITY_VARIANT}),
    "moe-kernels": Scenario("both full-size MoE blocks at batch 1/16/64: every experts implementation captured and "
                            "replayed on new routing, against the fp32 block",
                            (check("moe-kernels", "-m omnirt.loadtest.gpu.moe_check {impls}", limit_s=240),),
                            {"impls": ""}),
    "c2w-check": Scenario("Code2Wav at full size: FLOPs per chunk, its captured graphs against eager",
                          (check("c2w-check", "-m omnirt.loadtest.gpu.c2w_check --max-batch 16", "c2w-check.jsonl"),)),
    "c2w-variants": Scenario("Code2Wav formulations timed against eager, SNR against eager float32",
                             (check("c2w-variants", "-m omnirt.loadtest.gpu.c2w_variants --shapes {shapes} {c2w_args}",
                                    "c2w-variants.jsonl"),),
                             {"shapes": "1x50 16x50 64x50", "c2w_args": ""}),
    "audio-encoder": Scenario("the audio encoder at full size: transformers' call against the engine's (lengths worked "
                              "out on the host), the same rows, host and ready times on an idle and a busy device",
                              (check("audio-encoder", "-m omnirt.loadtest.gpu.audio_encoder_check", limit_s=200),)),
    "grammar-kernels": Scenario("constrained decoding at the released vocabulary: in a graph, its device and host "
                                "cost", (GRAMMAR_KERNELS,)),
    "fit-48g": Scenario("an 80 GB GPU standing in for a 48 GB one (all but leave_gib of its free memory held by "
                        "another process, omnirt/loadtest/gpu/ballast.py): the variant's start-up, memory plan and "
                        "steps in process (diag)",
                        (check("fit-48g", "-m omnirt.loadtest.gpu.ballast --leave-gib {leave_gib} -- {python} -m "
                               "omnirt.loadtest.gpu.diag {model_args}", limit_s="{diag_limit}", variant="{variant}",
                               env="OUT={out} DIAG_CONC='{concurrency}' DIAG_TIMEOUT=280 DIAG_LOG=INFO"),),
                        {"leave_gib": "44.4", "variant": "48g", "concurrency": "1 8", "diag_limit": "300"}),
    "fp8-accuracy": Scenario("FP8 against bf16 on the same dummy weights at full size, teacher-forced: each MoE "
                             "layer, the Thinker's logits, the Talker's codec frames, against a bound stated in "
                             "advance, with its negative control (omnirt/loadtest/gpu/fp8_accuracy.py)",
                             (check("fp8-accuracy", "-m omnirt.loadtest.gpu.fp8_accuracy --prompts {prompts} "
                                    "--tokens {tokens} --out {out}/fp8-accuracy.json", limit_s=240),),
                             {"prompts": "16", "tokens": "64"}),
    "stage-memory": Scenario("device memory of each stage's weights loaded alone (what a replica worker holds)",
                             (check("stage-memory", "-m omnirt.loadtest.gpu.stage_memory {model_args}"),)),
    "diag": Scenario("in process, no HTTP: per-stage step times and req/s per concurrency, an engine per variant; "
                     "diag_env adds step replays, traces, profiles, stack samples (omnirt/loadtest/gpu/diag.py)",
                     (ForEach("variants", (check("diag-{each}", "-m omnirt.loadtest.gpu.diag {model_args}",
                                                 limit_s="{diag_limit}", variant="{each}",
                                                 env="OUT={out} DIAG_CONC='{concurrency}' DIAG_TIMEOUT=200 "
                                                     "{diag_env}"),)),),
                     {"variants": "profile", "concurrency": "1 16 64", "diag_env": "", "diag_limit": "240"}),
    # served: `omnirt bench` and `omnirt bench realtime` against servers of this checkout
    "smoke": Scenario("the tiny model's graph check, then the full-size server's start-up and a short chat sweep",
                      (check("graph-check-tiny", "-m omnirt.loadtest.gpu_check --num-requests 6 -- --model tiny "
                             "--dtype float32", "graph-check-tiny.json", 150),
                       Serve("profile", (("smoke", "chat --prompt-lens 160 --concurrency {concurrency} "
                                                   "--warmup-s 5 --window-s 15 --min-requests 2", 300),),
                             log_grep="GiB|MiB|capture failed")), {"concurrency": "1 16 64"}),
    "steady": Scenario("chat steady state: closed-loop workers, distinct sampled prompts of 16-640 tokens, a "
                       "measured window a point", (Serve("{variant}", (STEADY,), VOICE_SERVER),),
                       {"variant": "profile", **STEADY_PARAMS}),
    "sweep": Scenario("diagnostic: prompt length x concurrency, one wave a point of one repeated prompt, greedy",
                      (Serve("{variant}", (SWEEP,), VOICE_SERVER),), {"variant": "profile", **SWEEP_PARAMS}),
    "distinct": Scenario("diagnostic: one wave at c=64 of distinct prompts the server has not seen, greedy",
                         (Serve("{variant}", (DISTINCT,), VOICE_SERVER),), {"variant": "profile"}),
    "converse": Scenario("the headline: conversing sessions (distinct utterances, replies played whole and unpinned, "
                         "think times, out of step; a warm-up turn, then 5), then the capacity search at the bound "
                         "(`sessions=` empty: the search alone; `reply=`: a cap for dummy weights, as `headline`)",
                         (Serve("{variant}", (("converse", "?sessions voice --sessions {sessions} {reply}",
                                               "{converse_limit}"),
                                              ("capacity", "voice --capacity --sessions {capacity_from} --max-sessions "
                                                           "{capacity_to} --latency-bound {bound_ms} {reply}",
                                               "{capacity_limit}"),
                                              ("converse-metrics", f"metrics {PREFIX_METRICS}", 30)),
                                "--realtime-max-sessions {max_sessions}", log_level="info",
                                log_grep=PRECISION_LINES),),
                         {"variant": "profile", "sessions": "1 16 32", "converse_limit": "300", "capacity_from": "8",
                          "capacity_to": "512", "bound_ms": "800", "capacity_limit": "590", "max_sessions": "600",
                          "reply": ""}),
    "headline": Scenario("the two headline benches on one server: conversing sessions (a warm-up turn, then 5), "
                         "then the chat steady state; voice replies capped (`reply`), since dummy weights never end "
                         "one of their own (the profile's own caps would make each 80 s of speech)",
                         (Serve("{variant}", (("converse", "voice --sessions {sessions} {reply}", "{converse_limit}"),
                                              ("steady", "chat --prompt-lens 16-640 --concurrency {concurrency}",
                                               "{steady_limit}")), VOICE_SERVER, log_level="info",
                                log_grep=PRECISION_LINES),),
                         {"variant": "profile", "sessions": "1 64", "concurrency": "64", "converse_limit": "330",
                          "steady_limit": "200", "reply": "--reply-frames 100 --reply-tokens 60"}),
    "precision": Scenario("bf16 against FP8 weights on one machine: a server per variant, each with the headline's "
                          "two benches (conversing sessions, replies capped as there; the chat steady state, a shorter "
                          "window)",
                          (ForEach("variants", (Serve("{each}", (
                              ("converse-{each}", "voice --sessions {sessions} {reply}", "{converse_limit}"),
                              ("steady-{each}", "chat --prompt-lens 16-640 --concurrency {concurrency} --warmup-s "
                                                "{warmup_s} --window-s {window_s}", "{steady_limit}")),
                              VOICE_SERVER, log_level="info", log_grep=PRECISION_LINES),)),),
                          {"variants": "fp8 bf16", "sessions": "64", "concurrency": "64", "converse_limit": "170",
                           "steady_limit": "90", "warmup_s": "10", "window_s": "40",
                           "reply": "--reply-frames 100 --reply-tokens 60"}),
    "voice": Scenario("voice sessions, each reply cancelled at its first audio (diagnostic: a warm-up turn, then 3), "
                      "then conversing sessions with replies capped at reply_frames",
                      (Serve("{variant}", (VOICE, VOICE_CONVERSE), VOICE_SERVER),),
                      {"variant": "profile", **VOICE_PARAMS}),
    "full-picture": Scenario("the sweep, unseen prompts at c=64 and voice sessions, on one server",
                             (Serve("{variant}", (SWEEP, DISTINCT, VOICE, VOICE_CONVERSE), VOICE_SERVER),),
                             {"variant": "profile", **SWEEP_PARAMS, **VOICE_PARAMS}),
    "ablation": Scenario("a server per variant, one chat point each (the profile row first, for the ratios)",
                         (ABLATION,), {"variants": "profile no-graphs no-async-chunk no-async-output compile-off "
                                                   "no-priority sync-talker", **ABLATION_PARAMS}),
    "reference": Scenario("transformers' generate() behind the same API, c=1",
                          (Serve("reference", (("reference", "chat --prompt-lens 160 --concurrency 1 --wave "
                                                "--repeat-prompt --greedy --requests-per-point 2 --rounds 1 "
                                                "--warmup 1", "{ref_limit}"),)),),
                          {"ref_limit": "150"}),
    "timeline": Scenario("where first packets wait, stage by stage: chat at prompt 160, then voice sessions",
                         (Serve("{variant}", (("timeline", f"chat --prompt-lens 160 --concurrency {{concurrency}} "
                                                           f"{WAVE}", 200),
                                              ("timeline-voice", "?sessions voice --sessions {sessions} --turns 3 "
                                                                 "--mode cancel", 200)), VOICE_SERVER),),
                         {"variant": "profile", "concurrency": "1 16 64", "sessions": "1 32"}),
    "ab-builds": Scenario("builds side by side in one call, as timeline: NAME=DIR each, DIR a source tree (e.g. "
                          "`git archive REV app pipeline deploy | tar -x -C build/base`, carried)",
                          (ForEach("builds", (Serve(
                              "{variant}", (("{each_key}-timeline", f"?concurrency chat --prompt-lens 160 "
                                             f"--concurrency {{concurrency}} {WAVE}", 200),
                                            ("{each_key}-realtime", "?sessions voice --sessions {sessions} --turns 3 "
                                             "--mode cancel", 200)),
                              VOICE_SERVER, src="{each_value}", name="{each_key}"),)),),
                          {"builds": "new=. base=build/base", "variant": "profile", "concurrency": "1 16 64",
                           "sessions": "1 32"}),
    "ab-steady": Scenario("builds side by side in one call, as ab-builds, each with the chat steady state (a shorter "
                          "window) and its precision logged",
                          (ForEach("builds", (Serve("{variant}", (
                              ("{each_key}-steady", "chat --prompt-lens 16-640 --concurrency {concurrency} --warmup-s "
                                                    "{warmup_s} --window-s {window_s}", "{steady_limit}"),),
                              VOICE_SERVER, src="{each_value}", name="{each_key}", log_level="info",
                              log_grep=PRECISION_LINES),)),),
                          {"builds": "new=. base=build/base", "variant": "profile", "concurrency": "64",
                           "warmup_s": "10", "window_s": "40", "steady_limit": "90"}),
    "points": Scenario("one server, one bench run per point (N sessions cancelled at first audio, convN conversing "
                       "sessions, cN chat), each point's span printed for --step-log, compiles counted",
                       (Serve("{variant}", (("point", "points {points}", "{point_limit}"),), VOICE_SERVER,
                              log_grep="100%|engine ready|Traceback"),),
                       {"variant": "profile", "points": "32 64 1 conv32", "point_limit": "150"}),
    "first-packet": Scenario("a server per variant, chat at concurrency past max_num_seqs, then each server's "
                             "first-step waits and batch sizes from /metrics",
                             (ForEach("variants", (Serve("{each}", (
                                 ("first-packet-{each}", f"chat --prompt-lens 160 --concurrency {{concurrency}} "
                                                         f"{WAVE}", 300),
                                 ("metrics-{each}", "metrics omnirt_stage_first_step_wait_steps "
                                                    "omnirt_stage_max_wait_steps omnirt_stage_deferred_rows "
                                                    "omnirt_stage_batch_size_sum omnirt_stage_batch_size_count", 30),
                             )),)),), {"variants": "profile no-priority", "concurrency": "64 96"}),
    "prefix-reuse": Scenario("10-turn voice conversations per variant, per turn: latency, prompt tokens reused "
                             "and prefilled; then the server's prefill and resident-slot counters",
                             (ForEach("variants", (Serve("{each}", (
                                 ("turns-{each}", "voice --sessions {sessions} --turns 10 --mode cancel",
                                  "{point_limit}"),
                                 ("turns-metrics-{each}", f"metrics {PREFIX_METRICS}", 30)),
                                 VOICE_SERVER, log_level="info", log_grep="KV cache:"),)),),
                             {"variants": "profile no-prefix-caching", "sessions": "1 32", "point_limit": "400"}),
    "memory-plan": Scenario("the start-up memory plan, free memory after start-up and after 64 concurrent requests, "
                            "then two starts that must fail naming their key",
                            (Serve("profile", (("free-after-start", NVIDIA_SMI, 30),
                                               ("burst", "chat --prompt-lens 160 512 --concurrency 64 --wave "
                                                         "--requests-per-point 64 --rounds 1 --warmup 2", 200),
                                               ("free-after-burst", NVIDIA_SMI, 30),
                                               ("free-slots", "metrics omnirt_stage_free_slots", 30)),
                                   log_level="info", log_grep="omnirt.memory|KV cache:"),
                             MustFail("half", "--gpu-memory-utilization 0.5"),
                             MustFail("thinker-30", "--stage-overrides '{\"thinker\": {\"gpu_memory_utilization\": "
                                                    "0.3}}'"))),
    "grammar": Scenario("constrained decoding: the kernels, then served (free, json_schema, tool_choice required) "
                        "and voice sessions with and without transcripts of the user",
                        (GRAMMAR_KERNELS, Serve("{variant}", (
                            ("grammar-serve", "run -m omnirt.loadtest.gpu.grammar_check --skip-kernels --url {url} "
                                              "--model {model} --concurrency {concurrency}", 300),
                            ("transcripts-cancel", "voice --sessions {sessions} --turns 3 --mode cancel "
                                                   "--transcription both", 300),
                            ("transcripts-converse", "voice --sessions {sessions} --turns 3 --mode converse "
                                                     "--transcription both", 300)), VOICE_SERVER)),
                        {"variant": "profile", "concurrency": "64", "sessions": "1 32"}),
    "abusive": Scenario("chat TTFP of the voice bench's utterance as input_audio, one session of 6 turns, then "
                        "sessions beside one abusive session (flood, garbage, deaf)",
                        (Serve("{variant}", (("utterance-chat",
                                              "run -m omnirt.loadtest.gpu.utterance_chat {url} {model}", 120),
                                             ("voice-one", "voice --sessions 1 --turns 6 --mode cancel --clients 1",
                                              200),
                                             ("abusive", "voice --sessions {sessions} --turns 3 --mode cancel "
                                                         "--abusive 1 --deaf-s {deaf_s}", 300)),
                               VOICE_SERVER, log_level="info"),),
                        {"variant": "profile", "sessions": "32", "deaf_s": "20"}),
    "api-workers": Scenario("per count of API processes: the VAD alone at 64 and 128 sessions, 32 WebRTC calls",
                            (ForEach("workers", (Serve("profile", (
                                ("api-workers-{each}-vad", "voice --sessions 64 128 --turns 3 --mode no-responses",
                                 300),
                                ("api-workers-{each}-webrtc", "voice --sessions 32 --turns 3 --mode cancel "
                                                              "--transport webrtc", 300)),
                                "--realtime-max-sessions 200 --api-workers {each}", name="workers-{each}"),)),),
                            {"workers": "1 4"}),
    "front-end": Scenario("the audio front end alone (no replies) on the full-size server, per count of API processes: "
                          "VAD-only sessions up to 512, then `models` sessions with semantic_vad, noise reduction "
                          "and both on (server_vad alone is the first point of that count)",
                          (ForEach("workers", (Serve("profile", (
                              ("front-end-{each}", "voice --sessions {sessions} --turns 3 --mode no-responses",
                               "{point_limit}"),
                              *((f"front-end-{{each}}-{name}", f"?models voice --sessions {{models}} --turns 3 "
                                f"--mode no-responses {flags}", "{point_limit}") for name, flags in FRONT_END_MODELS),
                              ("front-end-{each}-metrics", "metrics omnirt_front_end omnirt_realtime_sessions "
                                                           "process_cpu_seconds_total", 30)),
                              "--realtime-max-sessions 1000 --api-workers {each}", name="workers-{each}",
                              log_level="info", log_grep="API workers|refus"),)),),
                          {"workers": "auto", "sessions": "1 64 256 512", "models": "64", "point_limit": "400"}),
    "talker-process": Scenario("the transport's CUDA IPC test, then a stage in a worker process against all in the "
                               "core, /dev/shm listed before and after",
                               (check("transport-test", "-m pytest -q --noconftest -p no:cacheprovider "
                                      "tests/test_transport.py"), check("shm-before", "ls /dev/shm"), ABLATION,
                                check("shm-after", "ls /dev/shm")),
                               {**ABLATION_PARAMS, "variants": "profile talker-process talker-process-host-ring"}),
}
