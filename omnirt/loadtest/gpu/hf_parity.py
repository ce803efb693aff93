"""Parity with transformers that can fail: the engine as served (CUDA graphs, compiled layers, slot attention,
fused experts), teacher-forced on transformers' own tokens, against transformers' logits on the same prefix.

Both sides run the same modules of one loaded model (the same weight tensors). Per prompt, transformers'
`generate()` (its `grouped_mm` experts, SDPA) makes a greedy reply: text tokens, codec frames (16 codes) and the
logits of every Thinker step, Talker step and code-predictor step. The engine then serves the same prompt with
those tokens forced (`SamplingParams.forced`: each step emits the reference's token, the code predictor the
reference's codes) and hands back its own logits of every step; so both sides' step k sees the same prefix, and
differences do not compound through differing choices. Compared per stage: max and mean |engine - reference|,
and top-1 agreement. Code2Wav's waveform for those same codes against transformers' own Code2Wav (a copy kept
before the engine re-expresses its convolutions) decoding the engine's windows (the profile's chunking): SNR and
max error; against transformers' whole-reply `chunked_decode` too, reported only (what the chunking's shorter left
context costs, not a kernel's rounding). Free-running replies come after, as a report of where they part.

The bound, stated before any run. bf16 keeps 8 significant bits: rounding a value x errs by at most u|x| with
u = 2^-8 (`torch.finfo(dtype).eps / 2`; float32's 2^-24 for the tiny model). Two paths that compute the same
function with different kernels round differently, so each rounded tensor may differ between them by up to
about u of its size; a matrix product accumulates its K terms in float32 first, which adds up to sqrt(K) * 2^-24
(K the hidden size: 2^-18.5 at full size, nothing beside bf16's u, but most of the tiny float32 model's). So
each rounding counts u' = u + sqrt(K) * 2^-24. A decoder layer rounds its result in series R = 6 times
(attention output, its projection, the residual sum, the experts' output, the residual sum, the norm); the
residual stream carries a relative error on with gain about 1 (each layer adds to it, and the norms are
scale-free), so independent rounding differences add up as a random walk: after N = 6 * L layers the hidden
state's relative difference has rms <= u' * sqrt(N), and the logits (a linear map of it, rounded once more)
inherit it. With s = u' * sqrt(N + 1) * rms(reference logits of the step), a step passes when
    mean |d| <= s            and            max |d| <= Z * s,   Z = 6
(the largest of some 10^7 Gaussian draws, a step's vocabulary over 64 steps, is about 5.3 of its sigma).
L counts every layer the logits depend on: the Thinker's layers; for the Talker, the Thinker's layers up to the
one it reads (`accept_hidden_layer`) plus its own; for the code predictor, those plus its own; an audio or image
prompt adds its encoder's layers plus one (its input embedding and output merger). Code2Wav: N = its modules with
weights (each rounds its output once), K their largest fan-in; the waveform must keep
SNR >= -20 log10(u' sqrt(N + 1)) dB and max |d| <= Z * u' * sqrt(N + 1) * rms(reference waveform).
A negative control shows the check can fail: the same forced requests with the attention's scale broken in the
served path only (`broken_attention`: every Thinker and Talker layer's q_norm weight multiplied in place, which
the captured graphs and compiled layers read), after the reference's logits are kept; the check must fail it at
x2, and the summary says whether it also fails x1.1 and x1.02, and experts 0 and 1 trading weights in every MoE
layer (`swapped_experts`: only the tokens routed to them go wrong), to show how small a break it sees.
`python -m omnirt.loadtest.gpu.hf_parity -- --model qwen3-omni-30b-a3b --load-format dummy --deploy-config
qwen3_omni_moe_1gpu`: one JSON line per prompt as it is compared, then the summary (`"pass"`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import sys
import time
from dataclasses import dataclass, field
from statistics import median

import numpy as np
import torch

from omnirt.loadtest.gpu_check import cli
from omnirt.pipeline.api import OmniRequest, collect_reply
from omnirt.pipeline.models.qwen3_omni.generate import prompt_kwargs

VOICE = "ethan"
PENALTY = 1.05  # the Talker's repetition penalty, both sides
STARTED = time.monotonic()  # --budget-s counts from here: the engine's start-up included
ROUNDINGS_PER_LAYER = 6
Z = 6.0  # the largest difference of a step, in its rms bound


def prompts() -> list[list[dict]]:
    """16 prompts: text (one with a system prompt, long, code, non-Latin, three multi-turn), audio (a tone, a chirp,
    noise, short, in a second turn), images (smooth noise and a gradient, 448 x 640: 280 image tokens through the
    vision encoder and its deepstack layers; one with audio; one in an earlier turn)."""
    rng = np.random.default_rng(0)
    picture = np.kron(rng.integers(0, 256, (14, 20, 3), dtype=np.uint8), np.ones((32, 32, 1), dtype=np.uint8))
    gradient = np.broadcast_to(np.linspace(0, 255, 640, dtype=np.uint8)[None, :, None], (448, 640, 3)).copy()
    t = np.arange(16000 * 3) / 16000
    tone = (0.3 * np.sin(2 * np.pi * 440 * t[:16000]) * np.exp(-t[:16000])).astype(np.float32)
    chirp = (0.2 * np.sin(2 * np.pi * (200 + 300 * t) * t)).astype(np.float32)
    noise = (0.05 * rng.standard_normal(32000)).astype(np.float32)
    short = (0.3 * np.sin(2 * np.pi * 880 * t[:8000])).astype(np.float32)

    def user(*parts) -> dict:
        return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}

    def audio(a: np.ndarray) -> dict:
        return {"type": "audio", "audio": a}

    def image(i: np.ndarray) -> dict:
        return {"type": "image", "image": i}

    system = {"role": "system", "content": "You are a helpful assistant."}
    return [
        [system, {"role": "user", "content": "Hello, how are you today?"}],
        [{"role": "user", "content": "Tell me something about the sea " * 6}],
        [{"role": "user", "content": "What does this do?\ndef f(xs):\n    return sorted(set(xs))[-2]"}],
        [{"role": "user", "content": "你好，请用三句话介绍一下你自己。"}],
        [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Nice to meet you, Ada."},
         {"role": "user", "content": "What is my name?"}],
        [system, {"role": "user", "content": "Pick a number."}, {"role": "assistant", "content": "Seven."},
         {"role": "user", "content": "Double it."}, {"role": "assistant", "content": "Fourteen."},
         {"role": "user", "content": "And now halve that and add one."}],
        [{"role": "user", "content": "Write a haiku about autumn."}, {"role": "assistant", "content": "Leaves fall."},
         {"role": "user", "content": "Longer, please."}],
        [user(audio(tone), "What is this?")],
        [{"role": "system", "content": "Answer briefly."}, user(audio(chirp))],
        [user(audio(noise), "Is anyone speaking?")],
        [user(audio(short))],
        [{"role": "user", "content": "I will play you a sound."}, {"role": "assistant", "content": "Go ahead."},
         user(audio(tone))],
        [user(image(picture), "Describe it.")],
        [user(image(gradient), "Which side is brighter?")],
        [user(image(picture), audio(chirp), "Does the sound match the picture?")],
        [user(image(gradient), "Remember this picture."), {"role": "assistant", "content": "I will."},
         {"role": "user", "content": "What colour was it?"}],
    ]


def _kind(messages: list[dict]) -> str:
    """"image", "audio" or "text" (the richest part of the prompt), "-turns" added for a conversation."""
    kind = next((k for k in ("image", "audio") if _has(messages, k)), "text")
    return kind + ("-turns" if any(m["role"] == "assistant" for m in messages) else "")


class Logits:
    """The last position's logits of every call of `module` (one generation step each)."""

    def __init__(self, module: torch.nn.Module):
        self.steps: list[torch.Tensor] = []
        self.handle = module.register_forward_hook(lambda m, a, out: self.steps.append(out[0, -1].float().cpu()))

    def close(self) -> list[torch.Tensor]:
        self.handle.remove()
        return self.steps


