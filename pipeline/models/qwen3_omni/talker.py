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

import torch

from pipeline.kv_cache import SlotKVCache
from pipeline.models.decoder import last_rows, pad_rows, run_decoder
from pipeline.models.qwen3_omni.thinker import ThinkerRows
from pipeline.sampling import Sampler, SamplingParams
from pipeline.scheduler import Batch, StepOutput

NUM_ASSISTANT_PREFIX = 9  # im_start, assistant, \n, 4 x tts_pad, tts_bos, first text token


@dataclass(slots=True)
class TalkerState:
    speaker_id: int
    prompt_ids: list[int]
    audio_lengths: torch.Tensor | None
    embed_chunks: list[torch.Tensor] = field(default_factory=list)  # thinker prompt rows, as they arrive
    hidden_chunks: list[torch.Tensor] = field(default_factory=list)
    text_rows: list[torch.Tensor] = field(default_factory=list)  # thinker embeddings of gen0, gen1, ...
    thinker_done: bool = False
    num_prompt_rows: int = 0
    prompt: torch.Tensor | None = None  # [T, H] talker prompt, built once the prefix is known
    position_ids: torch.Tensor | None = None  # [3, T]
    rope_delta: int = 0
    past_hidden: torch.Tensor | None = None  # [H] last-layer hidden of the last position
    generator: torch.Generator | None = None

    def add(self, rows: ThinkerRows) -> None:
        if rows.prompt_embeds is not None:
            self.embed_chunks.append(rows.prompt_embeds)
            self.hidden_chunks.append(rows.prompt_hidden)
            self.num_prompt_rows += rows.prompt_embeds.shape[0]
        if rows.token_embed is not None:
            self.text_rows.append(rows.token_embed)


