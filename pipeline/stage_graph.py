"""The stage-local half of the Thinker -> Talker -> Code2Wav graph: each stage's scheduler, runner
and input callbacks, built from the models alone.

Keeping this apart from the engine lets the same stage run in the engine's process, in a worker
process or in a Ray actor: the engine-side half (routing hand-offs, feeding streams) stays in
`engine.py` as each stage's `on_step`, and only that half needs the engine's state.
"""

from __future__ import annotations

from pipeline.config import EngineConfig
from pipeline.models import OmniModels
from pipeline.request import RequestStatus, StageRequest
from pipeline.sampling import Sampler
from pipeline.scheduler import Batch, ChunkScheduler, Scheduler, StepOutput
from pipeline.stage import ARRunner, Stage, StepSink


class Code2WavRunner:
    def __init__(self, model):
        self.model = model

    def run(self, batch: Batch) -> list[StepOutput]:
        wavs = self.model.decode([r.state.next_window()[0] for r in batch.requests])
        return [StepOutput(payload=w) for w in wavs]


def build_stage(name: str, cfg: EngineConfig, models: OmniModels, on_step: StepSink) -> Stage:
    """One stage of the graph, reporting its steps to `on_step`."""
    sc, stream = cfg.stage(name), models.platform.stage_stream()
    if name == "thinker":
        th = models.thinker
        return Stage(name, Scheduler(th.kv, sc.max_num_seqs, sc.max_num_batched_tokens, th.eos_ids,
                                     is_ready=lambda r: True),
                     ARRunner(th, Sampler(th.vocab_size, th.eos_ids)), on_step=on_step, stream=stream)
    if name == "talker":
        tk, async_chunk = models.talker, cfg.connector.async_chunk
        return Stage(name, Scheduler(tk.kv, sc.max_num_seqs, sc.max_num_batched_tokens, tk.eos_ids,
                                     is_ready=lambda r: _talker_may_step(tk, async_chunk, r)),
                     ARRunner(tk, Sampler(tk.vocab_size, tk.eos_ids, tk.suppress_ids)), on_step=on_step,
                     on_input=lambda r, rows: r.state.add(rows),
                     on_input_done=lambda stage, r: _thinker_done(tk, stage, r), stream=stream)
    return Stage(name, ChunkScheduler(sc.max_num_seqs), Code2WavRunner(models.code2wav), on_step=on_step,
                 on_input=lambda r, frame: r.state.frames.append(frame), on_input_done=_talker_done, stream=stream)


def _talker_may_step(talker, async_chunk: bool, req: StageRequest) -> bool:
    """Has the Thinker sent what the Talker's next step of this request consumes? (Without async chunk,
    the Talker starts only once the Thinker is done.)"""
    st = req.state
    if req.num_prompt_tokens == 0:
        if not talker.can_prefill(st) or not (async_chunk or st.thinker_done):
            return False
        req.num_prompt_tokens = talker.build_prompt(st)
        return True
    return req.is_prefill or talker.can_decode(st, len(req.output_ids) - 1)


def _thinker_done(talker, stage: Stage, req: StageRequest) -> None:
    req.state.thinker_done = True
    if not talker.has_speech(req.state):
        stage.finish(req, RequestStatus.FINISHED_STOPPED)


def _talker_done(stage: Stage, req: StageRequest) -> None:
    req.state.input_done = True
    if req.state.is_drained():
        stage.finish(req, RequestStatus.FINISHED_STOPPED)