@dataclass
class Reply:
    """One side's reply: text tokens (EOS included), codec frames [frames][16], the logits of each Thinker step,
    each Talker step (its first codebook) and, per frame, the code predictor's [15, vocab], and the waveform."""

    tokens: list[int]
    frames: list[list[int]]
    thinker: list[torch.Tensor]
    talker: list[torch.Tensor]
    codebooks: list[torch.Tensor]
    wav: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    windows: list = field(default_factory=list)  # the Code2Wav windows the engine decoded it in


@torch.inference_mode()
def reference(models, messages: list[dict], tokens: int, frames: int) -> Reply:
    """transformers' generate() of the prompt, greedy, with its own experts implementation (grouped_mm)."""
    hf = models.hf
    kw = prompt_kwargs(hf, models.encoder.encode(messages), models.thinker.device)
    codes, original = {}, hf.code2wav.chunked_decode

    def capture(c, *a, **k):
        codes["c"] = c.clone()
        return original(c, *a, **k)

    hf.code2wav.chunked_decode = capture
    th, tk = Logits(hf.thinker.lm_head), Logits(hf.talker.codec_head)
    heads = [Logits(h) for h in hf.talker.code_predictor.lm_head]  # codebook g + 1's head, once per frame
    try:  # min tokens: every reply runs its full length (random weights may end one early)
        with experts(hf, "grouped_mm"):
            seqs, wav = hf.generate(**kw, speaker=VOICE, return_audio=True, thinker_max_new_tokens=tokens,
                                    thinker_min_new_tokens=tokens, thinker_do_sample=False,
                                    thinker_eos_token_id=models.thinker.eos_ids[0], talker_max_new_tokens=frames + 1,
                                    talker_min_new_tokens=frames + 1, talker_do_sample=False,
                                    talker_repetition_penalty=PENALTY)
    finally:
        hf.code2wav.chunked_decode = original
        thinker, talker, rows = th.close(), tk.close(), [h.close() for h in heads]
    books = [torch.stack([r[f] for r in rows]) for f in range(min(map(len, rows)))]
    return Reply(seqs[0, kw["input_ids"].shape[1]:].tolist(), codes["c"][0].T.tolist(), thinker, talker, books,
                 wav.reshape(-1).float().cpu().numpy())


