"""Qwen3-Omni Thinker as a batched stage model: multimodal prompt in, text tokens out, plus the
per-token rows the Talker consumes (token embedding and the `accept_hidden_layer` tap)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from omnirt.pipeline.models.decoder import PrefillPass, experts_implementation, run_decoder
from omnirt.pipeline.models.qwen3_omni.encoders import AudioStart, VisualRows, encode_audio, encode_images, num_encoded
from omnirt.pipeline.models.qwen3_omni.prompt import EncodedPrompt, PromptKey
from omnirt.pipeline.models.qwen3_omni.rope import rope_positions
from omnirt.pipeline.platform import Platform
from omnirt.pipeline.stage.compile import compile_layers
from omnirt.pipeline.stage.cudagraph import CudaGraphCache, batch_buckets
from omnirt.pipeline.stage.kv_cache import SlotKVCache
from omnirt.pipeline.stage.pinned import PinnedBuffers
from omnirt.pipeline.stage.step import Batch, RowOutput


@dataclass(slots=True, frozen=True)
class ThinkerHeld:
    """A resident Thinker slot: the key of each position it holds, and the Talker rows of its prompt part."""

    key: PromptKey  # keys of the positions written: the prompt's, then the fed reply tokens
    embeds: torch.Tensor  # [rows, H] token embeddings, audio rows scattered in
    tapped: torch.Tensor  # [rows, H] the Talker's tapped layer

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.embeds)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, self.tapped))

    def head(self, n: int) -> ThinkerHeld:
        """What holding only its first `n` positions is."""
        return ThinkerHeld(self.key.head(n), self.embeds[:n], self.tapped[:n])

    def to(self, device: torch.device) -> ThinkerHeld:
        return ThinkerHeld(self.key, *(t.to(device, non_blocking=True) for t in (self.embeds, self.tapped)))


@dataclass(slots=True)
class ThinkerInput:
    """A request as it enters the Thinker stage: its encoded prompt."""

    prompt: EncodedPrompt  # audio still as mel features, images as pixel patches
    wants_rows: bool  # audio requested: hand rows to the Talker
    key: PromptKey | None = None  # None: no prefix reuse
    cached: ThinkerHeld | None = None  # the resident slot it starts from (num_computed_tokens of it)


@dataclass(slots=True)
class ThinkerState:
    input_ids: list[int]
    embeds: torch.Tensor  # [P, H]: token embeddings with audio and image features scattered in
    tapped: torch.Tensor  # [P, H]: the Talker's tapped layer, filled as the prompt is computed
    position_ids: torch.Tensor  # [3, P]
    rope_delta: int
    audio_lengths: torch.Tensor | None
    wants_rows: bool  # audio requested: hand rows to the Talker
    visual: VisualRows | None = None  # the deepstack rows of the images not in the prefix it started from
    key: PromptKey | None = None
    may_call: bool = False  # the prompt offers tools: only then does the marker start a call
    is_speech_done: bool = False  # a tool call began: nothing after its marker is spoken


@dataclass(slots=True)
class ThinkerRows:
    """What one Thinker step hands the Talker for one request (only the new rows)."""

    prompt_embeds: torch.Tensor | None = None  # [n, H] prompt positions just computed
    prompt_hidden: torch.Tensor | None = None  # [n, H] tapped layer at those positions
    token_embed: torch.Tensor | None = None  # [H] embedding of the token just sampled


class ThinkerModel:
    reads_device_tokens = False  # decode steps take the last sampled token from the host (a grammar may see it)

    def __init__(self, thinker, config, kv: SlotKVCache, platform: Platform, max_num_seqs: int,
                 enforce_eager: bool = True, graph_moe: str | None = None, compile_step: bool = False,
                 tool_call_id: int | None = None, compiled_prefill: bool = True, prefill_graph_tokens: int = 0):
        self.thinker = thinker
        self.tool_call_id = tool_call_id  # the marker that starts a tool call: speech ends there
        self.graph_moe = graph_moe  # experts implementation inside captured graphs
        self.stack = thinker.model.language_model
        self.config = config
        self.kv = kv
        self.tap_layer = config.talker_config.accept_hidden_layer
        tc = config.thinker_config
        self.multimodal_ids = [tc.audio_token_id, tc.image_token_id, tc.video_token_id]
        ac = tc.audio_config  # the audio encoder's attention window, in mel frames and in tokens
        self.audio_window = (ac.n_window_infer, int(_get_feat_extract_output_lengths(ac.n_window_infer, ac.n_window)))
        self.device = kv.k.device
        self.vocab_size = config.thinker_config.text_config.vocab_size
        self.eos_ids = [config.im_end_token_id]
        self.pinned = PinnedBuffers(self.device)
        self.decode_layers = compile_layers(self.stack.layers) if compile_step else None  # None: as written
        self.prefill = PrefillPass("thinker", self.stack, kv, self.decode_layers if compiled_prefill else None,
                                   platform, not enforce_eager, max_num_seqs, prefill_graph_tokens, self.tap_layer)
        self.cuda_graphs = CudaGraphCache("thinker decode", self._decode_step, platform, not enforce_eager,
                                          batch_buckets(max_num_seqs), kv.graph_lengths(), compile_step)

    def capture_cuda_graphs(self) -> None:
        def inputs(key):
            b = key[0]
            zeros = torch.zeros(b, dtype=torch.long, device=self.device)
            return {"token_ids": zeros, "slots": zeros + self.kv.scratch_slot, "positions": zeros.clone(),
                    "rope_pos": zeros.clone()}

        with experts_implementation(self.stack, self.graph_moe):
            self.cuda_graphs.capture(inputs)
        self.prefill.warm_up()
        self.prefill.capture(self.graph_moe)

    @torch.inference_mode()
    def warm_encoders(self, prompt: EncodedPrompt) -> None:
        """One call of the audio and of the vision encoder on `prompt`'s audio and image: their first call on a
        device pays one-time set-up that a user's first turn would otherwise wait for (`OmniModels`)."""
        encode_audio(self.thinker, self.device, [prompt], [AudioStart()])
        encode_images(self.thinker, self.device, [prompt], [0])

    def prepare(self, reqs) -> None:
        """Turn each new request's `ThinkerInput` into its `ThinkerState` at its first prefill step: the token
        ids of all of them go to the device in one copy and through the embedding in one lookup, the audio
        (images) through the audio (vision) encoder in one batch, but for those inside a prefix it took from a
        resident slot (whose rows that slot kept)."""
        new = [r for r in reqs if isinstance(r.state, ThinkerInput)]
        if not new:
            return
        prompts = [r.state.prompt for r in new]
        audio_starts = [AudioStart.after(p, r.num_computed_tokens, *self.audio_window) for p, r in zip(prompts, new)]
        image_firsts = [num_encoded(p.image_spans, r.num_computed_tokens) for p, r in zip(prompts, new)]
        audios = encode_audio(self.thinker, self.device, prompts, audio_starts)
        images = encode_images(self.thinker, self.device, prompts, image_firsts)
        ids = self.pinned.tensor([t for p in prompts for t in p.input_ids])
        embeds = self.stack.embed_tokens(ids).split([len(p.input_ids) for p in prompts])
        for r, e, a, start, v in zip(new, embeds, audios, audio_starts, images):
            r.state = self._state(r.state, e.clone(), a, start, v, r.num_computed_tokens)

    def _state(self, inp: ThinkerInput, embeds: torch.Tensor, audio_rows: torch.Tensor | None, audio: AudioStart,
               visual: VisualRows | None, num_cached: int) -> ThinkerState:
        """The prompt's token `embeds` with the rows of the audios from `audio` on and of the `visual` images
        scattered in, the first `num_cached` rows from the resident slot it starts from (if any), and the
        multimodal rope positions."""
        prompt = inp.prompt
        # the rows of reply tokens it starts from stay zero: the Talker reads no tapped row there (prefix.py)
        tapped = torch.zeros_like(embeds)
        if audio_rows is not None:
            spans = prompt.audio_spans[audio.first:]
            at = self.pinned.tensor([i for j, (a, b) in enumerate(spans)
                                     for i in range(a + (audio.skip_tokens if j == 0 else 0), b)])
            embeds[at] = audio_rows.to(embeds.dtype)
        if visual is not None:
            embeds[visual.positions.to(self.device)] = visual.embeds.to(embeds.dtype)
        if inp.cached is not None:
            n = min(num_cached, len(inp.cached.embeds))
            embeds[:n], tapped[:n] = inp.cached.embeds[:n], inp.cached.tapped[:n]
        lengths = prompt.audio_lengths
        pos, delta = rope_positions(self.thinker.model, prompt.input_ids, lengths, prompt.image_grid_thw, self.device)
        return ThinkerState(prompt.input_ids, embeds, tapped, pos, delta, lengths, inp.wants_rows, visual, inp.key,
                            prompt.lists_tools)

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[RowOutput]:
        starts = [r.num_computed_tokens for r in batch.requests]
        if batch.is_prefill:
            self.prepare(batch.requests)
            return self._prefill(batch.requests, starts, batch.num_new_tokens)
        return self._decode(batch.requests, starts)

    def _prefill(self, reqs, starts: list[int], n_new: list[int]) -> list[RowOutput]:
        """Prompt chunks, padded into one batch (`PrefillPass`: a graph of its bucket where one holds them and
        no image is in the batch)."""
        has_images = any(r.state.visual is not None for r in reqs)
        deepstack_of = (lambda embeds: self._deepstack(reqs, starts, n_new, embeds)) if has_images else None
        last, tapped = self.prefill.run(reqs, starts, n_new, "embeds", deepstack_of)
        logits = self.thinker.lm_head(last)
        for i, (r, s, n) in enumerate(zip(reqs, starts, n_new)):
            r.state.tapped[s:s + n] = tapped[i, :n]
        return [self._output(r, s, s + n, logits[i]) for i, (r, s, n) in enumerate(zip(reqs, starts, n_new))]

    @staticmethod
    def _deepstack(reqs, starts: list[int], n_new: list[int], embeds: torch.Tensor) -> torch.Tensor | None:
        """[layers, B, T, H]: what each of the first decoder layers adds to its output in this prefill chunk,
        the image placeholders' deepstack rows (zero elsewhere); None when no chunk holds an image position."""
        picks = []
        for i, (r, s, n) in enumerate(zip(reqs, starts, n_new)):
            v = r.state.visual
            inside = None if v is None else (v.positions >= s) & (v.positions < s + n)
            if inside is not None and inside.any():
                picks.append((i, v.positions[inside] - s, v.deepstack[:, inside.to(v.deepstack.device)]))
        if not picks:
            return None
        out = embeds.new_zeros(len(picks[0][2]), *embeds.shape)
        for i, at, rows in picks:
            out[:, i, at.to(out.device)] = rows.to(out.dtype)
        return out

    def _decode(self, reqs, starts: list[int]) -> list[RowOutput]:
        names = ("token_ids", "slots", "positions", "rope_pos")
        inputs = dict(zip(names, self.pinned.tensors([r.output_ids[-1] for r in reqs], [r.slot for r in reqs],
                                                      starts, [s + r.state.rope_delta for r, s in zip(reqs, starts)])))
        (logits,) = self.cuda_graphs.run(len(reqs), max(starts) + 1, inputs, {"slots": self.kv.scratch_slot})
        return [RowOutput(logits=row) for row in logits]

    def _decode_step(self, kv_len, token_ids, slots, positions, rope_pos) -> tuple[torch.Tensor]:
        """One token for each row: the fixed-shape step that graphs capture (kv_len: the dense copy's length)."""
        embeds = self.stack.embed_tokens(token_ids).unsqueeze(1)
        view = self.kv.dense_view(slots, positions, 1, kv_len)
        normed, _ = run_decoder(self.stack, embeds, rope_pos.view(1, -1, 1).expand(3, -1, 1), view,
                                layers=self.decode_layers)
        return (self.thinker.lm_head(normed[:, 0]),)

    @staticmethod
    def _output(req, start: int, end: int, logits) -> RowOutput:
        """A prefill step's result: the prompt rows [start, end) for the Talker (from 0 at the first step of a
        request that starts from a resident slot: the rows that slot kept), and the logits once it is done."""
        st, rows = req.state, None
        if st.wants_rows and req.is_prefill:
            begin = 0 if start == req.num_cached_tokens else start
            rows = ThinkerRows(prompt_embeds=st.embeds[begin:end], prompt_hidden=st.tapped[begin:end])
        return RowOutput(logits=logits if end >= req.num_prompt_tokens else None, payload=rows)

    def complete(self, reqs, outs: list[RowOutput], sampled: list[int],
                 tokens: torch.Tensor | None) -> list[ThinkerRows | None]:
        """The step's hand-offs: prompt rows, plus the embedding of each token just sampled (`tokens`, on the
        device, for the rows `sampled`: one lookup, no round trip through the host)."""
        rows = [(out.payload or ThinkerRows()) if self._speaks(req) else None for req, out in zip(reqs, outs)]
        wanted = [j for j, i in enumerate(sampled) if rows[i] is not None]
        if wanted:
            picked = tokens if len(wanted) == len(sampled) else tokens[self.pinned.tensor(wanted)]
            for j, embed in zip(wanted, self.stack.embed_tokens(picked)):
                rows[sampled[j]].token_embed = embed
        return rows

    def _speaks(self, req) -> bool:
        """Whether the Talker still gets this request's rows. Where the prompt offers tools, a tool call's marker is
        the last text row it gets (it ends the speech as the end of text would): a reply that is a call says
        nothing. Without tools the marker is text like any other, and is spoken through."""
        st = req.state
        if st.may_call and st.wants_rows and req.output_ids and req.output_ids[-1] == self.tool_call_id:
            st.is_speech_done = True
        return st.wants_rows and not st.is_speech_done
