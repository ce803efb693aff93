"""Constrained decoding and tool calls below the HTTP layer: Qwen's tool-call parser, the tools as the
released chat template renders them, the grammar mask in the batched sampler (per row, graph-safe), the
compiled grammar's cache and its trip to a worker process, and the engine with constrained and free
requests in one batch."""

from __future__ import annotations

import asyncio
import json
import pickle
import random

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from omnirt.pipeline.api import OmniRequest, collect_reply
from omnirt.pipeline.models.qwen3_omni.prompt import PromptEncoder
from omnirt.pipeline.models.qwen3_omni.tiny import ensure_tiny_model
from omnirt.pipeline.models.qwen3_omni.tool_calls import CallDelta, ToolCallParser, tool_call_spec
from omnirt.pipeline.stage.grammar import BITS, ConstraintError, GrammarMasks, Grammars, apply_token_bitmask
from omnirt.pipeline.stage.sampling import Sampler, SamplingParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "roll_dice", "parameters": {
             "type": "object", "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 20}},
             "required": ["sides"]}}}]
@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_tiny_model())


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, 512, [tokenizer.convert_tokens_to_ids("<|im_end|>")])


def _parse(text: str, seed: int) -> tuple[str, dict[int, list[str]]]:
    """Feed `text` in random pieces; the plain text and each call's [name, arguments]."""
    rnd, parser, out, i = random.Random(seed), ToolCallParser(), [], 0
    while i < len(text):
        j = i + rnd.randint(1, 6)
        out += parser.feed(text[i:j])
        i = j
    out += parser.close()
    calls: dict[int, list[str]] = {}
    for piece in out:
        if isinstance(piece, CallDelta):
            call = calls.setdefault(piece.index, ["", ""])
            call[0] = piece.name or call[0]
            call[1] += piece.arguments
    return "".join(p for p in out if isinstance(p, str)), calls


def test_the_parser_splits_text_and_calls_however_the_text_arrives():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}r{is", "n": {"a": 1}}}\n'
            '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "roll_dice"}\n</tool_call>')
    for seed in range(100):
        assert _parse(text, seed) == ("Let me check.", {0: ["get_weather", '{"city": "Pa}r{is", "n": {"a": 1}}'],
                                                        1: ["roll_dice", "{}"]})


def test_the_parser_streams_arguments_before_the_call_ends():
    parser = ToolCallParser()
    first = parser.feed('<tool_call>\n{"name": "f", "arguments": {"q": "ab')
    assert first == [CallDelta(0, "f", ""), CallDelta(0, None, '{"q": "ab')]
    assert parser.feed('c"}') == [CallDelta(0, None, 'c"')]  # the last brace may be the call's own
    assert parser.feed('}\n</tool_call>') == [CallDelta(0, None, "}")]


def test_what_is_not_a_call_stays_text():
    assert _parse("a < b and <tool_ is no marker", 1) == ("a < b and <tool_ is no marker", {})
    assert _parse("<tool_call>not json</tool_call>", 2) == ("<tool_call>not json</tool_call>", {})
    assert _parse('<tool_call>\n{"name": "f", "arguments": {"x": 1', 3) == ("", {0: ["f", '{"x": 1']})  # cut off


def test_tools_render_as_the_released_template(tokenizer):
    """The engine's message shapes (calls as {name, arguments}, results as `tool` messages) go through the
    checkpoint's own template as OpenAI's shapes would: each call a <tool_call> block after the text, the
    consecutive results <tool_response> blocks of one user turn."""
    from transformers import Qwen3OmniMoeConfig

    from omnirt.pipeline.models.qwen3_omni import released

    path = ensure_tiny_model()
    encoder = PromptEncoder.from_checkpoint(path, tokenizer, Qwen3OmniMoeConfig.from_pretrained(path).thinker_config)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                    {"name": "roll_dice", "arguments": '{"sides": 6}'}]},
                {"role": "tool", "content": "21 C"}, {"role": "tool", "content": "4"},
                {"role": "user", "content": "Thanks"}]
    text = tokenizer.decode(encoder.encode(messages, TOOLS).input_ids)
    openai = [{**m, "tool_calls": [{"type": "function", "function": c} for c in m["tool_calls"]]}
              if "tool_calls" in m else m for m in messages]
    assert text == tokenizer.apply_chat_template(openai, tools=TOOLS, chat_template=released.CHAT_TEMPLATE.read_text(),
                                                 tokenize=False, add_generation_prompt=True)
    assert ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "roll_dice", "arguments": {"sides": 6}}\n</tool_call>') in text
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n4\n</tool_response>" in text


