"""What each Qwen3-Omni stage costs in device memory, for the memory plan (`omnirt/pipeline/stage/memory_plan.py`).

Weights are counted from the loaded modules. A KV slot is every layer's K and V for `max_model_len`
positions; a Thinker slot that may stay resident also keeps the prompt's rows for the Talker
(embeddings and the tapped layer), a Talker slot its last hidden state. The graphs/workspace figure
is an estimate made before anything is captured (the graphs replay into the caches, so the caches
come first): the activations of the stage's largest step and, where it captures graphs, a fixed pool
for them and the kernels' workspaces. Start-up logs the measured figure beside it.
"""

from __future__ import annotations

import torch

from omnirt.pipeline.config import EngineConfig, StageConfig
from omnirt.pipeline.models.qwen3_omni.code2wav import samples_per_frame
from omnirt.pipeline.models.qwen3_omni.stages import TALKER, THINKER
from omnirt.pipeline.stage.memory_plan import StageMemory

ACTIVATION_ROWS = 32  # hidden-size rows one prefill token keeps live in a decoder layer: above what Qwen3-Omni's
# layers hold at once (q/k/v, the MoE's top-8 expansion, residuals: ~24)
VOCODER_ROWS = 6  # last-block-width rows per output sample live at once in Code2Wav's upsampler (~4 measured
# by shape: the residual units' input, two intermediates and the upsampled output)
GRAPH_POOL_BYTES = 2**30  # a captured stage's graph pool, compile and kernel workspaces


def stage_memory(hf, cfg: EngineConfig, stages: tuple[str, ...], graphs: bool) -> list[StageMemory]:
    """The plan's view of each stage loaded here."""
    hc, elt = hf.config, getattr(torch, cfg.dtype).itemsize
    out = []
    for name in stages:
        module, sc = getattr(hf, name, None), cfg.stage(name)
        if module is None:  # a checkpoint without speech output
            continue
        slot, fixed, work = _costs(hc, name, sc, cfg, elt, getattr(hf, "has_talker", False))
        if graphs and not sc.enforce_eager:
            work += GRAPH_POOL_BYTES
        out.append(StageMemory(name, sc.stage_id, sc.max_num_seqs, sc.max_model_len, device_bytes(module), work,
                               slot, fixed, sc.gpu_memory_utilization, bool(slot) and sc.prefix_caching))
    return out


def _costs(hc, name: str, sc: StageConfig, cfg: EngineConfig, elt: int, speech: bool) -> tuple[int, int, int]:
    """(bytes per KV slot, bytes of batch-sized KV, activation workspace) of stage `name`."""
    if name == THINKER:
        text = hc.thinker_config.text_config
        rows = 2 * text.hidden_size * sc.max_model_len * elt if sc.prefix_caching and speech else 0
        return _slot_bytes(text, sc.max_model_len, elt) + rows, 0, _ar_workspace(text, sc, elt)
    if name == TALKER:
        tkc = hc.talker_config
        predictor = (sc.max_num_seqs + 1) * _slot_bytes(tkc.code_predictor_config, tkc.num_code_groups, elt)
        slot = _slot_bytes(tkc.text_config, sc.max_model_len, elt) + tkc.text_config.hidden_size * elt
        return slot, predictor, _ar_workspace(tkc.text_config, sc, elt)
    c2w, cc = hc.code2wav_config, cfg.connector
    samples = sc.max_num_seqs * (cc.codec_chunk_frames + cc.codec_left_context_frames) * samples_per_frame(c2w)
    return 0, 0, samples * (c2w.decoder_dim >> len(c2w.upsample_rates)) * VOCODER_ROWS * elt


def _slot_bytes(stack_config, max_len: int, elt: int) -> int:
    c = stack_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * max_len * head_dim * elt


def _ar_workspace(stack_config, sc: StageConfig, elt: int) -> int:
    """A full prefill chunk through one layer, the batch's logits (float32, and the sampler's copies), and the
    dense copy of the batch's KV that attention reads without the slot kernel (two layers' worth)."""
    c = stack_config
    prefill = sc.max_num_batched_tokens * c.hidden_size * ACTIVATION_ROWS * elt
    logits = sc.max_num_seqs * c.vocab_size * 4 * 4
    dense = 2 * sc.max_num_seqs * _slot_bytes(c, sc.max_model_len, elt) // c.num_hidden_layers
    return prefill + logits + dense




def device_bytes(module: torch.nn.Module) -> int:
    """Parameters and buffers that hold memory (not those left on the meta device)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)
