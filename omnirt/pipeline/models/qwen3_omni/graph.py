"""Qwen3-Omni's stage graph, top to bottom: Thinker -> Talker -> Code2Wav.

- **Thinker**: the encoded prompt (audio features scattered in) -> text tokens, streamed to the client.
  It hands the Talker only new rows per step: its prompt rows while prefilling, then one token
  embedding per sampled token (`ThinkerRows`).
- **Talker**: starts once the Thinker has its prompt rows and first token (with async chunk; else
  once the Thinker is done); its prompt is the user turns plus a 9-position assistant prefix. Decode
  step k needs Thinker token k+2. Each step hands Code2Wav one frame of 16 codes.
- **Code2Wav**: decodes frames in windows (`CodecStream`: a small first chunk, then chunks sized by the
  profile's pacing, fixed or adaptive to the Talker's pace, with left context) to 24 kHz PCM, streamed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from omnirt.pipeline.models.qwen3_omni.code2wav import frame_seconds, pcm16
from omnirt.pipeline.models.qwen3_omni.codec_stream import CodecStream
from omnirt.pipeline.models.qwen3_omni.prefix import TalkerPrefixes, ThinkerPrefixes
from omnirt.pipeline.models.qwen3_omni.prompt import PromptKey
from omnirt.pipeline.models.qwen3_omni.stages import CODE2WAV, TALKER, THINKER
from omnirt.pipeline.models.qwen3_omni.talker import NUM_ASSISTANT_PREFIX, TalkerState
from omnirt.pipeline.models.qwen3_omni.thinker import ThinkerInput
from omnirt.pipeline.stage.chunk_scheduler import ChunkScheduler
from omnirt.pipeline.stage.grammar import GrammarMasks
from omnirt.pipeline.stage.graph import AudioPcm, StageGraph, StageNode, StageParts, TextTokens
from omnirt.pipeline.stage.priority import Priority
from omnirt.pipeline.stage.request import RequestStatus, StageRequest
from omnirt.pipeline.stage.runner import ARRunner
from omnirt.pipeline.stage.sampling import Sampler, SamplingParams
from omnirt.pipeline.stage.scheduler import SlotScheduler
from omnirt.pipeline.stage.step import Batch, RowOutput, StageOutput

# ---- Thinker ---------------------------------------------------------------------------------------------


def build_thinker(cfg, models) -> StageParts:
    th, sc = models.thinker, cfg.stage(THINKER)
    reuse = ThinkerPrefixes(th.multimodal_ids) if sc.prefix_caching else None
    return StageParts(SlotScheduler(th.kv, sc.max_num_seqs, sc.max_num_batched_tokens, th.eos_ids, lambda r: True,
                                    reuse, Priority.from_config(cfg)),
                                    ARRunner(th, Sampler(th.vocab_size, th.eos_ids), GrammarMasks(models.grammars)))


def thinker_to_client(eos_ids: list[int]) -> Callable[[StageOutput], TextTokens | None]:
    eos = set(eos_ids)
    return lambda out: TextTokens([out.token]) if out.token is not None and out.token not in eos else None


# ---- Talker ----------------------------------------------------------------------------------------------


def build_talker(cfg, models) -> StageParts:
    tk, sc, async_chunk = models.talker, cfg.stage(TALKER), cfg.connector.async_chunk
    return StageParts(SlotScheduler(tk.kv, sc.max_num_seqs, sc.max_num_batched_tokens, tk.eos_ids,
                                    lambda r: _talker_may_step(tk, async_chunk, r),
                                    TalkerPrefixes() if sc.prefix_caching else None, Priority.from_config(cfg)),
                                    ARRunner(tk, Sampler(tk.vocab_size, tk.eos_ids, tk.suppress_ids)),
                                    on_input=lambda r, rows: r.state.add(rows),
                                    on_input_done=lambda stage, r: _thinker_done(tk, stage, r))


def _talker_may_step(talker, async_chunk: bool, req: StageRequest) -> bool:
    """Has the Thinker sent what the Talker's next step of this request consumes? (Without async chunk,
    the Talker starts only once the Thinker is done.)"""
    st = req.state
    if req.num_prompt_tokens == 0:
        if not talker.can_prefill(st) or not (async_chunk or st.thinker_done):
            return False
        req.num_prompt_tokens = talker.plan_prompt(st)
        return True
    return req.is_prefill or talker.can_decode(st, req.num_outputs - 1)


def _thinker_done(talker, stage, req: StageRequest) -> None:
    req.state.thinker_done = True
    if not talker.has_speech(req.state):
        stage.finish(req, RequestStatus.FINISHED_STOPPED)


# ---- Code2Wav --------------------------------------------------------------------------------------------


class Code2WavRunner:
    """Decodes each request's next window; it samples nothing, so no step waits on the host for another."""

    can_schedule_ahead = False
    waited_s = 0.0  # the stage's sync at the end of each step counts the device time

    def __init__(self, model):
        self.model = model

    def run(self, batch: Batch) -> list[RowOutput]:
        wavs = self.model.decode([r.state.next_window()[0] for r in batch.requests])
        return [RowOutput(payload=w) for w in wavs]


