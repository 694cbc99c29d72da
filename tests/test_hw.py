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


def test_several_gpus_are_numbered_placed_on_numa_nodes_and_linked(tmp_path):
    """Presets with 2 and 4 GPUs: gpu:0..N-1 each on a NUMA node, the link between them, through
    JSON unchanged and in the summary."""
    for name, n in (("2x-rtx4090-workstation", 2), ("h100-x2", 2), ("h100-x4", 4)):
        hw = PRESETS[name]
        assert len(hw.gpus) == n and hw.gpu_link is not None and all(g.numa_node == 0 for g in hw.gpus)
        p = tmp_path / f"{name}.json"
        p.write_text(hw.model_dump_json())
        assert resolve_hw(p) == hw
        text = hw.summary()
        assert f"(gpu:{n - 1}, NUMA node 0)" in text and f"link  {hw.gpu_link.kind} between the GPUs" in text
    assert PRESETS["2x-rtx4090-workstation"].gpu_link.kind == "pcie" and PRESETS["h100-x4"].gpu_link.kind == "nvlink"
    assert PRESETS["h100"].gpu_link is None and "gpu:0" not in PRESETS["h100"].summary()


def test_a_profile_with_several_gpus_needs_their_link_and_real_numa_nodes(tmp_path):
    p = tmp_path / "hw.json"
    raw = json.loads(PRESETS["h100-x2"].model_dump_json())
    raw["gpu_link"] = None
    p.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="2 GPUs need gpu_link.*ktflow hw probe"):
        resolve_hw(p)
    raw = json.loads(PRESETS["h100-x2"].model_dump_json())
    raw["gpus"][1]["numa_node"] = 1
    p.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"gpus\[1\] \(NVIDIA H100 80GB HBM3\) hangs off NUMA node 1, but the CPU "
                                          r"has 1 node"):
        resolve_hw(p)


def test_collectives_cost_their_ring_traffic_at_the_links_bus_bandwidth():
    from ktflow.costmodel.collectives import collective_seconds

    hw = PRESETS["h100-x4"]  # 350 GB/s bus, 20 us
    mb = 64e6
    assert collective_seconds("all_reduce", mb, 4, hw) == pytest.approx(20e-6 + 1.5 * mb / 350e9)
    assert collective_seconds("all_gather", mb, 4, hw) == pytest.approx(20e-6 + 0.75 * mb / 350e9)
    assert collective_seconds("reduce_scatter", mb, 2, hw) == pytest.approx(20e-6 + 0.5 * mb / 350e9)
    assert collective_seconds("send_recv", mb, 2, hw) == pytest.approx(20e-6 + mb / 350e9)
    assert collective_seconds("all_reduce", mb, 1, PRESETS["h100"]) == 0.0  # one rank moves nothing
    with pytest.raises(ConfigError, match="no gpu_link to price a all_reduce over 2 GPUs"):
        collective_seconds("all_reduce", mb, 2, PRESETS["h100"])
    with pytest.raises(ConfigError, match="unknown collective 'broadcast'"):
        collective_seconds("broadcast", mb, 2, hw)


def test_a_profile_with_more_gpus_than_the_plans_use_places_on_the_first_and_says_so(demo_dir, capsys, monkeypatch):
    """gpus=1 (the default) on a profile with two: the plans place on its first GPU alone."""
    from ktflow.util import notices

    monkeypatch.setattr(notices, "_said", set())  # said once a process: not yet in this test
    one = ktflow.compile(ktflow.load(demo_dir), hw=PRESETS["h100"], device="cpu", max_seq_len=256)
    two = ktflow.compile(ktflow.load(demo_dir), hw=PRESETS["h100-x2"].model_copy(update={"cpu": PRESETS["h100"].cpu}),
                         device="cpu", max_seq_len=256)
    assert "has 2 GPUs; the plans use 1 (gpus=1)" in capsys.readouterr().err
    assert [n.place.device for n in one.decode.ir.nodes] == [n.place.device for n in two.decode.ir.nodes]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_the_probe_measures_every_gpu_and_the_link_between_them():
    hw = probe(quick=True)
    assert len(hw.gpus) == torch.cuda.device_count() and all(g.pcie_h2d_gbps > 1 for g in hw.gpus)
    k = hw.gpu_link
    assert k is not None and k.allreduce_busbw_gbps > 1 and k.allreduce_latency_us > 0 and k.p2p_gbps > 1
    assert "gpu_link" in hw.measured


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
