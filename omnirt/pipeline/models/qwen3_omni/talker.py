"""Qwen3-Omni Talker as a batched stage model: Thinker rows in, codec frames (16 codes) out.

Mirrors transformers' `Qwen3OmniMoeForConditionalGeneration.generate()` exactly, step by step:
the prompt is the user turns (text rows through `text_projection`, multimodal rows through
`hidden_projection`) plus a 9-position assistant prefix; each decode step first completes the
previous frame with the code predictor (15 small AR steps, batched over requests), then feeds
the sum of the frame's 16 code embeddings plus one trailing text row. As in the reference, the
text track is gen1..gen[N-2], then tts_eos, then tts_pad: the Thinker's last token is never fed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from omnirt.pipeline.models.decoder import PrefillPass, experts_implementation, run_decoder
from omnirt.pipeline.models.qwen3_omni.prompt import PromptKey
from omnirt.pipeline.models.qwen3_omni.rope import rope_positions
from omnirt.pipeline.models.qwen3_omni.thinker import ThinkerRows
from omnirt.pipeline.platform import Platform
from omnirt.pipeline.stage.compile import compile_layers
from omnirt.pipeline.stage.cudagraph import CudaGraphCache, batch_buckets
from omnirt.pipeline.stage.kv_cache import SlotKVCache
from omnirt.pipeline.stage.pinned import PinnedBuffers
from omnirt.pipeline.stage.sampling import sample_top_k_top_p
from omnirt.pipeline.stage.step import Batch, RowOutput

NUM_ASSISTANT_PREFIX = 9  # im_start, assistant, \n, 4 x tts_pad, tts_bos, first text token


@dataclass(slots=True)
class TalkerState:
    speaker_id: int
    prompt_ids: list[int]
    audio_lengths: torch.Tensor | None
    image_grid_thw: torch.Tensor | None  # the Thinker prompt's images (all in user turns)
    embed_chunks: list[torch.Tensor] = field(default_factory=list)  # thinker prompt rows, as they arrive
    hidden_chunks: list[torch.Tensor] = field(default_factory=list)
    text_rows: list[torch.Tensor] = field(default_factory=list)  # thinker embeddings of gen0, gen1, ...
    thinker_done: bool = False
    num_prompt_rows: int = 0
    prompt: torch.Tensor | None = None  # [T, H] talker prompt, built once the prefix is known
    position_ids: torch.Tensor | None = None  # [3, T]
    rope_delta: int = 0
    key: PromptKey | None = None  # the Thinker prompt's (None: no prefix reuse)
    user_positions: np.ndarray | None = None  # the Thinker position of each user row of the prompt, once built

    def add(self, rows: ThinkerRows) -> None:
        if rows.prompt_embeds is not None:
            self.embed_chunks.append(rows.prompt_embeds)
            self.hidden_chunks.append(rows.prompt_hidden)
            self.num_prompt_rows += rows.prompt_embeds.shape[0]
        if rows.token_embed is not None:
            self.text_rows.append(rows.token_embed)


@dataclass(slots=True)
class PromptLayout:
    """Where each row of a step's new Talker prompts comes from, worked out on the host (`TalkerModel.prepare`).

    A prompt is its user rows (a text row through `text_projection`, a multimodal one through
    `hidden_projection`), then the 9-position assistant prefix: the text track (the assistant header's 3 rows
    and the first reply token projected, tts_pad x 4, tts_bos) plus the codec track (zeros x 3, then nothink,
    think_bos, think_eos, the speaker, pad, bos), as transformers' `generate()` builds it."""

    text_rows: list[int]  # into the Thinker embeddings of all the prompts (each its P rows, then its first reply token)
    mm_rows: list[int]  # into the Thinker hidden rows of all the prompts (P each)
    row_pick: list[int]  # per prompt row, into [projected text rows; projected multimodal rows; tts_pad; tts_bos]
    codec_pick: list[int]  # per prompt row, into [a zero row; the codec embeddings of codec_ids]
    codec_ids: list[int]  # six per prompt
    lengths: list[int]

    @classmethod
    def of(cls, config, states: list[TalkerState]) -> PromptLayout:
        tc = config.talker_config
        mm_ids = [config.thinker_config.audio_token_id, config.thinker_config.image_token_id,
                  config.thinker_config.video_token_id]
        # the config's ids read once: a transformers config's attribute access costs microseconds
        im_start, assistant = config.im_start_token_id, config.assistant_token_id
        ids = [np.asarray(st.prompt_ids) for st in states]
        is_mm = [np.isin(i[st.user_positions], mm_ids) for i, st in zip(ids, states)]
        num_text = sum(len(m) - int(m.sum()) + 4 for m in is_mm)  # the user text rows, and 4 of the prefix
        num_rows = num_text + sum(int(m.sum()) for m in is_mm)
        pad, bos = num_rows, num_rows + 1
        out = cls([], [], [], [], [], [])
        offset = 0  # of this prompt's rows in the Thinker rows of all of them
        for i, (st, mm) in enumerate(zip(states, is_mm)):
            n = len(st.prompt_ids)
            user = st.user_positions
            picks = np.empty(len(user), dtype=np.int64)
            picks[~mm] = np.arange(len(out.text_rows), len(out.text_rows) + len(user) - int(mm.sum()))
            picks[mm] = num_text + np.arange(len(out.mm_rows), len(out.mm_rows) + int(mm.sum()))
            out.text_rows.extend((offset + i + user[~mm]).tolist())
            out.mm_rows.extend((offset + user[mm]).tolist())
            head = len(out.text_rows)
            out.text_rows.extend(offset + i + _assistant_start(ids[i], im_start, assistant) + k for k in range(3))
            out.text_rows.append(offset + i + n)  # the first reply token, after the prompt's rows
            out.row_pick.extend(picks.tolist() + [head, head + 1, head + 2, pad, pad, pad, pad, bos, head + 3])
            codec = 1 + 6 * i
            out.codec_pick.extend([0] * (len(user) + 3) + list(range(codec, codec + 6)))
            out.codec_ids.extend([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id, st.speaker_id,
                                  tc.codec_pad_id, tc.codec_bos_id])
            out.lengths.append(len(user) + NUM_ASSISTANT_PREFIX)
            offset += n
        return out


