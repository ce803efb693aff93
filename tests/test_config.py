"""Deploy profiles: platform merging, precedence, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.config import ProfileError, build_config, load_profile
from pipeline.platform import PLATFORMS, detect_platform, get_platform

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


@pytest.mark.parametrize("profile", sorted(p.name for p in DEPLOY.glob("*.yaml")))
@pytest.mark.parametrize("platform", PLATFORMS)
def test_every_shipped_profile_loads_on_every_platform(profile, platform):
    cfg = load_profile(DEPLOY / profile, platform)
    assert cfg.platform == platform and [s.name for s in cfg.stages] == ["thinker", "talker", "code2wav"]


def test_platform_entry_merges_over_base():
    raw = yaml.safe_load((DEPLOY / "qwen3_omni_moe.yaml").read_text())
    rocm = build_config(raw, "rocm", {}, {})
    cuda = build_config(raw, "cuda", {}, {})
    cpu = build_config(raw, "cpu", {}, {})
    assert rocm.stage("code2wav").enforce_eager and not cuda.stage("code2wav").enforce_eager
    assert cpu.dtype == "float32" and cuda.dtype == "bfloat16" and cpu.stage("thinker").max_num_seqs == 4
    # a platform entry that sets one key keeps the stage's other keys
    assert rocm.stage("code2wav").max_num_seqs == cuda.stage("code2wav").max_num_seqs == 64


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
    ({"connector": {"codec_chunk_frames": 0}}, "connector.codec_chunk_frames"),
    ({"connector": {"codec_left_context_frames": 0}}, "connector.codec_left_context_frames"),
    ({"platforms": {"tpu": {}}}, "platforms.tpu"),
    ({"dtype": "int4"}, "dtype"),
    ({"load_format": "pt"}, "load_format"),
    ({"stages": [{"stage_id": 7}]}, "stage_id"),
    ({"stages": {"stage_id": 0}}, "stages"),
    ({"bogus": 1}, "(top level).bogus"),
])
def test_bad_profile_names_the_key(raw, key):
    with pytest.raises(ProfileError, match=key.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        build_config(raw, "cpu", {}, {})


def test_unreadable_profile(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [unclosed")
    with pytest.raises(ProfileError):
        load_profile(bad, "cpu")


def test_platform_detection_boundary(monkeypatch):
    import torch

    assert detect_platform().name == "cpu"  # no accelerator on CI
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