@contextlib.contextmanager
def experts(hf, name: str):
    """transformers' experts implementation `name` for a while; every config's own value back after (the engine's)."""
    configs = experts_configs(hf)
    saved = [c._experts_implementation_internal for c in configs]
    hf.set_experts_implementation(name)
    try:
        yield
    finally:
        for c, value in zip(configs, saved):
            c._experts_implementation_internal = value  # as set, not spread to its sub-configs


def experts_configs(hf) -> list:
    """Every config object of the model that holds an experts implementation: the modules' and their sub-configs."""
    found, stack = {}, [m.config for m in hf.modules() if hasattr(getattr(m, "config", None), "sub_configs")]
    while stack:
        c = stack.pop()
        if id(c) not in found:
            found[id(c)] = c
            stack += [sub for k in c.sub_configs if (sub := getattr(c, k, None)) is not None]
    return [c for c in found.values() if hasattr(c, "_experts_implementation_internal")]


class Tap:
    """Every step's logits the engine's runners produce, per (request id, step), on the host; and the float
    waveform Code2Wav decodes (one request at a time)."""

    def __init__(self, engine):
        self.rows: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
        self.codebooks: dict[tuple[str, int], torch.Tensor] = {}
        self.wav: list[np.ndarray] = []
        self.windows: list = []
        for stage in engine.stages:
            if hasattr(stage.runner, "launch"):
                stage.runner.launch = self._launch(stage.runner.launch, self.rows.setdefault(stage.name, {}))
        c2w, decode = engine.models.code2wav, engine.models.code2wav.decode
        c2w.decode = lambda windows: self.windows.extend(windows) or self.wav.extend(out := decode(windows)) or out

    def _launch(self, original, rows: dict):
        def launch(batch):
            steps = [r.num_outputs for r in batch.requests]  # the step each row samples (before it is issued)
            issued = original(batch)
            for r, k, o in zip(batch.requests, steps, issued.outputs):
                if o.logits is not None:
                    rows[(r.request_id, k)] = o.logits.float().cpu()
                if o.inner_logits is not None:  # decode step k completes frame k - 1
                    self.codebooks[(r.request_id, k - 1)] = o.inner_logits.float().cpu()
            return issued
        return launch

    def reply(self, rid: str, tokens: list[int], frames: list[list[int]]) -> Reply:
        out = Reply(tokens, frames, _steps(self.rows.get("thinker", {}), rid), _steps(self.rows.get("talker", {}), rid),
                    _steps(self.codebooks, rid), np.concatenate(self.wav) if self.wav else np.zeros(0, np.float32),
                    self.windows)
        self.wav, self.windows = [], []
        return out


