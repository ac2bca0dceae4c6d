"""dapo-profile: a tiny run's profile.json / profile.html, and the findings' rules on crafted numbers."""
import json

import pytest

from dapo_trainer.tools import profiler
from tests.trainer.tiny import micro_setup


def test_profile_of_a_micro_run(tmp_path, capsys):
    overrides = micro_setup(str(tmp_path)) + ["trainer.save_freq=2", "trainer.test_freq=2"]
    out = tmp_path / "prof"
    p = profiler.cli(overrides + ["--steps", "3", "--out", str(out)])
    saved = json.load(open(out / "profile.json"))
    assert saved["steps"] == 3 and len(saved["per_step"]) == 3 and saved["findings"] == p["findings"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # the profiler drives train_step: no metrics file
    for s in saved["per_step"]:
        phases = sum(v for k, v in s.items() if k.startswith("timing_s/") and k != "timing_s/step")
        assert 0 < phases <= s["timing_s/step"]
        assert s["gen_batches"] == len(s["gen_batch_s"]) >= 1  # micro_setup: carry-over never fills a step
        assert sum(s["gen_batch_s"]) >= s["timing_s/gen"]  # a batch's time includes generation and more
        assert s["responses"] == 3 * 4 * s["gen_batches"]  # gen_batch_size 3 x rollout.n 4
        # cap 24 tokens per micro-batch; every sequence is <= 11 tokens
        assert 0 < s["micro_batch_utilisation"] <= 1 and s["update_tokens"] <= 24 * s["micro_batches"]
    assert "timing_s/checkpoint" in saved["per_step"][1] and "timing_s/validate" in saved["per_step"][1]
    assert "timing_s/checkpoint" not in saved["per_step"][0]
    assert abs(sum(saved["phase_share"].values()) - 1) < 0.05
    assert 0 <= saved["rollout_padding"] < 1 and saved["peak_memory_bytes"] > 1e8  # the process's peak RSS
    assert saved["cuda_idle_share"] is None  # CPU run
    assert saved["rollout_tokens_per_s"] > 0 and saved["update_tokens_per_s"] > 0
    page = open(out / "profile.html").read()
    assert "Findings" in page and 'src="profile_timing.png"' in page and (out / "profile_timing.png").is_file()
    assert "profile.json" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        profiler.main(overrides)  # --steps or --duration is required


def _summary(**kw):
    p = {"config": {"train_batch_size": 16, "gen_batch_size": 32, "rollout_n": 8, "max_response_length": 100,
                    "ppo_max_token_len_per_gpu": 4096, "use_dynamic_bsz": True, "ppo_mini_batch_size": 4},
         "gen_batches_per_step": 1.0, "keep_rate": 0.5, "all_correct_share": 0.3, "all_wrong_share": 0.2,
         "phase_share": {"gen": 0.4, "update_actor": 0.4, "reward": 0.2}, "micro_batch_utilisation": 0.9,
         "rollout_padding": 0.3, "truncated_share": 0.0, "cuda_idle_share": None}
    p.update(kw)
    return p


def test_findings_rules():
    assert profiler.findings(_summary()) == []
    f = profiler.findings(_summary(gen_batches_per_step=4.2, keep_rate=0.2, all_correct_share=0.71,
                                   all_wrong_share=0.09))
    assert [x["measurement"] for x in f] == ["gen_batches_per_step"]
    assert "4.2 generation batches" in f[0]["text"] and "too easy" in f[0]["text"] and "about 80" in f[0]["text"]
    f = profiler.findings(_summary(gen_batches_per_step=2.0, keep_rate=0.4, all_correct_share=0.1, all_wrong_share=0.5))
    assert "too hard" in f[0]["text"]
    # one batch, 90% kept: 29 kept groups for 16 -> over-generation
    f = profiler.findings(_summary(keep_rate=0.9))
    assert [x["measurement"] for x in f] == ["keep_rate"] and "gen_batch_size=20" in f[0]["text"]
    f = profiler.findings(_summary(phase_share={"gen": 0.7, "update_actor": 0.3}, micro_batch_utilisation=0.2,
                                   rollout_padding=0.8, truncated_share=0.1, cuda_idle_share=0.5))
    assert [x["measurement"] for x in f] == ["phase_share.gen", "micro_batch_utilisation", "rollout_padding",
                                             "truncated_share", "cuda_idle_share"]
    assert all(x["value"] > x["threshold"] or x["measurement"] == "micro_batch_utilisation" for x in f)
    # at the thresholds nothing fires
    assert profiler.findings(_summary(gen_batches_per_step=1.5, phase_share={"gen": 0.5}, micro_batch_utilisation=0.6,
                                      rollout_padding=0.5, truncated_share=0.05, cuda_idle_share=0.3)) == []


def test_cuda_idle_share_merges_overlapping_kernels():
    """The interval union of CUDA events (µs) over the step's wall time; CPU events are ignored."""
    from types import SimpleNamespace as NS

    def ev(kind, start, end):
        return NS(device_type=NS(name=kind), time_range=NS(start=start, end=end))

    events = [ev("CUDA", 0, 100), ev("CUDA", 50, 150), ev("CPU", 0, 1000), ev("CUDA", 400, 500), ev("CUDA", 420, 480)]
    prof = NS(events=lambda: events)
    assert abs(profiler._cuda_idle_share(prof, 1000e-6) - 0.75) < 1e-12  # busy 150 + 100 of 1000 µs
    assert profiler._cuda_idle_share(NS(events=lambda: []), 1.0) == 1.0
