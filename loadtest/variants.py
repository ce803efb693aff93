"""The servers the benchmarks compare, by name: every variant's `omnirt serve` arguments, in this one table.

A variant is the deploy profile as shipped with one thing changed: a layer switched off (an ablation), another
kernel, another process layout, or transformers' own `generate()` (`reference`). `omnirt bench --serve VARIANT`,
`loadtest/compare.sh` and the GPU driver (`python -m loadtest.gpu`) all start their servers from here, so that no
other file spells these flags. Variants combine with `+` (`fixed-ramp+no-priority`): their arguments are joined,
their stage overrides merged.

    python -m loadtest.variants            # the table: name, what changes, the arguments
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

STAGE_KEYS = "--stage-overrides"
PROFILE_KEY = "--profile-key"  # KEY=VALUE on a copy of the deploy profile (the connector's keys have no flag)


def _stages(overrides: dict) -> tuple[str, str]:
    return STAGE_KEYS, json.dumps(overrides, separators=(",", ":"))


# name -> (what it changes, `omnirt serve` arguments)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "profile": ("the deploy profile as shipped, every layer on", ()),
    "reference": ("transformers' generate(), one request at a time, nothing streamed", ("--engine", "reference")),
    "inproc": ("the engine in the API process instead of a core process of its own", ("--engine-process", "inproc")),
    "no-graphs": ("no CUDA graphs, nothing compiled, in any stage", ("--enforce-eager",)),
    "no-async-chunk": ("whole-payload hand-off: the Talker starts after the Thinker, Code2Wav after the Talker",
                       ("--no-async-chunk",)),
    "no-async-output": ("stage threads wait for the consumer of every output", ("--no-async-output",)),
    "no-priority": ("steps in arrival order, no first-packet priority", ("--no-first-packet-priority",)),
    "no-prefix-caching": ("every turn prefills its whole prompt", ("--no-prefix-caching",)),
    "compile-off": ("graphs of the uncompiled layers", ("--compile", "off")),
    "dense-attention": ("SDPA over a dense copy of the KV cache per layer", ("--attention", "dense")),
    "grouped-mm": ("transformers' grouped_mm experts instead of the fused Triton kernels",
                   ("--moe-backend", "grouped_mm")),
    "unfused-steps": ("decode steps as before slot attention, compiled layers and fused experts",
                      ("--attention", "dense", "--compile", "off", "--moe-backend", "grouped_mm")),
    "sync-talker": ("the Talker's synchronous step loop", _stages({"1": {"async_scheduling": False}})),
    "eager-prefill": ("prefill through the eager modules, not the compiled layers",
                      _stages({"0": {"compiled_prefill": False}, "1": {"compiled_prefill": False}})),
    "fixed-ramp": ("the fixed 4/8/16/25-frame chunk ramp instead of adaptive pacing",
                   (PROFILE_KEY, "codec_chunk_pacing=fixed")),
    "c2w-eager": ("Code2Wav eager with transformers' convolutions (the profile before the Triton kernels)",
                  ("--conv-backend", "native", *_stages({"2": {"enforce_eager": True}}))),
    "c2w-triton-eager": ("Code2Wav's Triton convolutions without graphs", _stages({"2": {"enforce_eager": True}})),
    "c2w-compiled-graphs": ("graphs of the inductor-compiled Code2Wav (minutes of start-up at full size)",
                            _stages({"2": {"enforce_eager": False, "compile": "auto"}})),
    "c2w-gemm": ("Code2Wav's convolutions as matmuls over their taps", ("--conv-backend", "gemm")),
    "c2w-channels-last": ("Code2Wav's convolutions through cuDNN's NHWC kernels", ("--conv-backend", "channels_last")),
    "talker-process": ("the Talker in a worker process of its own, rows in device memory",
                       _stages({"1": {"own_process": True}})),
    "talker-process-host-ring": ("the same, rows through host shared memory",
                                 _stages({"1": {"own_process": True, "device_ipc": False}})),
    "c2w-process": ("Code2Wav in a worker process of its own", _stages({"2": {"own_process": True}})),
    "speech-processes": ("the Talker and Code2Wav in worker processes of their own",
                         _stages({"1": {"own_process": True}, "2": {"own_process": True}})),
    **{f"budget-{b}": (f"prefill budget {b} tokens a step (Thinker), {max(b, 8192)} (Talker)",
                       _stages({"0": {"max_num_batched_tokens": b}, "1": {"max_num_batched_tokens": max(b, 8192)}}))
       for b in (1024, 2048, 8192, 16384)},
}


def serve_args(spec: str, deploy_config: Path | None = None) -> list[str]:
    """The `omnirt serve` arguments of a variant or of several joined by `+`; a profile key is written into a copy
    of `deploy_config` (the profile the server is given), which the arguments then name."""
    args, stages, keys = [], {}, {}
    for name in spec.split("+"):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; the variants: {', '.join(VARIANTS)}")
        it = iter(VARIANTS[name][1])
        for arg in it:
            if arg == STAGE_KEYS:
                for sid, entry in json.loads(next(it)).items():
                    stages.setdefault(sid, {}).update(entry)
            elif arg == PROFILE_KEY:
                key, _, value = next(it).partition("=")
                keys[key] = value
            else:
                args.append(arg)
    if stages:
        args += _stages(stages)
    if keys:
        if deploy_config is None:
            raise SystemExit(f"variant {spec!r} changes the deploy profile: give the server one (--deploy-config)")
        args += ["--deploy-config", str(edited_profile(deploy_config, keys))]
    return args


def edited_profile(path: Path, keys: dict[str, str]) -> Path:
    """A copy of the profile at `path` with each `key: value` line's value replaced (the key must be there)."""
    text = path.read_text()
    for key, value in keys.items():
        text, found = re.subn(rf"^(\s*{re.escape(key)}:).*$", rf"\g<1> {value}  # the variant's", text, count=1,
                              flags=re.M)
        if not found:
            raise SystemExit(f"{path} has no {key!r} line to change")
    out = Path(tempfile.mkdtemp(prefix="omnirt-variant-")) / path.name
    out.write_text(text)
    return out


if __name__ == "__main__":
    for name, (what, args) in VARIANTS.items():
        print(f"{name:26} {what}\n{'':26} {' '.join(args) or '(none)'}")
    sys.exit(0)