def _steps(rows: dict, rid: str) -> list[torch.Tensor]:
    """A request's rows from step 0 on, taken out of the tap (a Thinker row is 0.6 MB at full size)."""
    out = []
    while (row := rows.pop((rid, len(out)), None)) is not None:
        out.append(row)
    return out


async def serve(engine, tap: Tap, rid: str, messages: list[dict], tokens: int, frames: int,
                forced: Reply | None = None) -> Reply:
    """One greedy request through the engine; with `forced`, its tokens and frames in place of sampling."""
    n = len(forced.tokens) if forced else tokens  # min tokens as the reference's
    thinker = {"temperature": 0.0, "max_tokens": n, "min_tokens": n}
    talker = {"temperature": 0.0, "max_tokens": frames + 1, "min_tokens": frames + 1, "repetition_penalty": PENALTY}
    teacher = {"thinker": tuple(forced.tokens), "talker": tuple(tuple(f) for f in forced.frames)} if forced else {}
    fed, decode = [], engine.models.code2wav.decode

    def capture(windows):
        for w in windows:
            fed.extend(w.codes[w.num_context:])
        return decode(windows)

    engine.models.code2wav.decode = capture
    try:
        reply = await collect_reply(await engine.submit(OmniRequest(
            rid, messages, ("text", "audio"), voice=VOICE, thinker_sampling=thinker, talker_sampling=talker,
            forced=teacher)))
    finally:
        engine.models.code2wav.decode = decode
    return tap.reply(rid, list(reply.token_ids), [list(f) for f in fed])


@contextlib.contextmanager
def pristine_code2wav():
    """While the engine is built: a copy of transformers' Code2Wav as loaded, before the engine re-expresses its
    convolutions in place (`conv_backend`), so that the reference runs transformers' own modules. Yields a list
    that holds it once built."""
    from omnirt.pipeline.models.qwen3_omni import code2wav as module

    kept, swap = [], module.use_conv_backend

    def keep(c2w, backend):
        kept.append(copy.deepcopy(c2w))
        swap(c2w, backend)

    module.use_conv_backend = keep
    try:
        yield kept
    finally:
        module.use_conv_backend = swap


@torch.inference_mode()
def code2wav_references(pristine, c2w, ours: Reply) -> tuple[np.ndarray, np.ndarray]:
    """transformers' Code2Wav on the engine's codes: in the engine's windows (the profile's chunking), and the
    whole reply at once (`chunked_decode`, as generate() decodes it)."""
    device = next(pristine.parameters()).device

    def decode(codes: list[list[int]]) -> np.ndarray:
        return pristine(torch.tensor(codes, device=device).T[None])[0, 0].float().cpu().numpy()

    windows = [c2w.new_samples(w, decode(w.codes)) for w in ours.windows]
    whole = pristine.chunked_decode(torch.tensor(ours.frames, device=device).T[None])
    return (np.concatenate(windows) if windows else np.zeros(0, np.float32),
            whole.reshape(-1).float().cpu().numpy())


