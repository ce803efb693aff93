"""The servers the benchmarks compare, by name: every variant's `omnirt serve` arguments, in this one table.

A variant is the deploy profile as shipped with one thing changed: a layer switched off (an ablation), another
kernel, another process layout, or transformers' own `generate()` (`reference`). Each change is a deploy profile
key set with `--set KEY=VALUE`. `omnirt bench --serve VARIANT`, `omnirt/loadtest/compare.sh` and the GPU driver
(`python -m omnirt.loadtest.gpu`) all start their servers from here, so that no other file spells these settings.
Variants combine with `+` (`fixed-ramp+no-priority`): their settings are joined, a later one winning a key.

    python -m omnirt.loadtest.variants            # the table: name, what changes, the arguments
"""

from __future__ import annotations

import sys


def _set(*settings: str) -> tuple[str, ...]:
    return tuple(arg for kv in settings for arg in ("--set", kv))


# name -> (what it changes, `omnirt serve` arguments)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "profile": ("the deploy profile as shipped, every layer on", ()),
    "reference": ("transformers' generate(), one request at a time, nothing streamed", _set("engine=reference")),
    "inproc": ("the engine in the API process instead of a core process of its own", ("--engine-process", "inproc")),
    "no-graphs": ("no CUDA graphs, nothing compiled, in any stage", ("--enforce-eager",)),
    "no-async-chunk": ("whole-payload hand-off: the Talker starts after the Thinker, Code2Wav after the Talker",
                       _set("async_chunk=false")),
    "no-async-output": ("stage threads wait for the consumer of every output", _set("async_output=false")),
    "no-priority": ("steps in arrival order, no first-packet priority", _set("first_packet_priority=false")),
    "no-prefix-caching": ("every turn prefills its whole prompt", _set("stages.*.prefix_caching=false")),
    "compile-off": ("graphs of the uncompiled layers", _set("compile=off")),
    "dense-attention": ("SDPA over a dense copy of the KV cache per layer", _set("attention=dense")),
    "grouped-mm": ("transformers' grouped_mm experts instead of the fused Triton kernels",
                   _set("moe_backend=grouped_mm")),
    "unfused-steps": ("decode steps as before slot attention, compiled layers and fused experts",
                      _set("attention=dense", "compile=off", "moe_backend=grouped_mm")),
    "sync-talker": ("the Talker's synchronous step loop", _set("stages.talker.async_scheduling=false")),
    "fp8": ("the decoders' weights in block-scaled FP8 on any device (the profile: where bf16 takes over half of it)",
            _set("quantization=fp8")),
    "bf16": ("the decoders' weights in bf16 on any device", _set("quantization=none")),
    "eager-prefill": ("prefill through the eager modules, not the compiled layers",
                      _set("stages.thinker.compiled_prefill=false", "stages.talker.compiled_prefill=false")),
    "fixed-ramp": ("the fixed 4/8/16/25-frame chunk ramp instead of adaptive pacing",
                   _set("connector.codec_chunk_pacing=fixed")),
    "c2w-eager": ("Code2Wav eager with transformers' convolutions (the profile before the Triton kernels)",
                  _set("conv_backend=native", "stages.code2wav.enforce_eager=true")),
    "c2w-triton-eager": ("Code2Wav's Triton convolutions without graphs", _set("stages.code2wav.enforce_eager=true")),
    "c2w-compiled-graphs": ("graphs of the inductor-compiled Code2Wav (minutes of start-up at full size)",
                            _set("stages.code2wav.enforce_eager=false", "stages.code2wav.compile=auto")),
    "c2w-gemm": ("Code2Wav's convolutions as matmuls over their taps", _set("conv_backend=gemm")),
    "c2w-channels-last": ("Code2Wav's convolutions through cuDNN's NHWC kernels", _set("conv_backend=channels_last")),
    "talker-process": ("the Talker in a worker process of its own, rows in device memory",
                       _set("stages.talker.own_process=true")),
    "talker-process-host-ring": ("the same, rows through host shared memory",
                                 _set("stages.talker.own_process=true", "stages.talker.device_ipc=false")),
    "c2w-process": ("Code2Wav in a worker process of its own", _set("stages.code2wav.own_process=true")),
    "speech-processes": ("the Talker and Code2Wav in worker processes of their own",
                         _set("stages.talker.own_process=true", "stages.code2wav.own_process=true")),
    # the parity check's server (`hf-parity`, `make test-gpu`): one request at a time through the same batch-1
    # graphs, compiled layers and kernels; fits an 80 GB H100 beside transformers' activations and the GPU tests
    # (the full profile's 64-request KV and Code2Wav graphs take 82 GiB) and starts sooner
    "four-requests": ("room for 4 requests, KV for them only (no gpu_memory_utilization), a 4096-token Talker "
                      "prefill graph", _set("gpu_memory_utilization=null", "stages.thinker.max_num_seqs=4",
                                            "stages.talker.max_num_seqs=4", "stages.code2wav.max_num_seqs=4",
                                            "stages.talker.prefill_graph_tokens=4096")),
    # a 48 GB card (L40S): FP8 decoders (34.9 GiB) leave ~9 GiB; KV for 8 requests, Code2Wav graphs for 8
    "48g": ("FP8 decoders, room for 8 requests, KV for them only, a 4096-token Talker prefill graph (a 48 GB card)",
            _set("quantization=fp8", "gpu_memory_utilization=null", "stages.thinker.max_num_seqs=8",
                 "stages.talker.max_num_seqs=8", "stages.code2wav.max_num_seqs=8",
                 "stages.talker.prefill_graph_tokens=4096")),
    **{f"budget-{b}": (f"prefill budget {b} tokens a step (Thinker), {max(b, 8192)} (Talker)",
                       _set(f"stages.thinker.max_num_batched_tokens={b}",
                            f"stages.talker.max_num_batched_tokens={max(b, 8192)}"))
       for b in (1024, 2048, 8192, 16384)},
}


def serve_args(spec: str) -> list[str]:
    """The `omnirt serve` arguments of a variant, or of several joined by `+` (in order: a later one wins a key)."""
    args = []
    for name in spec.split("+"):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; the variants: {', '.join(VARIANTS)}")
        args += VARIANTS[name][1]
    return args


if __name__ == "__main__":
    for name, (what, args) in VARIANTS.items():
        print(f"{name:26} {what}\n{'':26} {' '.join(args) or '(none)'}")
    sys.exit(0)
