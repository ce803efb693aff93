"""Full-size parity with transformers on the device: the engine as served (CUDA graphs, compiled layers, slot
attention, fused experts) against transformers' own `generate()` on the same bf16 weights.

Both sides run the same modules of one loaded model, so the weights are the same tensors: first the
engine serves each prompt (greedy, one request at a time), then `generate()` runs it with transformers'
own experts (`grouped_mm`) and SDPA. Compared: the first text tokens and every codebook of the first codec
frames. Random dummy weights give near-ties that bf16 rounding decides differently on the two paths; where
a side's choice differs, the summary gives both top-2 logit margins at that step and the largest
difference of the chosen logit over the steps before (the noise between the paths). The documented rule:
a parting is a tie when a margin there is within that noise (or within one bf16 step of the logit).
`python omnirt/loadtest/gpu/hf_parity.py -- --model qwen3-omni-30b-a3b --load-format dummy --deploy-config
qwen3_omni_moe_1gpu` (a JSON summary on stdout).
"""

from __future__ import annotations

import numpy as np
import torch

from omnirt.loadtest.gpu_check import cli
from omnirt.pipeline.api import OmniRequest, collect_reply
from omnirt.pipeline.models.qwen3_omni.generate import prompt_kwargs

VOICE = "ethan"
PENALTY = 1.05  # the Talker's repetition penalty, both sides


def prompts() -> list[list[dict]]:
    """Two text prompts, two spoken ones (a decaying tone and a chirp, 16 kHz) and a picture (448 x 640 smooth
    noise: 280 image tokens through the 27-layer vision encoder and its 3 deepstack layers)."""
    rng = np.random.default_rng(0)
    picture = np.kron(rng.integers(0, 256, (14, 20, 3), dtype=np.uint8), np.ones((32, 32, 1), dtype=np.uint8))
    t = np.arange(16000 * 3) / 16000
    tone = (0.3 * np.sin(2 * np.pi * 440 * t[:16000]) * np.exp(-t[:16000])).astype(np.float32)
    chirp = (0.2 * np.sin(2 * np.pi * (200 + 300 * t) * t)).astype(np.float32)
    return [
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Hello, how are you today?"}],
        [{"role": "user", "content": "Tell me something about the sea " * 6}],
        [{"role": "user", "content": [{"type": "audio", "audio": tone}, {"type": "text", "text": "What is this?"}]}],
        [{"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": [{"type": "audio", "audio": chirp}]}],
        [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "Describe it."}]}],
    ]


def _kind(messages: list[dict]) -> str:
    """"image", "audio" or "text": the richest part of the prompt."""
    kinds = {p["type"] for m in messages if isinstance(m["content"], list) for p in m["content"]}
    return next((k for k in ("image", "audio") if k in kinds), "text")


class Logits:
    """The last position's logits of every call of `module` (one generation step each), top-2 and argmax."""

    def __init__(self, module: torch.nn.Module):
        self.steps: list[torch.Tensor] = []
        self.handle = module.register_forward_hook(lambda m, a, out: self.steps.append(out[0, -1].float().cpu()))

    def close(self) -> list[torch.Tensor]:
        self.handle.remove()
        return self.steps


def engine_logits(engine) -> dict[str, dict[tuple[str, int], torch.Tensor]]:
    """Per stage, (request id, step) -> that row's logits, for every sampled row of the engine."""
    book: dict[str, dict] = {}
    for stage in engine.stages:
        runner, rows = stage.runner, book.setdefault(stage.name, {})

        def run(batch, original=runner.run, rows=rows):
            outs = original(batch)
            for r, o in zip(batch.requests, outs):
                if getattr(o, "logits", None) is not None:
                    rows[(r.request_id, len(r.output_ids))] = o.logits.float().cpu()
            return outs

        runner.run = run
    return book