@dataclass(frozen=True)
class Bound:
    """A stage's rounding scale: u' (the dtype's unit roundoff, plus float32 accumulation over K terms) and N
    (roundings in series before its logits)."""

    unit: float
    roundings: int

    @property
    def rel(self) -> float:
        return self.unit * math.sqrt(self.roundings + 1)


def bounds(models, messages: list[dict], code2wav: torch.nn.Module) -> dict[str, Bound]:
    """Each compared stage's bound for a prompt, from the dtype and the layers its logits depend on (the
    module docstring): an audio or image prompt adds its encoder's layers, plus one for its input embedding and
    output merger."""
    hf, kind = models.hf, _kind(messages)
    u = torch.finfo(hf.thinker.lm_head.weight.dtype).eps / 2

    def unit(k: int) -> float:
        return u + math.sqrt(k) * 2.0 ** -24

    thc = hf.config.thinker_config
    encoder = {"image": thc.vision_config.depth + 1, "audio": thc.audio_config.encoder_layers + 1}
    # an image prompt may hold audio too: the deeper encoder counts
    front = max([encoder["image"]] * kind.startswith("image") + [encoder["audio"]] * _has(messages, "audio"),
                default=0)
    thinker = front + thc.text_config.num_hidden_layers
    tc = hf.config.talker_config
    talker = front + tc.accept_hidden_layer + tc.text_config.num_hidden_layers
    predictor = talker + tc.code_predictor_config.num_hidden_layers
    weighted = [m for m in code2wav.modules() if next(m.parameters(recurse=False), None) is not None]
    fan_in = max((p[0].numel() for m in weighted for p in m.parameters(recurse=False) if p.dim() > 1), default=1)
    r = ROUNDINGS_PER_LAYER
    return {"thinker": Bound(unit(thc.text_config.hidden_size), r * thinker),
            "talker": Bound(unit(tc.text_config.hidden_size), r * talker),
            "code_predictor": Bound(unit(tc.code_predictor_config.hidden_size), r * predictor),
            "code2wav": Bound(unit(fan_in), len(weighted))}


def _has(messages: list[dict], kind: str) -> bool:
    return any(p["type"] == kind for m in messages if isinstance(m["content"], list) for p in m["content"])


def compare(engine: list[torch.Tensor], ref: list[torch.Tensor], bound: Bound) -> dict:
    """Step by step: max and mean |d|, each against its bound (`ratio` <= 1 passes), and top-1 agreement."""
    n = min(len(engine), len(ref))
    if not n:
        return {"steps": 0, "pass": False}
    e, r = torch.stack([x.reshape(-1) for x in engine[:n]]), torch.stack([x.reshape(-1) for x in ref[:n]])
    d = (e - r).abs()
    scale = bound.rel * r.pow(2).mean(-1).sqrt()  # per step
    ratio = torch.maximum(d.mean(-1) / scale, d.amax(-1) / (Z * scale))
    return {"steps": n, "lengths": [len(engine), len(ref)], "max_abs": float(d.max()), "mean_abs": float(d.mean()),
            "top1_agree": float((e.argmax(-1) == r.argmax(-1)).float().mean()), "worst_ratio": float(ratio.max()),
            "worst_step": int(ratio.argmax()), "median_ratio": float(ratio.median()),
            "steps_over": int((ratio > 1.0).sum()),  # a few: a rare jump (an expert chosen on a near-tie); all: a bug
            "pass": bool(ratio.max() <= 1.0)}


