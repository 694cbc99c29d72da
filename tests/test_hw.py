"""Hardware profiles: presets, JSON files, bad profiles, this machine, and the probe."""

import json
import subprocess
import sys

import pytest
import torch

import ktflow
from ktflow.errors import ConfigError
from ktflow.costmodel.hw import PRESETS, HwProfile, _count_cpulist, resolve_hw, this_machine
from ktflow.tools.probe import probe


def test_paper_presets_carry_the_papers_numbers():
    for name, gpu_mem in (("paper-a100", 40), ("paper-4080", 16)):
        hw = PRESETS[name]
        assert [n.dram_gbps for n in hw.cpu.numa] == [220, 220] and hw.cpu.cross_socket_gbps == 125
        assert hw.cpu.cores == 72 and hw.cpu.isa.amx_bf16
        assert hw.gpus[0].memory_bytes == gpu_mem * 2**30 and hw.gpus[0].pcie_h2d_gbps == 32
    assert not PRESETS["cpu"].has_gpu and PRESETS["rtx4090-desktop"].gpus[0].name == "NVIDIA RTX 4090"


def test_profile_json_round_trip(tmp_path):
    p = tmp_path / "hw.json"
    p.write_text(PRESETS["paper-a100"].model_dump_json())
    assert resolve_hw(p) == PRESETS["paper-a100"]
    assert resolve_hw(str(p)) == PRESETS["paper-a100"]


def test_unknown_preset_names_the_value():
    with pytest.raises(ConfigError, match="unknown hardware profile 'a100-typo'.*paper-a100"):
        resolve_hw("a100-typo")


def test_malformed_profile_json(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json is not valid JSON"):
        resolve_hw(p)
    raw = json.loads(PRESETS["cpu"].model_dump_json())
    raw["cpu"]["numa"][0]["dram_gbps"] = -5
    p.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="cpu.numa.0.dram_gbps"):
        resolve_hw(p)
    raw = json.loads(PRESETS["cpu"].model_dump_json())
    raw["cpu"]["numa"] = []
    p.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="cpu.numa"):
        resolve_hw(p)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_hw(tmp_path / "missing.json")


def test_this_machine_describes_the_host():
    hw = this_machine()
    assert hw.cpu.cores >= 1 and hw.cpu.memory_bytes > 2**30
    assert hw.has_gpu == torch.cuda.is_available()


def test_cpulist_parsing():
    assert _count_cpulist("0-3,8,10-11") == 7 and _count_cpulist("0") == 1


def test_quick_probe_measures_this_machine(monkeypatch):
    """A quick probe still reads past the last-level cache (here said to be 40 MiB) where it
    measures a bandwidth, and times the GPU's grouped experts at a long prompt's size (a small
    product ran at 3% of the GPU's GEMM rate)."""
    import ktflow.tools.probe

    monkeypatch.setattr(ktflow.tools.probe, "last_level_cache_bytes", lambda: 40 << 20)
    lines = []
    hw = probe(quick=True, log=lines.append)
    assert {"dram_gbps", "gemm_tflops", "gemv_gbps"} <= set(hw.measured)
    assert hw.cpu.dram_gbps > 0.1 and hw.cpu.gemm_tflops > 0.001 and hw.cpu.gemv_gbps > 0.1
    assert any(line.startswith("DRAM read") and "(160 MiB," in line for line in lines)
    if torch.cuda.is_available():
        g = hw.gpus[0]
        assert g.hbm_gbps > 100 and g.bf16_tflops > 10 and g.pcie_h2d_gbps > 1 and "gpu_launch_us" in hw.measured
        assert g.grouped_tflops > 0.1 * g.bf16_tflops, (g.grouped_tflops, g.bf16_tflops)
        from ktflow.backends.native import binding as native

        if native.available():  # the hand-off priced from its measured round trip
            assert "cpu_sync_us" in hw.measured and any("hand-off" in line for line in lines)
    assert HwProfile.model_validate_json(hw.model_dump_json()) == hw


def test_hw_cli_show_probe_and_compile_with_the_result(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "ktflow", *map(str, args)], capture_output=True, text=True)

    r = run("hw", "show")
    assert r.returncode == 0 and all(name in r.stdout for name in PRESETS)
    r = run("hw", "show", "paper-4080")
    assert r.returncode == 0 and "RTX 4080" in r.stdout and "cross-socket 125 GB/s" in r.stdout
    out = tmp_path / "me.json"
    r = run("hw", "probe", "--quick", "--name", "ci-box", "-o", out)
    assert r.returncode == 0, r.stderr
    assert HwProfile.model_validate_json(out.read_text()).name == "ci-box"
    r = run("hw", "show", "nope")
    assert r.returncode == 2 and "unknown hardware profile 'nope'" in r.stderr


def test_compile_records_the_profile(demo_dir, tmp_path):
    c = ktflow.compile(ktflow.load(demo_dir), hw="paper-a100", device="cpu")
    assert c.plans.hw == PRESETS["paper-a100"]
    assert "2x Intel Xeon Platinum 8452Y + NVIDIA A100 40GB" in c.summary()


def test_handoff_round_trip_is_measured_where_a_gpu_runs_it():
    """The hand-off probe times doorbell -> native dispatcher -> done flag inside a replayed graph;
    on a machine without CUDA (or the native module) it says so with None instead of a number."""
    import torch

    from ktflow.backends.native import binding as native
    from ktflow.tools.handoff_probe import round_trip_us

    trip = round_trip_us(n=8, reps=3)
    if not (torch.cuda.is_available() and native.available()):
        assert trip is None
        return
    assert trip is not None and 0.0 < trip < 1000.0  # microseconds: a few to tens on a healthy host