async def serve(engine, rid: str, messages: list[dict], tokens: int, frames: int):
    """One greedy request through the engine: its text tokens and the codec frames fed to the vocoder (a
    reply of n + 1 Talker steps feeds n frames, as generate() does)."""
    fed, original = [], engine.models.code2wav.decode

    def capture(windows):
        for w in windows:
            fed.extend(w.codes[w.num_context:])
        return original(windows)

    engine.models.code2wav.decode = capture
    try:
        req = OmniRequest(rid, messages, ("text", "audio"), voice=VOICE,
                          thinker_sampling={"temperature": 0.0, "max_tokens": tokens},
                          talker_sampling={"temperature": 0.0, "max_tokens": frames + 1, "repetition_penalty": PENALTY})
        reply = await collect_reply(await engine.submit(req))
    finally:
        engine.models.code2wav.decode = original
    eos = set(engine.models.thinker.eos_ids)
    return [t for t in reply.token_ids if t not in eos], [list(f) for f in fed]


@torch.inference_mode()
def reference(models, messages: list[dict], tokens: int, frames: int):
    """transformers' generate() of the same prompt: text tokens, codec frames [frames][16], the logits of
    each Thinker step and each Talker (first codebook) step."""
    hf = models.hf
    prompt = models.encoder.encode(messages)
    kw = prompt_kwargs(hf, prompt, models.thinker.device)
    codes, original = {}, hf.code2wav.chunked_decode

    def capture(c, *a, **k):
        codes["c"] = c.clone()
        return original(c, *a, **k)

    hf.code2wav.chunked_decode = capture
    th, tk = Logits(hf.thinker.lm_head), Logits(hf.talker.codec_head)
    heads = [Logits(h) for h in hf.talker.code_predictor.lm_head]  # codebook g + 1's head, once per frame
    try:
        seqs, _ = hf.generate(**kw, speaker=VOICE, return_audio=True, thinker_max_new_tokens=tokens,
                              thinker_do_sample=False, thinker_eos_token_id=models.thinker.eos_ids[0],
                              talker_max_new_tokens=frames + 1, talker_do_sample=False,
                              talker_repetition_penalty=PENALTY)
    finally:
        hf.code2wav.chunked_decode = original
    eos = set(models.thinker.eos_ids)
    text = [t for t in seqs[0, len(prompt.input_ids):].tolist() if t not in eos]
    return text, codes["c"][0].T.tolist(), th.close(), tk.close(), [h.close() for h in heads]


def decided(row: torch.Tensor, history: list[int], penalty: float, suppress: list[int]) -> torch.Tensor:
    """The logits a choice was made on: the repetition penalty over the tokens produced before, and the
    suppressed ids out, as both sides' processors apply them (greedy: no warpers)."""
    row = row.clone()
    if penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)))
        row[seen] = torch.where(row[seen] < 0, row[seen] * penalty, row[seen] / penalty)
    if suppress:
        row[torch.tensor(suppress)] = float("-inf")
    return row


def parting(ours: list, theirs: list, engine_rows: list[torch.Tensor], ref_rows: list[torch.Tensor],
            penalty: float = 1.0, suppress: list[int] = ()) -> dict | None:
    """Where the two sequences first differ: both sides' decision margins there (top-1 minus top-2 of the
    processed logits; whether each side's choice is its own argmax), and the noise before (the largest
    difference between the two sides' top logit over the steps they agreed on)."""
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if k is None:
        n = min(len(ours), len(theirs))
        return None if len(ours) == len(theirs) else {"step": n, "lengths": [len(ours), len(theirs)]}
    out = {"step": k}
    if k < len(engine_rows) and k < len(ref_rows):
        mine, ref = (decided(r[k], ours[:k], penalty, list(suppress)) for r in (engine_rows, ref_rows))

        def margin(row):
            v = torch.topk(row, 2).values
            return round(float(v[0] - v[1]), 4)

        noise = max((abs(float(e.max() - r.max())) for e, r in zip(engine_rows[:k], ref_rows[:k])), default=0.0)
        out.update(margin_engine=margin(mine), margin_reference=margin(ref), noise_before=round(noise, 4),
                   engine_logits_of_both=[round(float(mine[t]), 4) for t in (ours[k], theirs[k])],
                   reference_logits_of_both=[round(float(ref[t]), 4) for t in (ours[k], theirs[k])],
                   choices_are_argmax=[int(mine.argmax()) == ours[k], int(ref.argmax()) == theirs[k]])
    return out