def compare_wav(engine: np.ndarray, ref: np.ndarray, bound: Bound) -> dict:
    """SNR and max error of the engine's waveform against transformers', for the same codes."""
    n = min(len(engine), len(ref))
    if not n:
        return {"samples": [len(engine), len(ref)], "pass": False}
    e, r = engine[:n].astype(np.float64), ref[:n].astype(np.float64)
    err, rms = e - r, float(np.sqrt(np.mean(r ** 2))) or 1e-12
    snr = min(10 * math.log10(rms ** 2 / max(float(np.mean(err ** 2)), 1e-300)), 200.0)  # 200: equal
    floor = -20 * math.log10(bound.rel)
    return {"samples": [len(engine), len(ref)], "snr_db": round(snr, 2), "snr_bound_db": round(floor, 2),
            "max_abs": float(np.abs(err).max()), "max_bound": Z * bound.rel * rms,
            "pass": len(engine) == len(ref) and snr >= floor and float(np.abs(err).max()) <= Z * bound.rel * rms}


def forced_result(ours: Reply, ref: Reply, b: dict[str, Bound], wavs: tuple[np.ndarray, np.ndarray]) -> dict:
    """The teacher-forced comparison of one prompt, stage by stage; `wavs`: transformers' Code2Wav of the
    engine's codes in the engine's windows, and whole (the second reported: the chunking's own effect)."""
    out = {"bounds": {k: {"unit": v.unit, "roundings": v.roundings, "rel_rms": v.rel, "z": Z}
                      for k, v in b.items()},
           "thinker": compare(ours.thinker, ref.thinker, b["thinker"]),
           "talker": compare(ours.talker, ref.talker, b["talker"]),
           "code_predictor": compare(ours.codebooks, ref.codebooks, b["code_predictor"]),
           "code2wav": compare_wav(ours.wav, wavs[0], b["code2wav"]),
           "code2wav_vs_whole": compare_wav(ours.wav, wavs[1], b["code2wav"]),
           "tokens_followed": ours.tokens == ref.tokens and ours.frames == ref.frames[:len(ours.frames)]}
    out["pass"] = all(out[k]["pass"] for k in ("thinker", "talker", "code_predictor", "code2wav")) \
        and out["tokens_followed"]
    return out


def parting(ours: list, theirs: list) -> int | None:
    """The first step where two free-running sequences differ (None: equal)."""
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    return k if k is not None or len(ours) == len(theirs) else min(len(ours), len(theirs))


def free_result(free: Reply, ref: Reply, forced: Reply) -> dict:
    """Where the engine's own greedy reply parts from transformers', and why: up to there both saw the same prefix,
    so the forced run's logits at that step are the engine's own there. Each side's margin between its choice and
    the other's (a small one is a near-tie that rounding decided; the Talker's are raw, before the repetition
    penalty)."""
    text = parting(free.tokens, ref.tokens)
    frame = parting([f[0] for f in free.frames], [f[0] for f in ref.frames])
    return {"text_parts_at": text, "text_margins": margins(text, free.tokens, ref.tokens, forced.thinker, ref.thinker),
            "first_code_parts_at": frame,
            "first_code_margins": margins(frame, [f[0] for f in free.frames], [f[0] for f in ref.frames],
                                          forced.talker, ref.talker),
            "frames_equal": free.frames == ref.frames[:len(free.frames)] and len(free.frames) == len(ref.frames)}


def margins(k: int | None, ours: list[int], theirs: list[int], engine: list[torch.Tensor],
            reference: list[torch.Tensor]) -> dict | None:
    """At step k: the engine's logit of its choice minus that of transformers' choice, and the reverse."""
    if k is None or k >= min(len(ours), len(theirs), len(engine), len(reference)):
        return None
    a, b = ours[k], theirs[k]
    return {"engine": round(float(engine[k][a] - engine[k][b]), 4),
            "reference": round(float(reference[k][b] - reference[k][a]), 4)}