def build_code2wav(cfg, models) -> StageParts:
    return StageParts(ChunkScheduler(cfg.stage(CODE2WAV).max_num_seqs, Priority.from_config(cfg)),
                      Code2WavRunner(models.code2wav),
                      on_input=lambda r, frame: r.state.add(frame), on_input_done=_talker_done)


def _talker_done(stage, req: StageRequest) -> None:
    req.state.input_done = True
    if req.state.is_drained():
        stage.finish(req, RequestStatus.FINISHED_STOPPED)


def audio_to_client(out: StageOutput) -> AudioPcm | None:
    return AudioPcm(pcm16(out.payload)) if len(out.payload) else None


# ---- a request entering the graph ------------------------------------------------------------------------


def new_requests(models, cfg, req, prompt, voice: str | None, params: dict[str, SamplingParams]
                 ) -> dict[str, StageRequest]:
    """The request as each stage on its path first sees it."""
    rid, key = req.request_id, PromptKey(req.cache_salt, prompt.cache_key)
    out = {THINKER: StageRequest(rid, params[THINKER], ThinkerInput(prompt, voice is not None, key),
                                   num_prompt_tokens=len(prompt.input_ids), generator=_generator(params[THINKER]))}
    if voice is not None:
        talker = TalkerState(models.voices[voice], prompt.input_ids, prompt.audio_lengths, prompt.image_grid_thw,
                             key=key)
        out[TALKER] = StageRequest(rid, params[TALKER], talker, RequestStatus.WAITING_FOR_INPUT,
                                     generator=_generator(params[TALKER]))
        frame_s = frame_seconds(models.hf.config.code2wav_config, models.output_sample_rate)
        codec = CodecStream.from_config(cfg.connector, frame_s, req.initial_codec_chunk_frames, rid)
        codec.wait_for_input = not cfg.connector.async_chunk
        out[CODE2WAV] = StageRequest(rid, params[TALKER], codec)
        _owe_first_chunk(out, codec)
    if req.background or req.prefill_only:
        out[THINKER].num_first_packet_outputs = 0
    return out


def _owe_first_chunk(reqs: dict[str, StageRequest], codec: CodecStream) -> None:
    """The outputs each stage owes the first audio packet: its first chunk of F frames is Talker decode steps
    0..F-1 (F + 1 sampled tokens, the prefill's included), and step k needs Thinker token k + 2. Without
    async chunk the first packet waits for whole replies."""
    if codec.wait_for_input:
        for name in (THINKER, TALKER):
            reqs[name].num_first_packet_outputs = reqs[name].sampling.max_tokens
        return
    reqs[THINKER].num_first_packet_outputs = codec.pacing.initial_frames + 2
    reqs[TALKER].num_first_packet_outputs = codec.pacing.initial_frames + 1


def _generator(params: SamplingParams) -> torch.Generator | None:
    return None if params.seed is None else torch.Generator().manual_seed(params.seed)


def build_graph(config, has_talker: bool) -> StageGraph:
    thinker = StageNode(THINKER, build_thinker, to_client=thinker_to_client([config.im_end_token_id]),
                        sampling_field="thinker_sampling")
    if not has_talker:  # a checkpoint without speech output
        return StageGraph((thinker,), new_requests)
    return StageGraph((
        thinker,
        StageNode(TALKER, build_talker, counts_audio_frames=True, sampling_field="talker_sampling",
                  prefix_tokens=NUM_ASSISTANT_PREFIX),
        StageNode(CODE2WAV, build_code2wav, to_client=audio_to_client, needs_kv=False),
    ), new_requests)