def first_code_parting(ours: list[list[int]], theirs: list[list[int]], heads: list[list[torch.Tensor]]) -> dict | None:
    """The first (frame, codebook) where the frames differ. For codebooks 1-15 (the code predictor's, whose
    logits the engine's captured graph keeps to itself) the reference's own margin between its choice and
    the engine's there, and whether its choice is its argmax: a near-zero margin is a tie on its side."""
    at = next(((f, g) for f, (a, b) in enumerate(zip(ours, theirs)) for g, (x, y) in enumerate(zip(a, b)) if x != y),
              None)
    if at is None:
        return None
    f, g = at
    out = {"frame": f, "codebook": g}
    if g and f < len(heads[g - 1]):
        row = heads[g - 1][f]
        out.update(reference_margin=round(float(row[theirs[f][g]] - row[ours[f][g]]), 4),
                   reference_choice_is_argmax=int(row.argmax()) == theirs[f][g])
    return out


def steps(rows: dict, rid: str) -> list[torch.Tensor]:
    """One request's logits, step by step from its first sampled token."""
    out = []
    while (row := rows.get((rid, len(out)))) is not None:
        out.append(row)
    return out


def frame_key(frames: list[list[int]]) -> list[int]:
    return [f[0] for f in frames]


async def main_async(args) -> dict:
    from omnirt.app.cli import build_parser, engine_options
    from omnirt.pipeline.serving.core import build_engine

    engine = build_engine(engine_options(build_parser().parse_args(["serve", *args.serve_args])))
    book = engine_logits(engine)
    served = [await serve(engine, f"p{i}", m, args.tokens, args.frames) for i, m in enumerate(prompts())]
    engine.stop()
    models = engine.models
    models.hf.set_experts_implementation("grouped_mm")
    results = []
    for i, (messages, (tokens, frames)) in enumerate(zip(prompts(), served)):
        ref_tokens, ref_frames, ref_th, ref_tk, ref_heads = reference(models, messages, args.tokens, args.frames)
        th_rows, tk_rows = steps(book["thinker"], f"p{i}"), steps(book["talker"], f"p{i}")
        same_text = tokens[: args.tokens] == ref_tokens[: args.tokens]
        n = min(args.frames, len(frames), len(ref_frames))
        results.append({
            "prompt": i, "kind": _kind(messages),
            "text_equal": same_text, "text_lengths": [len(tokens), len(ref_tokens)],
            "text_parting": None if same_text else parting(tokens, ref_tokens, th_rows, ref_th),
            "frames_compared": n, "frames_equal": frames[:n] == ref_frames[:n] and n == args.frames,
            "codes_differing": sum(a != b for f, g in zip(frames[:n], ref_frames[:n]) for a, b in zip(f, g)),
            "first_code_parting": first_code_parting(frames[:n], ref_frames[:n], ref_heads),
            # the Talker's frames follow the text; they are comparable only while the text agrees
            "frame_parting": None if frames[:n] == ref_frames[:n] else parting(
                frame_key(frames), frame_key(ref_frames), tk_rows, ref_tk, PENALTY, models.talker.suppress_ids),
        })
    return {"tokens": args.tokens, "frames": args.frames, "results": results,
            "text_identical": sum(r["text_equal"] for r in results),
            "frames_identical": sum(r["frames_equal"] for r in results)}


def main() -> None:
    cli(__doc__, {"--tokens": (int, 16, "text tokens compared"),
                  "--frames": (int, 8, "codec frames compared (all 16 codebooks)")}, main_async)


if __name__ == "__main__":
    main()