@contextlib.contextmanager
def broken_attention(models, factor: float):
    """The negative control: every Thinker and Talker layer's attention scores multiplied by `factor` (the
    q_norm weights scaled in place: the served path's graphs and compiled layers read them)."""
    weights = [layer.self_attn.q_norm.weight for stack in (models.thinker.stack, models.talker.stack)
               for layer in stack.layers]
    with torch.inference_mode():
        for w in weights:
            w.mul_(factor)
    try:
        yield
    finally:
        with torch.inference_mode():
            for w in weights:
                w.div_(factor)


@contextlib.contextmanager
def swapped_experts(models):
    """Another break: experts 0 and 1 trade weights in every MoE layer of the Thinker and the Talker (in place,
    as the fused kernels read them), so only the tokens routed to either compute wrong."""
    weights = [w for stack in (models.thinker.stack, models.talker.stack) for layer in stack.layers
               if hasattr(layer.mlp, "experts") for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj)]

    def swap():
        with torch.inference_mode():
            for w in weights:
                first = w[0].clone()
                w[0].copy_(w[1])
                w[1].copy_(first)

    swap()
    try:
        yield
    finally:
        swap()


def breaks(models, args) -> dict[str, contextlib.AbstractContextManager]:
    """The broken served paths, by name: the first is the negative control (the check must fail it), the others
    show how small a break it sees."""
    scales = map(float, args.break_scales.split())
    out = {f"attention scale x{scale}": broken_attention(models, scale) for scale in scales}
    out["experts 0 and 1 swapped"] = swapped_experts(models)
    return out


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


async def check(engine, pristine, args) -> dict:
    """The whole check on a built engine: references, forced and free runs, the broken attention. A prompt that
    raises is recorded as failed (with the error) and the rest go on."""
    tap, refs, results = Tap(engine), {}, []
    for i, messages in enumerate(prompts()[: args.prompts]):
        if time.monotonic() - STARTED > args.budget_s:
            say(f"budget of {args.budget_s} s spent: {i} prompts")
            break
        try:
            refs[i], row = await compare_prompt(engine, tap, pristine, i, messages, args)
        except Exception as exc:  # noqa: BLE001 - the next prompts still tell something
            row = {"prompt": i, "kind": _kind(messages), "error": f"{type(exc).__name__}: {exc}", "pass": False}
        results.append(row)
        print(json.dumps({"prompt_result": row}), flush=True)
        say(f"prompt {i} ({row['kind']}): {'pass' if row['pass'] else 'FAIL'} {row.get('error', '')}"
            f"({time.monotonic() - STARTED:.0f} s)")
    controls, kept = {}, list(refs.items())[: args.control_prompts]
    for name, broken in breaks(engine.models, args).items():
        controls[name] = await broken_run(engine, tap, pristine, name, broken, kept, args)
        say(f"{name}: {'caught' if controls[name]['caught'] else 'not caught'}")
    return summary(results, controls, args)


async def compare_prompt(engine, tap: Tap, pristine, i: int, messages: list[dict], args) -> tuple[Reply, dict]:
    """One prompt: transformers' reply, the engine forced on it, the engine's own; the comparison row."""
    models = engine.models
    ref = reference(models, messages, args.tokens, args.frames)
    ours = await serve(engine, tap, f"forced-{i}", messages, args.tokens, args.frames, ref)
    free = await serve(engine, tap, f"free-{i}", messages, args.tokens, args.frames)
    return ref, {"prompt": i, "kind": _kind(messages),
                 **forced_result(ours, ref, bounds(models, messages, pristine),
                                 code2wav_references(pristine, models.code2wav, ours)),
                 "free_running": free_result(free, ref, ours)}


async def broken_run(engine, tap: Tap, pristine, name: str, broken, refs: list[tuple[int, Reply]], args) -> dict:
    """The forced requests again with the served path `broken`: caught when every one fails the check."""
    rows = []
    try:
        with broken:
            for i, ref in refs:
                messages = prompts()[i]
                rid = f"broken-{name.replace(' ', '-')}-{i}"
                ours = await serve(engine, tap, rid, messages, args.tokens, args.frames, ref)
                rows.append(forced_result(ours, ref, bounds(engine.models, messages, pristine),
                                          code2wav_references(pristine, engine.models.code2wav, ours)))
    except Exception as exc:  # noqa: BLE001 - reported: a control that did not run caught nothing
        return {"caught": False, "error": f"{type(exc).__name__}: {exc}", "worst_ratio": []}
    return {"caught": bool(rows) and not any(r["pass"] for r in rows),
            "worst_ratio": [max(r[k].get("worst_ratio", 0) for k in ("thinker", "talker")) for r in rows]}