def _assistant_start(ids: np.ndarray, im_start: int, assistant: int) -> int:
    """The position of the last `<|im_start|>assistant` in a prompt (the turn being answered)."""
    return int(np.flatnonzero((ids[:-1] == im_start) & (ids[1:] == assistant))[-1])


class TalkerModel:
    reads_device_tokens = True  # decode steps take the last sampled codes from `last_codes`

    def __init__(self, talker, config, kv: SlotKVCache, predictor_kv: SlotKVCache, special_rows: torch.Tensor,
                 platform: Platform, max_num_seqs: int, enforce_eager: bool = True, graph_moe: str | None = None,
                 compile_step: bool = False, compiled_prefill: bool = True, prefill_graph_tokens: int = 0):
        self.talker = talker
        self.stack = talker.model
        self.predictor = talker.code_predictor
        self.config = config
        self.tc = config.talker_config
        self.kv, self.predictor_kv = kv, predictor_kv
        self.device = kv.k.device
        self.pinned = PinnedBuffers(self.device)
        self.vocab_size = self.tc.text_config.vocab_size
        self.eos_ids = [self.tc.codec_eos_token_id]
        self.suppress_ids = [i for i in range(self.vocab_size - 1024, self.vocab_size) if i != self.eos_ids[0]]
        self.num_groups = self.tc.num_code_groups
        self.graph_moe = graph_moe  # experts implementation inside captured graphs
        hidden = self.tc.text_config.hidden_size
        # last-layer hidden state of each slot's last position: the code predictor's first input
        self.past_hidden = torch.zeros(kv.num_slots + 1, hidden, dtype=talker.dtype, device=self.device)
        # each slot's last sampled code (the next frame's first): decode steps read it here, not from the host,
        # so a step can be issued before the last one's tokens land (async scheduling)
        self.last_codes = torch.zeros(kv.num_slots + 1, dtype=torch.long, device=self.device)
        # the code predictor's forced codes when no row is teacher-forced (-1: sample)
        self.unforced = torch.full((max_num_seqs, self.num_groups - 1), -1, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            bos, eos, pad = talker.text_projection(special_rows.unsqueeze(0)).chunk(3, dim=1)
        self.tts_bos, self.tts_eos, self.tts_pad = bos[0, 0], eos[0, 0], pad[0, 0]
        eager = enforce_eager
        # the decode steps' layers as they run: compiled (omnirt/pipeline/stage/compile.py) or None, as written
        self.decode_layers = compile_layers(self.stack.layers) if compile_step else None
        self.predictor_layers = compile_layers(self.predictor.model.layers) if compile_step else None
        self.prefill = PrefillPass("talker", self.stack, kv, self.decode_layers if compiled_prefill else None,
                                   platform, not eager, max_num_seqs, prefill_graph_tokens)
        self.decode_graphs = CudaGraphCache("talker decode", self._decode_step, platform, not eager,
                                            batch_buckets(max_num_seqs), kv.graph_lengths(), compile_step)
        self.predictor_graphs = CudaGraphCache("code predictor", self._predict_step, platform, not eager,
                                               batch_buckets(max_num_seqs), None, compile_step)

    def capture_cuda_graphs(self) -> None:
        h = self.past_hidden.shape[1]

        def decode_inputs(key):
            zeros = torch.zeros(key[0], dtype=torch.long, device=self.device)
            return {"embeds": torch.zeros(key[0], 1, h, dtype=self.talker.dtype, device=self.device),
                    "slots": zeros + self.kv.scratch_slot, "positions": zeros.clone(), "rope_pos": zeros.clone()}

        def predictor_inputs(key):
            return {"past": torch.zeros(key[0], h, dtype=self.talker.dtype, device=self.device),
                    "code0": torch.zeros(key[0], dtype=torch.long, device=self.device),
                    "greedy": torch.ones(key[0], dtype=torch.bool, device=self.device),
                    "forced": self.unforced[:key[0]].clone()}

        self.predictor_graphs.capture(predictor_inputs)
        with experts_implementation(self.stack, self.graph_moe):
            self.decode_graphs.capture(decode_inputs)
        self.prefill.warm_up()
        self.prefill.capture(self.graph_moe)

    # ---- readiness: which Thinker rows a step needs -------------------------------------------------

    def can_prefill(self, st: TalkerState) -> bool:
        """The prompt needs the Thinker's prompt rows and its first token (a reply that turns out to
        be that one token has no speech: `has_speech` then ends the request)."""
        return st.num_prompt_rows == len(st.prompt_ids) and len(st.text_rows) >= 1

    def can_decode(self, st: TalkerState, step: int) -> bool:
        """Decode step `step` consumes trailing text row `step`, i.e. gen[step+1], known to be non-final
        only once gen[step+2] exists."""
        return st.thinker_done or len(st.text_rows) >= step + 3

    def has_speech(self, st: TalkerState) -> bool:
        """A reply of one token (or none) has no first text row; the reference cannot speak it either."""
        return len(st.text_rows) >= 2

    # ---- prompt -----------------------------------------------------------------------------------------

    def plan_prompt(self, st: TalkerState) -> int:
        """The prompt's length, and the Thinker position behind each of its user rows: host work only, done
        when the request is admitted (prefix reuse matches on these positions). The rows themselves are built
        at its first prefill step, with every other new request's (`prepare`)."""
        ids = np.asarray(st.prompt_ids)
        im_start = np.where(ids == self.config.im_start_token_id, np.arange(len(ids)), -1)
        prev = np.maximum.accumulate(im_start).clip(min=0)
        st.user_positions = np.flatnonzero(ids[np.minimum(prev + 1, len(ids) - 1)] == self.config.user_token_id)
        return len(st.user_positions) + NUM_ASSISTANT_PREFIX

    def prepare(self, reqs) -> None:
        """Build the prompt rows of the step's requests that have none yet, all in one set of device ops: one
        projection of every text row they take, one of every multimodal row, one codec embedding lookup, then
        one gather laying the rows out prompt by prompt. (Built request by request, the 62 prompts of a c=64
        round held the Talker's thread for 240 ms before its first prefill step.)"""
        new = [r.state for r in reqs if r.state.prompt is None]
        if new:
            self._build_prompts(new, PromptLayout.of(self.config, new))

    def _build_prompts(self, states: list[TalkerState], at: PromptLayout) -> None:
        text_in, mm_in, row_at, codec_at, codec_ids = self.pinned.tensors(at.text_rows, at.mm_rows, at.row_pick,
                                                                           at.codec_pick, at.codec_ids)
        embeds = torch.cat([c for st in states for c in (*st.embed_chunks, st.text_rows[0][None])])
        parts = [self.talker.text_projection(embeds[text_in])]
        if at.mm_rows:
            hidden = torch.cat([c for st in states for c in st.hidden_chunks])
            parts.append(self.talker.hidden_projection(hidden[mm_in]))
        rows = torch.cat([*parts, self.tts_pad[None], self.tts_bos[None]])
        codec = self.stack.codec_embedding(codec_ids)
        codec = torch.cat([codec.new_zeros(1, codec.shape[1]), codec])
        prompts = (rows[row_at] + codec[codec_at]).split(at.lengths)
        pad = [self.config.tts_pad_token_id] * NUM_ASSISTANT_PREFIX  # the config read once, not per request
        for st, prompt in zip(states, prompts):
            st.prompt = prompt
            talker_ids = np.asarray(st.prompt_ids)[st.user_positions].tolist() + pad
            st.position_ids, st.rope_delta = rope_positions(self.talker, talker_ids, st.audio_lengths,
                                                            st.image_grid_thw, self.device)

    # ---- steps --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[RowOutput]:
        starts = [r.num_computed_tokens for r in batch.requests]
        if batch.is_prefill:
            return self._prefill(batch.requests, starts, batch.num_new_tokens)
        return self._decode(batch.requests, starts)

    def _prefill(self, reqs, starts: list[int], n_new: list[int]) -> list[RowOutput]:
        self.prepare(reqs)
        last, _ = self.prefill.run(reqs, starts, n_new, "prompt")
        logits = self.talker.codec_head(last)
        outs = []
        for i, (r, s, n) in enumerate(zip(reqs, starts, n_new)):
            done = s + n >= r.num_prompt_tokens
            if done:
                self.past_hidden[r.slot] = last[i]
            outs.append(RowOutput(logits=logits[i] if done else None))
        return outs

    def _decode(self, reqs, starts: list[int]) -> list[RowOutput]:
        """Complete each request's pending frame (code predictor), then one talker step on it."""
        n = len(reqs)
        slots, positions, rope = self.pinned.tensors(
            [r.slot for r in reqs], starts, [s + r.state.rope_delta for r, s in zip(reqs, starts)])
        greedy = self.pinned.tensor([r.sampling.is_greedy for r in reqs], torch.bool)
        codes, code_sum, inner = self.predictor_graphs.run(
            n, None, {"past": self.past_hidden[slots], "code0": self.last_codes[slots], "greedy": greedy,
                      "forced": self._forced_codes(reqs)}, {"greedy": 1, "forced": -1})
        embeds = (code_sum + self._trailing_rows(reqs)).unsqueeze(1)
        hidden, logits = self.decode_graphs.run(
            n, max(starts) + 1, {"embeds": embeds, "slots": slots, "positions": positions, "rope_pos": rope},
            {"slots": self.kv.scratch_slot})
        self.past_hidden[slots] = hidden
        # the frames stay on the device: they come to the host with the sampled tokens, in one wait
        return [RowOutput(logits=row, payload=frame, inner_logits=i) for row, frame, i in zip(logits, codes, inner)]

    def _forced_codes(self, reqs) -> torch.Tensor:
        """[B, 15]: the codes 1-15 a teacher-forced row gives the frame this step completes (its frame
        `num_outputs - 1`), -1 where the predictor samples them."""
        frames = [r.sampling.forced[k] if 0 <= (k := r.num_outputs - 1) < len(r.sampling.forced) else None
                  for r in reqs]
        if not any(f is not None and not isinstance(f, int) for f in frames):
            return self.unforced[:len(reqs)]
        rest = [list(f[1:]) if f is not None and not isinstance(f, int) else [-1] * (self.num_groups - 1)
                for f in frames]
        return self.pinned.tensor([c for row in rest for c in row]).view(len(reqs), -1)

    def complete(self, reqs, outs: list[RowOutput], sampled: list[int],
                 tokens: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Keep each sampled code as its slot's next input, on the device; the payloads stay the frames."""
        if sampled:
            self.last_codes[self.pinned.tensor([reqs[i].slot for i in sampled])] = tokens
        return [o.payload for o in outs]

    def _decode_step(self, kv_len, embeds, slots, positions, rope_pos) -> tuple[torch.Tensor, torch.Tensor]:
        """One talker token per row (kv_len: the dense copy's length): returns (last hidden, codec logits)."""
        view = self.kv.dense_view(slots, positions, 1, kv_len)
        normed, _ = run_decoder(self.stack, embeds, rope_pos.view(1, -1, 1).expand(3, -1, 1), view,
                                layers=self.decode_layers)
        return normed[:, 0], self.talker.codec_head(normed[:, 0])

    def _trailing_rows(self, reqs) -> torch.Tensor:
        """Each request's text row for this step: gen[step+1] projected, then tts_eos, then tts_pad."""
        rows, text = [], []
        for r in reqs:
            st, step = r.state, r.num_outputs - 1
            n = len(st.text_rows)
            if step + 1 < n - 1 or (not st.thinker_done and step + 1 < n):
                text.append(len(rows))
                rows.append(st.text_rows[step + 1])
            else:
                rows.append(self.tts_eos if step + 1 == n - 1 else self.tts_pad)
        if text:
            projected = self.talker.text_projection(torch.stack([rows[i] for i in text]))
            for j, i in enumerate(text):
                rows[i] = projected[j]
        return torch.stack(rows)

    def _predict_step(self, _length, past, code0, greedy, forced) -> tuple[torch.Tensor, ...]:
        """The code predictor's 15 small AR steps for each row's pending frame, all on the device (`forced`
        [B, 15]: a code >= 0 is taken in place of the sampled one). Returns (codes [B, 16], sum of the 16 code
        embeddings [B, H], each step's logits [B, 15, vocab]), as the reference builds them."""
        b = past.shape[0]
        stack, heads = self.predictor.model, self.predictor.lm_head
        slots = torch.arange(b, device=self.device)
        embeds = [self.stack.codec_embedding(code0)]
        x, codes, logits = torch.stack([past, embeds[0]], dim=1), [code0], []
        for g in range(self.num_groups - 1):
            start, n = (0, 2) if g == 0 else (g + 1, 1)
            view = self.predictor_kv.dense_view(slots, torch.full((b,), start, device=self.device), n, start + n)
            normed, _ = run_decoder(stack, x, torch.arange(start, start + n, device=self.device).expand(b, -1), view,
                                    layers=self.predictor_layers)
            logits.append(heads[g](normed[:, -1]))
            sampled = sample_top_k_top_p(logits[-1].float(), greedy, top_k=50, top_p=0.8)
            codes.append(torch.where(forced[:, g] >= 0, forced[:, g], sampled))
            embeds.append(stack.codec_embedding[g](codes[-1]))
            x = embeds[-1].unsqueeze(1)
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(1), torch.stack(logits, dim=1)