class TalkerModel:
    def __init__(self, talker, config, kv: SlotKVCache, predictor_kv: SlotKVCache, special_rows: torch.Tensor):
        self.talker = talker
        self.stack = talker.model
        self.predictor = talker.code_predictor
        self.config = config
        self.tc = config.talker_config
        self.kv, self.predictor_kv = kv, predictor_kv
        self.device = kv.k.device
        self.vocab_size = self.tc.text_config.vocab_size
        self.eos_ids = [self.tc.codec_eos_token_id]
        self.suppress_ids = [i for i in range(self.vocab_size - 1024, self.vocab_size) if i != self.eos_ids[0]]
        self.num_groups = self.tc.num_code_groups
        self.predictor_sampler = Sampler(self.tc.code_predictor_config.vocab_size, eos_ids=[])
        with torch.inference_mode():
            bos, eos, pad = talker.text_projection(special_rows.unsqueeze(0)).chunk(3, dim=1)
        self.tts_bos, self.tts_eos, self.tts_pad = bos[0, 0], eos[0, 0], pad[0, 0]

    # ---- readiness: which Thinker rows a step needs -------------------------------------------------

    def can_prefill(self, st: TalkerState) -> bool:
        return st.num_prompt_rows == len(st.prompt_ids) and (len(st.text_rows) >= 2 or st.thinker_done)

    def can_decode(self, st: TalkerState, step: int) -> bool:
        """Decode step `step` consumes trailing text row `step`, i.e. gen[step+1], known to be non-final
        only once gen[step+2] exists."""
        return st.thinker_done or len(st.text_rows) >= step + 3

    def has_speech(self, st: TalkerState) -> bool:
        """A reply of one token (or none) has no first text row; the reference cannot speak it either."""
        return len(st.text_rows) >= 2

    # ---- prompt -----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def build_prompt(self, st: TalkerState) -> int:
        """Assemble the talker prompt from the Thinker's prompt rows; returns its length."""
        cfg, tc = self.config, self.tc
        ids = torch.tensor(st.prompt_ids, device=self.device)
        embeds, hidden = torch.cat(st.embed_chunks), torch.cat(st.hidden_chunks)
        pos = torch.arange(len(ids), device=self.device)
        im_start = torch.where(ids == cfg.im_start_token_id, pos, torch.full_like(pos, -1))
        prev = torch.cummax(im_start, 0).values.clamp_min(0)
        user = ids[(prev + 1).clamp_max(len(ids) - 1)] == cfg.user_token_id
        mm = (ids == cfg.thinker_config.audio_token_id) | (ids == cfg.thinker_config.image_token_id) | (
            ids == cfg.thinker_config.video_token_id)
        rows = torch.empty(len(ids), tc.text_config.hidden_size, device=self.device, dtype=self.talker.dtype)
        if mm.any():
            rows[mm] = self.talker.hidden_projection(hidden[mm])
        rows[~mm] = self.talker.text_projection(embeds[~mm])
        a = max(i for i in range(len(ids) - 1)
                if st.prompt_ids[i] == cfg.im_start_token_id and st.prompt_ids[i + 1] == cfg.assistant_token_id)
        head = self.talker.text_projection(torch.cat([embeds[a:a + 3], st.text_rows[0][None]]))
        text_track = torch.cat([head[:3], self.tts_pad.expand(4, -1), self.tts_bos[None], head[3:4]])
        codec_ids = torch.tensor([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id,
                                  st.speaker_id, tc.codec_pad_id, tc.codec_bos_id], device=self.device)
        codec_track = torch.cat([torch.zeros(3, rows.shape[1], device=self.device, dtype=rows.dtype),
                                 self.stack.codec_embedding(codec_ids)])
        st.prompt = torch.cat([rows[user], text_track + codec_track])
        talker_ids = torch.cat([ids[user], torch.full((NUM_ASSISTANT_PREFIX,), cfg.tts_pad_token_id,
                                                      device=self.device)])
        st.position_ids, st.rope_delta = self._positions(talker_ids, st.audio_lengths)
        return st.prompt.shape[0]

    def _positions(self, ids: torch.Tensor, audio_lengths: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        if audio_lengths is None:
            return torch.arange(len(ids), device=self.device).expand(3, -1), 0
        pos, delta = self.talker.get_rope_index(ids[None], None, None, torch.ones_like(ids[None]), False,
                                                audio_lengths.to(self.device), None)
        return pos[:, 0].long(), int(delta.flatten()[0])

    # ---- steps --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[StepOutput]:
        reqs, n_new = batch.requests, batch.num_new_tokens
        starts = [r.num_computed_tokens for r in reqs]
        frames: list[list[int] | None] = [None] * len(reqs)
        if batch.is_prefill:
            embeds = pad_rows([r.state.prompt[s:s + n] for r, s, n in zip(reqs, starts, n_new)])
            pos = pad_rows([r.state.position_ids[:, s:s + n].T for r, s, n in zip(reqs, starts, n_new)])
            pos = pos.permute(2, 0, 1)
        else:
            codes, code_sum = self._complete_frames(reqs)
            text = torch.stack([self._trailing_row(r.state, len(r.output_ids) - 1) for r in reqs])
            embeds = (code_sum + text).unsqueeze(1)
            frames = codes.tolist()
            pos = torch.tensor([s + r.state.rope_delta for r, s in zip(reqs, starts)], device=self.device)
            pos = pos.view(1, -1, 1).expand(3, -1, 1)
        view = self.kv.view([r.slot for r in reqs], starts, n_new)
        normed, _ = run_decoder(self.stack, embeds, pos, view)
        last = last_rows(normed, n_new)
        logits = self.talker.codec_head(last)
        outs = []
        for i, (r, s, n) in enumerate(zip(reqs, starts, n_new)):
            done_prompt = s + n >= r.num_prompt_tokens
            if done_prompt:
                r.state.past_hidden = last[i]
            outs.append(StepOutput(logits=logits[i] if done_prompt else None, payload=frames[i]))
        return outs

    def _trailing_row(self, st: TalkerState, step: int) -> torch.Tensor:
        n = len(st.text_rows)
        if step + 1 < n - 1 or (not st.thinker_done and step + 1 < n):
            return self.talker.text_projection(st.text_rows[step + 1][None])[0]
        return self.tts_eos if step + 1 == n - 1 else self.tts_pad

    def _complete_frames(self, reqs) -> tuple[torch.Tensor, torch.Tensor]:
        """Code predictor, batched: residual codes 1..15 of each request's pending frame.
        Returns (codes [B, 16], sum of the 16 code embeddings [B, H])."""
        b = len(reqs)
        code0 = torch.tensor([r.output_ids[-1] for r in reqs], device=self.device)
        stack, heads = self.predictor.model, self.predictor.lm_head
        embeds = [self.stack.codec_embedding(code0)]
        x = torch.stack([torch.stack([r.state.past_hidden for r in reqs]), embeds[0]], dim=1)
        params = [self._predictor_params(r.sampling) for r in reqs]
        gens = [r.state.generator for r in reqs]
        codes = [code0]
        for g in range(self.num_groups - 1):
            start, n = (0, 2) if g == 0 else (g + 1, 1)
            view = self.predictor_kv.view(list(range(b)), [start] * b, [n] * b)
            pos = torch.arange(start, start + n, device=self.device).expand(b, -1)
            normed, _ = run_decoder(stack, x, pos, view)
            tokens = self.predictor_sampler(heads[g](normed[:, -1]), params, [[]] * b, gens)
            codes.append(torch.tensor(tokens, device=self.device))
            embeds.append(stack.codec_embedding[g](codes[-1]))
            x = embeds[-1].unsqueeze(1)
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(1)

    @staticmethod
    def _predictor_params(talker: SamplingParams) -> SamplingParams:
        """As the reference: greedy with a greedy talker, else top_k 50 / top_p 0.8."""
        if talker.is_greedy:
            return SamplingParams(temperature=0.0)
        return SamplingParams(temperature=1.0, top_k=50, top_p=0.8)
