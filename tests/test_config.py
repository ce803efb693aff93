"""Deploy profiles: platform merging, precedence, and errors that name the key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omnirt.pipeline.config import ProfileError
from omnirt.pipeline.platform import PLATFORMS, detect_platform, get_platform
from omnirt.pipeline.profile import shipped_or_file
from tests.profiles import build_config, load_profile

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "omnirt" / "deploy"


@pytest.mark.parametrize("profile", sorted(p.name for p in DEPLOY.glob("*.yaml")))
@pytest.mark.parametrize("platform", PLATFORMS)
def test_every_shipped_profile_loads_on_every_platform(profile, platform):
    cfg = load_profile(DEPLOY / profile, platform)
    assert cfg.platform == platform and [s.name for s in cfg.stages] == ["thinker", "talker", "code2wav"]



@pytest.mark.parametrize("given", ["tiny", "tiny.yaml", "deploy/tiny.yaml"])
def test_a_shipped_profile_is_found_by_name_from_anywhere(given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no deploy/ folder here: the name alone finds the package's copy
    assert shipped_or_file(given) == DEPLOY / "tiny.yaml"


def test_a_file_of_that_name_wins_over_the_shipped_profile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "tiny.yaml").write_text("model: tiny\n")
    assert shipped_or_file("deploy/tiny.yaml") == Path("deploy/tiny.yaml")
    assert shipped_or_file("elsewhere/tiny.yaml") == Path("elsewhere/tiny.yaml")  # a path is never rewritten

def test_platform_entry_merges_over_base():
    raw = yaml.safe_load((DEPLOY / "qwen3_omni_moe.yaml").read_text())
    rocm = build_config(raw, "rocm", {}, {})
    cuda = build_config(raw, "cuda", {}, {})
    cpu = build_config(raw, "cpu", {}, {})
    assert rocm.stage("code2wav").enforce_eager and not cuda.stage("code2wav").enforce_eager
    assert cpu.dtype == "float32" and cuda.dtype == "bfloat16" and cpu.stage("thinker").max_num_seqs == 4
    # a platform entry that sets one key keeps the stage's other keys
    assert rocm.stage("code2wav").max_num_seqs == cuda.stage("code2wav").max_num_seqs == 32


def test_precedence_cli_over_platform_over_profile():
    raw = {"dtype": "float32", "stages": [{"stage_id": 1, "max_num_seqs": 4,
                                            "default_sampling_params": {"temperature": 0.5, "top_k": 3}}],
           "platforms": {"cuda": {"dtype": "bfloat16", "stages": [{"stage_id": 1, "max_num_seqs": 8}]}}}
    cfg = build_config(raw, "cuda", {"dtype": None}, {"1": {"max_num_seqs": 16,
                                                           "default_sampling_params": {"top_k": 5}}})
    assert cfg.dtype == "bfloat16" and cfg.stage("talker").max_num_seqs == 16
    assert cfg.stage("talker").default_sampling_params == {"temperature": 0.5, "top_k": 5}
    assert build_config(raw, "cuda", {"dtype": "float16"}, {}).dtype == "float16"
    assert build_config(raw, "xpu", {}, {}).stage("talker").max_num_seqs == 4


@pytest.mark.parametrize("raw,key", [
    ({"stages": [{"stage_id": 0, "max_num_seq": 4}]}, "stages[0].max_num_seq"),
    ({"stages": [{"stage_id": 1, "devices": "0,a"}]}, "stages[1].devices"),
    ({"stages": [{"stage_id": 2, "num_replicas": 0}]}, "stages[2].num_replicas"),
    ({"stages": [{"stage_id": 1, "max_num_seqs": "lots"}]}, "stages[1].max_num_seqs"),
    ({"stages": [{"stage_id": 1, "enforce_eager": "no"}]}, "stages[1].enforce_eager"),
    ({"stages": [{"stage_id": 0, "default_sampling_params": {"temprature": 1}}]},
     "stages[0].default_sampling_params.temprature"),
    ({"stages": [{"stage_id": 0, "default_sampling_params": {"top_p": "high"}}]},
     "stages[0].default_sampling_params.top_p"),
    ({"stages": [{"stage_id": "thinker"}]}, "stages[0].stage_id"),
    ({"connector": {"codec_chunk_frames": 0}}, "connector.codec_chunk_frames"),
    ({"connector": {"codec_left_context_frames": 0}}, "connector.codec_left_context_frames"),
    ({"connector": [1]}, "connector"),
    ({"connector": {"codec_chunk_pacing": "smart"}}, "connector.codec_chunk_pacing"),
    ({"connector": {"codec_chunk_margin_ms": -1}}, "connector.codec_chunk_margin_ms"),
    ({"connector": {"codec_chunk_margin_ms": "some"}}, "connector.codec_chunk_margin_ms"),
    ({"conv_backend": "fft"}, "conv_backend"),
    ({"stages": [{"stage_id": 2, "compile": "sometimes"}]}, "stages[2].compile"),
    ({"platforms": {"tpu": {}}}, "platforms.tpu"),
    ({"platforms": {"cpu": [1]}}, "platforms.cpu"),
    ({"dtype": "int4"}, "dtype"),
    ({"load_format": "pt"}, "load_format"),
    ({"stages": [{"stage_id": 7}]}, "stages[7].stage_id"),
    ({"stages": {"stage_id": 0}}, "stages"),
    ({"voice_aliases": {"alloy": 1}}, "voice_aliases.alloy"),
    ({"model_aliases": "gpt-realtime*"}, "model_aliases"),
    ({"model_aliases": ["gpt-realtime*", ""]}, "model_aliases[1]"),
    ({"bogus": 1}, "bogus"),
    ({"max_wait_steps": 0}, "max_wait_steps"),
    ({"max_wait_steps": 2.5}, "max_wait_steps"),
    ({"first_packet_priority": "yes"}, "first_packet_priority"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": "most"}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization"),
    ({"stages": [{"stage_id": 1, "gpu_memory_utilization": -0.1}]}, "stages[1].gpu_memory_utilization"),
    ({"stages": [{"stage_id": 2, "max_model_len": 512}]}, "stages[2].max_model_len"),
    ({"stages": [{"stage_id": 2, "max_num_batched_tokens": 512}]}, "stages[2].max_num_batched_tokens"),
    ({"stages": [{"stage_id": 2, "prefix_caching": False}]}, "stages[2].prefix_caching"),
    ({"stages": [{"stage_id": 2, "default_sampling_params": {"temperature": 0.5}}]},
     "stages[2].default_sampling_params"),
])
def test_bad_profile_names_the_key(raw, key):
    with pytest.raises(ProfileError) as err:
        build_config(raw, "cpu", {}, {})
    assert err.value.key == key and str(err.value).startswith(f"deploy profile: {key} ")


@pytest.mark.parametrize("text,key,line,accepted", [
    ("model: tiny\nstages:\n  - stage_id: 1\n    max_num_seqs: lots\n", "stages[1].max_num_seqs", 4, "an integer"),
    ("dtype: int4\n", "dtype", 1, "float32, bfloat16, float16"),
    ("stages:\n  - stage_id: 0\n    default_sampling_params: {temprature: 0.5}\n",
     "stages[0].default_sampling_params.temprature", 3, "temperature, top_k"),
    ("platforms:\n  cuda:\n    stages:\n      - {stage_id: 2, max_num_seqs: 0}\n", "stages[2].max_num_seqs", 4, ">= 1"),
    ("connector:\n  codec_chunk_frames: 25\n  codec_chunk_franes: 4\n", "connector.codec_chunk_franes", 3,
     "codec_chunk_frames"),
])
def test_a_bad_profile_file_names_the_key_file_line_and_accepted_values(tmp_path, text, key, line, accepted):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError) as err:
        load_profile(path, "cuda")
    assert str(err.value).startswith(f"deploy profile {path}, line {line}: {key} ") and accepted in str(err.value)


@pytest.mark.parametrize("raw,over", [
    ({"stages": [{"stage_id": 0, "gpu_memory_utilization": 0.7}, {"stage_id": 1, "gpu_memory_utilization": 0.4}]},
     "over the whole device (1.0)"),
    ({"gpu_memory_utilization": 0.8, "stages": [{"stage_id": 0, "gpu_memory_utilization": 0.6},
                                                {"stage_id": 2, "gpu_memory_utilization": 0.3}]},
     "over gpu_memory_utilization 0.8"),
])
def test_stage_shares_of_one_device_add_up_to_at_most_the_whole(raw, over):
    with pytest.raises(ProfileError) as err:
        build_config(raw, "cuda", {}, {})
    assert err.value.key == f"stages[{raw['stages'][1]['stage_id']}].gpu_memory_utilization" and over in str(err.value)
    # on devices of their own, or under Ray (whose indices only name replicas), they do not add up
    apart = {**raw, "stages": [raw["stages"][0], {**raw["stages"][1], "devices": "1"}]}
    assert build_config(apart, "cuda", {}, {}).stage("thinker").gpu_memory_utilization == raw["stages"][0][
        "gpu_memory_utilization"]
    assert build_config({**raw, "distributed": "ray"}, "cuda", {}, {}).distributed == "ray"


def test_the_global_fraction_comes_from_the_flag_over_the_profile():
    from omnirt.pipeline.api import EngineOptions
    from tests.profiles import engine_config

    opts = EngineOptions(deploy_config=str(DEPLOY / "qwen3_omni_moe_1gpu.yaml"), model="qwen3-omni-30b-a3b")
    assert engine_config(opts, "cuda").gpu_memory_utilization == 0.9
    assert engine_config(dataclasses.replace(opts, gpu_memory_utilization=0.5), "cuda").gpu_memory_utilization == 0.5
    assert engine_config(EngineOptions(), "cpu").gpu_memory_utilization is None  # tiny: fixed sizing


@pytest.mark.parametrize("setting,read,default", [
    ("async_output=false", lambda c: c.async_output, True),
    ("first_packet_priority=false", lambda c: c.first_packet_priority, True),
    ("async_chunk=false", lambda c: c.connector.async_chunk, True),
    ("connector.async_chunk=false", lambda c: c.connector.async_chunk, True),
    ("engine=reference", lambda c: c.engine, "omnirt"),
    ("compile=off", lambda c: c.compile, "auto"),
    ("attention=dense", lambda c: c.attention, "auto"),
    ("moe_backend=eager", lambda c: c.moe_backend, "auto"),
    ("stages.talker.default_sampling_params.max_tokens=8", lambda c: c.stage("talker").default_sampling_params,
     {"temperature": 0.0, "max_tokens": 200, "repetition_penalty": 1.05}),
    ("stages.thinker.kv_offload_gib=1.5", lambda c: c.stage("thinker").kv_offload_gib, 0.0),
])
def test_set_overrides_a_profile_key_and_otherwise_leaves_the_profiles_value(tmp_path, setting, read, default):
    """The ablations live in the profile: `--set KEY=VALUE` overrides any key (nested ones by their path, a
    mapping's siblings kept), and a profile that sets the key is read as written."""
    from omnirt.pipeline.api import EngineOptions
    from tests.profiles import engine_config

    key, value = setting.split("=")
    assert read(engine_config(EngineOptions(), "cpu")) == default
    changed = read(engine_config(EngineOptions(settings=(setting,)), "cpu"))
    expected = {**default, "max_tokens": 8} if isinstance(default, dict) else "off" if value == "off" else \
        yaml.safe_load(value)
    assert changed != default and changed == expected
    if "." not in key:
        profile = tmp_path / "p.yaml"
        profile.write_text((DEPLOY / "tiny.yaml").read_text() + f"{key}: {value}\n")
        assert read(engine_config(EngineOptions(deploy_config=str(profile)), "cpu")) == changed


@pytest.mark.parametrize("setting,message", [
    ("async_chunk", r"--set async_chunk: must be KEY=VALUE"),
    ("connector.codec_chunk_frames=0", r"--set connector.codec_chunk_frames=0: connector.codec_chunk_frames must be"),
    ("stages.talker.max_num_seqs=lots", r"--set stages.talker.max_num_seqs=lots: stages\[1\].max_num_seqs must be an "),
    ("stages.9.max_num_seqs=1", r"'9' is not 0..2 \(thinker, talker, code2wav\) or \*"),
    ("stages.code2wav.max_model_len=64", r"stages\[2\].max_model_len is read by the autoregressive stages only"),
    ("engine=vllm", r"--set engine=vllm: engine must be one of omnirt, reference"),
    ("stages.thinker.kv_offload_gib=-1", r"stages\[0\].kv_offload_gib must be >= 0"),
    ("stages.code2wav.kv_offload_gib=1", r"stages\[2\].kv_offload_gib is read by the autoregressive stages only"),
    ("dtype=[1, 2", r"its value is not valid YAML"),
])
def test_a_bad_setting_is_refused_naming_the_flag(setting, message):
    from omnirt.pipeline.api import EngineOptions, EngineStartError, check_options

    with pytest.raises(EngineStartError, match=message):
        check_options(EngineOptions(settings=(setting,), platform="cpu"))


def test_a_stage_star_reaches_only_the_stages_the_key_applies_to():
    from omnirt.pipeline.api import EngineOptions
    from tests.profiles import engine_config

    cfg = engine_config(EngineOptions(settings=("stages.*.max_num_seqs=3", "stages.*.max_model_len=512")), "cpu")
    assert [s.max_num_seqs for s in cfg.stages] == [3, 3, 3]
    assert [s.max_model_len for s in cfg.stages[:2]] == [512, 512]  # Code2Wav has no context to set


def test_broken_yaml_names_the_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\nstages: [unclosed\n")
    with pytest.raises(ProfileError, match=rf"^deploy profile {bad}, line 3, column 1: is not valid YAML: expected"):
        load_profile(bad, "cpu")
    with pytest.raises(ProfileError, match=rf"^deploy profile {tmp_path / 'none.yaml'}: cannot be read"):
        load_profile(tmp_path / "none.yaml", "cpu")
    bad.write_text("- a list\n")
    with pytest.raises(ProfileError, match="the top level must be a mapping"):
        load_profile(bad, "cpu")


def test_values_from_the_command_line_are_named_by_their_flag():
    with pytest.raises(ProfileError, match=r"^--stage-overrides: stages\[1\]\.max_num_seqs must be an integer"):
        load_profile(DEPLOY / "tiny.yaml", "cpu", stage_overrides={"1": {"max_num_seqs": "8"}})
    with pytest.raises(ProfileError, match=r"^--max-output-buffer-bytes: max_output_buffer_bytes must be >= 4096"):
        load_profile(DEPLOY / "tiny.yaml", "cpu", {"max_output_buffer_bytes": 10})


def test_check_options_reads_every_platform_entry(tmp_path):
    """Without --platform the profile is checked for every platform it could be detected on."""
    from omnirt.pipeline.api import EngineOptions, EngineStartError, check_options

    path = tmp_path / "p.yaml"
    path.write_text("platforms:\n  rocm:\n    stages:\n      - {stage_id: 1, max_waiting: -1}\n")
    check_options(EngineOptions(deploy_config=str(path), platform="cpu"))
    with pytest.raises(EngineStartError, match=rf"deploy profile {path}, line 4: stages\[1\].max_waiting must be >= 0"):
        check_options(EngineOptions(deploy_config=str(path)))


def test_the_profile_check_never_imports_torch(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("stages:\n  - {stage_id: 1, max_num_seqs: lots}\n")
    code = ("import sys; from omnirt.pipeline.api import EngineOptions, EngineStartError, check_options\n"
            f"try: check_options(EngineOptions(deploy_config={str(path)!r}))\n"
            "except EngineStartError as exc: print(exc)\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == [f"deploy profile {path}, line 2: stages[1].max_num_seqs must be an integer, "
                                       "got 'lots'", "False False"], out.stderr


def test_sampling_keys_are_the_sampling_parameters():
    from omnirt.pipeline.config import SAMPLING_KEYS
    from omnirt.pipeline.stage.sampling import SamplingParams

    # `forced` is teacher forcing (the parity check's), set per request by the engine's caller: no profile default
    assert set(SAMPLING_KEYS) == {f.name for f in dataclasses.fields(SamplingParams)} - {"forced"}


OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")


@pytest.mark.parametrize("profile", sorted(p.name for p in DEPLOY.glob("*.yaml")))
def test_every_shipped_profile_names_openai_voices(profile):
    """Each shipped profile maps every OpenAI voice name to one of Qwen3-Omni's three voices."""
    cfg = load_profile(DEPLOY / profile, "cpu")
    assert set(cfg.voice_aliases) == set(OPENAI_VOICES) and set(cfg.voice_aliases.values()) <= {"chelsie", "ethan",
                                                                                                "aiden"}
    cfg.check_voices(["aiden", "chelsie", "ethan"])
    with pytest.raises(ProfileError, match="voice_aliases.alloy names 'chelsie', not a voice of this model"):
        cfg.check_voices(["ethan"])


@pytest.mark.parametrize("profile", sorted(p.name for p in DEPLOY.glob("*.yaml")))
def test_openai_model_names_are_aliases_unless_a_profile_or_flag_turns_them_off(profile):
    from omnirt.app.model_names import is_alias, listed_models, served_model

    aliases = tuple(load_profile(DEPLOY / profile, "cpu").model_aliases)
    for name in ("gpt-realtime", "gpt-realtime-2.1", "gpt-4o-mini-realtime-preview-2024-12-17", "gpt-audio",
                 "gpt-4o-audio-preview", "GPT-4o-mini-audio-preview"):
        assert is_alias(name, aliases) and served_model(name, ("qwen",), aliases) == "qwen", name
    assert not any(is_alias(name, aliases) for name in ("gpt-4o", "gpt-4o-transcribe", "whisper-1", "tiny"))
    assert load_profile(DEPLOY / profile, "cpu", {"model_aliases": []}).model_aliases == []
    assert build_config({"model_aliases": ["qwen-voice", "my-*"]}, "cpu").model_aliases == ["qwen-voice", "my-*"]
    assert listed_models(("qwen",), ("qwen-voice", "my-*")) == ["qwen", "qwen-voice"]  # a pattern is not a name
    assert listed_models(("qwen",), ()) == ["qwen"] and served_model("gpt-realtime", ("qwen",), ()) is None


def test_platform_detection_boundary(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on CI (and on a GPU machine, told so)
    assert detect_platform().name == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert detect_platform().name == "cuda"
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert detect_platform().name == "rocm" and detect_platform().dist_backend == "rccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "xpu", type("X", (), {"is_available": staticmethod(lambda: True)}), raising=False)
    assert detect_platform().name == "xpu"
    assert get_platform("npu").dist_backend == "hccl"
    with pytest.raises(ValueError):
        get_platform("tpu")


# ---- replicas: placement keys and the replica profiles ------------------------------------------------


@pytest.mark.parametrize("stage,key", [
    ({"stage_id": 1, "num_replicas": 2, "devices": "1,2,3"}, "stages[1].devices"),  # more devices than replicas
    ({"stage_id": 1, "num_replicas": 2, "devices": "1,1"}, "stages[1].devices"),  # a device twice
    ({"stage_id": 2, "num_replicas": 2, "devices": "1;2"}, "stages[2].devices"),
    ({"stage_id": 2, "num_replicas": 2, "devices": ""}, "stages[2].devices"),
    ({"stage_id": 1, "num_replicas": -1}, "stages[1].num_replicas"),
    ({"stage_id": 1, "routing": "random"}, "stages[1].routing"),
    ({"stage_id": 1, "ray_resources": {"num_gpu": 1}}, "stages[1].ray_resources"),
])
def test_bad_replica_keys_name_the_key(stage, key):
    with pytest.raises(ProfileError, match=key.replace("[", r"\[").replace("]", r"\]")):
        build_config({"stages": [stage]}, "cpu", {}, {})


def test_bad_distributed_names_the_key():
    with pytest.raises(ProfileError, match="distributed"):
        build_config({"distributed": "mpi"}, "cpu", {}, {})


@pytest.mark.parametrize("platform", PLATFORMS)
def test_multi_replica_profile_per_platform(platform):
    cfg = load_profile(DEPLOY / "qwen3_omni_moe_multi_replicas.yaml", platform)
    th, tk, c2w = cfg.stages
    assert not th.needs_workers and th.device_ids == [0]
    assert tk.num_replicas == c2w.num_replicas == 2 and tk.device_ids == c2w.device_ids == [1, 2]
    assert [tk.replica_device(i) for i in range(2)] == [1, 2]
    assert cfg.distributed == "none" and cfg.dtype == ("float32" if platform == "cpu" else "bfloat16")
    assert c2w.enforce_eager == (platform in ("rocm", "xpu", "cpu"))


def test_stage_override_scales_a_pool_and_replicas_share_devices_in_turn():
    cfg = load_profile(DEPLOY / "qwen3_omni_moe_multi_replicas.yaml", "cuda",
                       stage_overrides={"1": {"num_replicas": 3}})
    tk = cfg.stage("talker")
    assert tk.num_replicas == 3 and [tk.replica_device(i) for i in range(3)] == [1, 2, 1]
    assert cfg.stage("code2wav").num_replicas == 2


@pytest.mark.parametrize("platform", PLATFORMS)
def test_ray_profile_per_platform(platform):
    from omnirt.pipeline.replicas.ray_actors import actor_resources

    cfg = load_profile(DEPLOY / "qwen3_omni_moe_ray.yaml", platform)
    tk = cfg.stage("talker")
    assert cfg.distributed == "ray" and tk.num_replicas == 2
    need = actor_resources(platform, tk.ray_resources)
    if platform in ("cuda", "rocm", "xpu"):
        assert need["num_gpus"] == 1
    elif platform == "npu":
        assert need["resources"] == {"NPU": 1} and need["num_gpus"] == 0
    else:
        assert need == {"num_cpus": 0.5, "num_gpus": 0}


def test_device_the_host_lacks_names_the_key(monkeypatch):
    import torch

    from omnirt.pipeline.replicas.pool import make_stage

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = load_profile(DEPLOY / "qwen3_omni_moe_multi_replicas.yaml", "cuda")  # devices "1,2" on a 2-GPU host
    with pytest.raises(ProfileError, match=r"stages\[1\]\.devices '1,2' names a device this host does not have"):
        make_stage("talker", cfg, models=None, on_step=lambda *a: None)


@pytest.mark.parametrize("profile", sorted(p.name for p in DEPLOY.glob("qwen3_omni_moe*.yaml")))
def test_gpu_profiles_keep_fixed_kv_sizing_on_the_cpu(profile):
    """Their fractions are of a GPU: on the CPU (a host that runs other things) each stage gets max_num_seqs
    slots."""
    cpu, cuda = load_profile(DEPLOY / profile, "cpu"), load_profile(DEPLOY / profile, "cuda")
    assert cpu.gpu_memory_utilization is None and all(s.gpu_memory_utilization is None for s in cpu.stages)
    assert profile == "qwen3_omni_moe_ray.yaml" or cuda.gpu_memory_utilization or any(
        s.gpu_memory_utilization for s in cuda.stages)