def summary(results: list[dict], controls: dict[str, dict], args) -> dict:
    """The figures over all prompts; the first break scale is the negative control (it must fail the check), the
    others show how small a break still does."""
    def stage(name: str) -> dict:
        rows = [r[name] for r in results if r.get(name, {}).get("steps")]
        if not rows:
            return {}
        return {"steps": sum(r["steps"] for r in rows), "max_abs": max(r["max_abs"] for r in rows),
                "mean_abs": sum(r["mean_abs"] * r["steps"] for r in rows) / sum(r["steps"] for r in rows),
                "top1_agree": sum(r["top1_agree"] * r["steps"] for r in rows) / sum(r["steps"] for r in rows),
                "worst_ratio": max(r["worst_ratio"] for r in rows),
                "median_ratio": median(r["median_ratio"] for r in rows),
                "steps_over": sum(r["steps_over"] for r in rows), "failed_prompts": sum(not r["pass"] for r in rows)}

    def wav(name: str) -> dict:
        rows = [r[name] for r in results if name in r]
        return {"min_snr_db": min((w.get("snr_db", -1e9) for w in rows), default=None),
                "max_abs": max((w.get("max_abs", 0) for w in rows), default=None),
                "failed_prompts": sum(not w["pass"] for w in rows)}

    first = next(iter(controls), None)
    free = [r["free_running"] for r in results if "free_running" in r]
    enough = len(results) >= args.prompts and all(
        r.get("thinker", {}).get("steps", 0) >= args.tokens and r.get("talker", {}).get("steps", 0) >= args.frames
        for r in results)
    return {"prompts": len(results), "tokens": args.tokens, "frames": args.frames, "enough_steps": enough,
            "errors": [f"prompt {r['prompt']}: {r['error']}" for r in results if "error" in r],
            **{k: stage(k) for k in ("thinker", "talker", "code_predictor")},
            "code2wav": wav("code2wav"), "code2wav_vs_whole": wav("code2wav_vs_whole"),
            "forced_pass": sum(r["pass"] for r in results),
            "free_running_text_equal": sum(f["text_parts_at"] is None for f in free),
            "free_running_frames_equal": sum(f["frames_equal"] for f in free),
            "negative_control": {"break": first, **controls[first]} if controls else None,
            "sensitivity": dict(list(controls.items())[1:]),
            "pass": enough and all(r["pass"] for r in results) and bool(controls) and controls[first]["caught"]}


async def main_async(args) -> dict:
    from omnirt.app.cli import build_parser, engine_options
    from omnirt.pipeline.serving.core import build_engine

    say("building the engine")
    with pristine_code2wav() as pristine:
        engine = build_engine(engine_options(build_parser().parse_args(["serve", *args.serve_args])))
    say("engine ready")
    try:
        return await check(engine, pristine[0], args)
    finally:
        engine.stop()


def main() -> None:
    cli(__doc__, {"--tokens": (int, 64, "text tokens per reply"),
                  "--frames": (int, 64, "codec frames per reply (all 16 codebooks)"),
                  "--prompts": (int, 16, "prompts compared (at most 16)"),
                  "--control-prompts": (int, 2, "prompts of the negative control"),
                  "--break-scales": (str, "2.0 1.1 1.02", "attention scales of the broken path: the first is the "
                                     "negative control, the others how small a break is caught"),
                  "--budget-s": (float, 1e9, "no new prompt after this many seconds from the start")}, main_async)


if __name__ == "__main__":
    main()
