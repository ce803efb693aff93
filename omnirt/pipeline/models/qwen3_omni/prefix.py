"""What a Qwen3-Omni stage's resident slot holds, and which new prompt may start from it
(`omnirt/pipeline/stage/prefix_cache.py`).

- **Thinker**: its KV is a function of the prompt's cache key (token ids, audio spans as a digest of each
  audio encoder window's features: `audio_windows.py`), so a slot holds the keys of the positions it wrote:
  the prompt, then the reply tokens that were fed (the last sampled token never is). It also keeps the
  prompt's rows for the Talker (embeddings and the tapped layer), which a request that starts from it hands on
  instead of computing them; the tapped layer is known only at prompt positions, so a match into the reply
  stops before a multimodal placeholder, the only place where the Talker reads it.
- **Talker**: its prompt is the Thinker prompt's user positions (then a 9-position assistant prefix), and
  each of those rows depends on the Thinker prompt up to that position (audio rows on its hidden states).
  So its prefix matches for as long as the user positions lie inside the common start of the two Thinker
  prompts; the assistant prefix never matches (the next turn's user rows come there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omnirt.pipeline.models.qwen3_omni.prompt import PromptKey
from omnirt.pipeline.models.qwen3_omni.thinker import ThinkerHeld, ThinkerInput
from omnirt.pipeline.stage.request import StageRequest


class ThinkerPrefixes:
    """`PrefixReuse` for the Thinker stage (the request's state is a `ThinkerInput`, then a `ThinkerState`)."""

    def __init__(self, multimodal_ids: list[int]):
        self.multimodal_ids = np.asarray(multimodal_ids, dtype=np.int64)

    def key(self, req: StageRequest) -> PromptKey:
        return req.state.key

    def match(self, held: ThinkerHeld, key: PromptKey) -> int:
        return held.key.common(key)

    def held(self, req: StageRequest) -> ThinkerHeld | None:
        st = req.state
        if isinstance(st, ThinkerInput):  # ended before its first step: the slot holds what it started from
            return None if st.cached is None else st.cached.head(req.num_computed_tokens)
        written, n_prompt = req.num_computed_tokens, req.num_prompt_tokens
        reply = np.asarray(req.output_ids[:max(0, written - n_prompt)], dtype=np.int64)
        placeholder = np.flatnonzero(np.isin(reply, self.multimodal_ids))
        reply = reply[:placeholder[0]] if placeholder.size else reply
        rows = min(written, n_prompt)
        return ThinkerHeld(st.key.head(rows, reply), st.embeds[:rows], st.tapped[:rows])

    def adopt(self, req: StageRequest, held: ThinkerHeld, num_tokens: int) -> None:
        req.state.cached = held  # its rows go into the state at the first step (`ThinkerModel.prepare`)


@dataclass(slots=True, frozen=True)
class TalkerKey:
    prompt: PromptKey  # the Thinker prompt's
    user_positions: np.ndarray  # the Thinker position behind each of the Talker prompt's user rows


@dataclass(slots=True, frozen=True)
class TalkerHeld:
    key: TalkerKey
    num_tokens: int  # user rows written (all of them prompt)
    num_bytes: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_tokens

    def to(self, device: torch.device) -> TalkerHeld:
        """No tensors: the Talker's prompt rows come from the Thinker's hand-off."""
        return self


class TalkerPrefixes:
    """`PrefixReuse` for the Talker stage: admitted once its prompt is built (`TalkerState.user_positions`)."""

    def key(self, req: StageRequest) -> TalkerKey:
        return TalkerKey(req.state.key, req.state.user_positions)

    def match(self, held: TalkerHeld, key: TalkerKey) -> int:
        """User rows whose Thinker position p has p and p + 1 inside the common start (whether p is a user
        position at all can depend on the token after it)."""
        common = held.key.prompt.common(key.prompt)
        return min(held.num_tokens, int(np.searchsorted(held.key.user_positions, common - 1)))

    def held(self, req: StageRequest) -> TalkerHeld | None:
        if req.state.user_positions is None:  # its prompt was never built
            return None
        n = min(req.num_computed_tokens, len(req.state.user_positions))
        return TalkerHeld(self.key(req), n)

    def adopt(self, req: StageRequest, held: TalkerHeld, num_tokens: int) -> None:
        """Nothing to carry: the Talker's prompt rows come from the Thinker's hand-off as ever."""
