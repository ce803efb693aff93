"""The audio encoder at full size: transformers' call (lengths read back from the device) against the engine's
(`audio_tower_rows`: lengths worked out on the host, attention off cuDNN, every window of a layer in one call), their
rows, and what each costs a voice turn's prefill.

    python -m omnirt.loadtest.gpu.audio_encoder_check   (the GPU driver's `audio-encoder` scenario)
    python -m omnirt.loadtest.gpu.audio_encoder_check --device meta   (anywhere: the operator counts alone)

Builds the released audio encoder (random weights, bf16) and encodes batches of 1 and 8 utterances of the bench's
lengths (1.4-7.7 s; random features, a prefix mask). Per batch, one JSON line: the torch operators the engine's call
dispatches with the attention per window (transformers' way) and in one call a layer (the host's work, views
included: a proxy for the kernels launched); whether the rows are equal and their relative RMS difference (the
engine's attention avoids cuDNN's kernels: `ENCODER_ATTENTION`); and for each call the host's time in it (what the
Thinker's stage thread spends before it can launch the prefill) and the time until its rows are ready, on an idle
device and beside a stream kept busy with other work (as the Talker's and Code2Wav's steps keep it while a turn is
prefilled). Each timed call has lengths one frame longer than the last, as every turn's utterance is new: cuDNN's
attention builds a plan for each new shape.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as cfgs
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as mods

from omnirt.loadtest.host_ops import OpCount
from omnirt.pipeline.models.qwen3_omni.encoders import audio_tower_rows
from omnirt.pipeline.models.qwen3_omni.released import ARCHITECTURE

SECONDS = (1.4, 7.7, 3.1, 5.2, 2.2, 6.4, 4.0, 2.9)  # within the shipped utterances' range
HOP_S = 0.01  # a mel frame


def transformers_rows(tower, features: torch.Tensor, mask: torch.Tensor, device, dtype) -> torch.Tensor:
    """What `get_audio_features` does: the inputs on the device, every length read back from there."""
    features, mask = features.to(device, dtype), mask.to(device)
    packed = features.permute(0, 2, 1)[mask.bool()].permute(1, 0)
    return tower(packed, feature_lens=mask.sum(-1), return_dict=True).last_hidden_state


def batch(n: int, mel: int, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    frames = [int(s / HOP_S) + extra for s in SECONDS[:n]]
    g = torch.Generator().manual_seed(n)
    features = torch.randn(n, mel, max(frames), generator=g)
    mask = (torch.arange(max(frames)) < torch.tensor(frames)[:, None]).long()
    return features * mask[:, None], mask


def timed(fn, repeats: int) -> tuple[float, float]:
    """(ms of host time in a call, ms until its result is ready), means over `repeats` calls."""
    host = ready = 0.0
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        host += time.perf_counter() - t
        torch.cuda.synchronize()
        ready += time.perf_counter() - t
    return round(1e3 * host / repeats, 2), round(1e3 * ready / repeats, 2)


class BusyStream:
    """Another stream kept busy with 4096 x 4096 bf16 matmuls (~0.1 ms each on an H100), from its own thread."""

    def __init__(self, device):
        self.device, self.stop = device, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        a = torch.randn(4096, 4096, device=self.device, dtype=torch.bfloat16)
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream), torch.inference_mode():
            while not self.stop.is_set():
                for _ in range(20):
                    a = (a @ a).clamp_(-1, 1)
                stream.synchronize()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def released_tower(device: torch.device, dtype: torch.dtype):
    """The released audio encoder's architecture, random weights, built on `device` (no host copy first)."""
    with device:
        tower = mods.Qwen3OmniMoeAudioEncoder(cfgs.Qwen3OmniMoeAudioEncoderConfig(**ARCHITECTURE["thinker"]["audio"]))
    return tower.to(dtype).eval()


def op_counts(tower, n: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Operators of the engine's call for `n` utterances: the attention per window, and in one call a layer."""
    features, mask = batch(n, tower.config.num_mel_bins)
    out = {}
    for name, one_call in (("ops_per_window", False), ("ops_one_call", True)):
        with OpCount() as ops:
            audio_tower_rows(tower, features, mask, device, dtype, one_call=one_call)
        out[name] = ops.count
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda, or meta: the operator counts alone (no GPU needed)")
    args = p.parse_args()
    if args.device != "meta" and not torch.cuda.is_available():
        raise SystemExit("audio_encoder_check needs a CUDA device (or --device meta)")
    device, dtype = torch.device(args.device, 0) if args.device == "cuda" else torch.device("meta"), torch.bfloat16
    tower = released_tower(device, dtype)
    print(json.dumps({"layers": len(tower.layers), "params_m": round(sum(p.numel() for p in tower.parameters()) / 1e6),
                      "attention": tower.config._attn_implementation}), flush=True)
    with torch.inference_mode():
        for n in (1, 8):
            row = {"audios": n, "seconds": round(sum(SECONDS[:n]), 1)} | op_counts(tower, n, device, dtype)
            if device.type == "cuda":
                row |= measure(tower, n, device, dtype, args.repeats)
            print(json.dumps(row), flush=True)


def measure(tower, n: int, device, dtype, repeats: int) -> dict:
    features, mask = batch(n, tower.config.num_mel_bins)

    calls = iter(range(1, 10**6))

    def inputs(new: bool) -> tuple[torch.Tensor, torch.Tensor]:  # new: lengths not seen before, as every turn's
        return batch(n, tower.config.num_mel_bins, next(calls)) if new else (features, mask)

    def ours(new: bool = True, one_call: bool = True):
        return audio_tower_rows(tower, *inputs(new), device, dtype, one_call=one_call)

    def theirs(new: bool = True):
        return transformers_rows(tower, *inputs(new), device, dtype)

    def per_window():
        return ours(one_call=False)

    a, b = ours(False).float(), theirs(False).float()
    row = {"equal": bool(torch.equal(a, b)), "rel_rms": float((a - b).norm() / b.norm()),
           "rel_rms_per_window": float((ours(False, one_call=False).float() - b).norm() / b.norm())}
    row |= {"transformers_idle": timed(theirs, repeats), "engine_per_window_idle": timed(per_window, repeats),
            "engine_idle": timed(ours, repeats)}
    with BusyStream(device):
        time.sleep(0.2)
        row |= {"transformers_busy": timed(theirs, repeats), "engine_per_window_busy": timed(per_window, repeats),
                "engine_busy": timed(ours, repeats)}
    return row

if __name__ == "__main__":
    main()