def _bitmask(allowed: list[list[int]] | None, rows: int, vocab: int) -> torch.Tensor:
    mask = torch.full((rows, (vocab + BITS - 1) // BITS), -1, dtype=torch.int32)
    for r, ids in enumerate(allowed or []):
        if ids is not None:
            bits = torch.zeros(mask.shape[1] * BITS, dtype=torch.bool)
            bits[ids] = True
            words = bits.view(-1, BITS).long() << torch.arange(BITS)
            mask[r] = words.sum(-1).to(torch.int64).to(torch.int32)
    return mask


def test_the_mask_limits_its_row_and_leaves_the_others_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    sampler = Sampler(100, eos_ids=[99])
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=7)
    params = [greedy, sampled, greedy]
    free = sampler(logits.clone(), params, [[], [], []], [None, torch.Generator().manual_seed(7), None])
    mask = _bitmask([None, [3, 40, 77], None], 3, 100)
    masked = sampler(logits.clone(), params, [[], [], []], [None, torch.Generator().manual_seed(7), None],
                     bitmask=mask)
    assert masked[0] == free[0] and masked[2] == free[2]  # unconstrained rows: the same tokens
    assert int(masked[1]) in (3, 40, 77)
    allowed = apply_token_bitmask(logits, _bitmask([[5, 31, 32, 63, 64, 99]], 1, 100))[0]
    assert torch.isfinite(allowed).nonzero().flatten().tolist() == [5, 31, 32, 63, 64, 99]


def test_a_constrained_row_may_end_before_min_tokens():
    logits = torch.zeros(1, 10)
    mask = _bitmask([[9]], 1, 10)  # the grammar is complete: only the end
    token = Sampler(10, eos_ids=[9])(logits, [SamplingParams(temperature=0, min_tokens=5)], [[]], [None],
                                                    bitmask=mask)
    assert int(token) == 9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_mask_replays_in_a_captured_graph():
    logits, mask = torch.randn(4, 1000, device="cuda"), torch.full((4, 32), -1, dtype=torch.int32, device="cuda")
    out = apply_token_bitmask(logits, mask)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = apply_token_bitmask(logits, mask)
    mask.copy_(_bitmask([[1, 2], None, [999], None], 4, 1000).cuda())
    graph.replay()
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1, 2] and torch.isfinite(out[1]).all()
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [999]


def _generate(grammars: Grammars, spec: dict, seed: int, tokenizer, max_tokens: int = 200) -> str:
    """Random logits through the grammar mask, as a model with random weights would write."""
    constraint, masks, out = grammars.compile(spec), GrammarMasks(grammars), []
    gen = torch.Generator().manual_seed(seed)
    sampler = Sampler(512, [grammars.stop_ids[0]])
    for _ in range(max_tokens):
        token = int(sampler(torch.randn(1, 512, generator=gen), [SamplingParams(temperature=0)], [out], [None],
                            bitmask=masks.fill([constraint])))
        masks.accept([constraint], [token])
        if token in grammars.stop_ids:
            break
        out.append(token)
    return tokenizer.decode(out)


def test_forced_calls_follow_each_functions_schema(grammars, tokenizer):
    for seed in range(6):
        text, calls = _parse(_generate(grammars, tool_call_spec(TOOLS, "required", True), seed, tokenizer), 0)
        assert text == "" and calls
        for name, arguments in calls.values():
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
            jsonschema.validate(json.loads(arguments), schema)
    named = {"type": "function", "function": {"name": "roll_dice"}}
    for seed in range(4):
        text, calls = _parse(_generate(grammars, tool_call_spec(TOOLS, named, True), seed, tokenizer), 0)
        assert len(calls) == 1 and calls[0][0] == "roll_dice"
        jsonschema.validate(json.loads(calls[0][1]), TOOLS[1]["function"]["parameters"])


def test_grammars_are_cached_by_spec_and_cross_to_a_worker_process(grammars, tokenizer):
    spec = {"type": "json_schema", "schema": WEATHER}
    before = grammars.num_compiled
    first, second = grammars.compile(spec), grammars.compile(json.loads(json.dumps(spec)))
    assert grammars.num_compiled - before <= 1 and first.key == second.key
    travelled = pickle.loads(pickle.dumps(first))
    masks = GrammarMasks(grammars)
    assert torch.equal(masks.fill([first]).clone(), masks.fill([travelled]))
    jsonschema.validate(json.loads(_generate(grammars, spec, 3, tokenizer)), WEATHER)
    with pytest.raises(ConstraintError, match="cannot be used for constrained decoding"):
        grammars.compile({"type": "json_schema", "schema": {"type": "string", "pattern": "("}})


def test_a_constrained_request_leaves_its_batch_neighbours_unchanged(engine):
    """Greedy replies of free requests are the same alone and batched with constrained ones."""
    free = [OmniRequest(f"free-{i}", [{"role": "user", "content": f"Tell me about {w}."}],
                        thinker_sampling={"temperature": 0, "max_tokens": 12})
            for i, w in enumerate(["rivers", "dragons"])]

    async def run(reqs):
        return await asyncio.gather(*[collect_reply(await engine.submit(r)) for r in reqs])

    alone = asyncio.run(run(free))
    constrained = [OmniRequest("json", [{"role": "user", "content": "Weather?"}], response_format={
        "type": "json_schema", "schema": WEATHER}, thinker_sampling={"temperature": 0, "max_tokens": 60}),
        OmniRequest("call", [{"role": "user", "content": "Roll"}], tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False, thinker_sampling={"max_tokens": 160})]
    together = asyncio.run(run([OmniRequest(f"{r.request_id}-again", r.messages, thinker_sampling=r.thinker_sampling)
                                for r in free] + constrained))
    assert [r.token_ids for r in together[:2]] == [r.token_ids for r in alone]
    jsonschema.validate(json.loads(together[2].text), WEATHER)
    (call,) = together[3].tool_calls
    assert together[3].finished.finish_reason == "tool_calls" and together[3].text == ""
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), schema)
