"""The device-idle figures of ``benchmarks/adjoint_codecs.py --profile``: ``common.device_idle`` on synthetic event
lists (overlapping kernels on two streams, gaps, memcpys, host synchronisations), ``common.profiler_events`` on a
stand-in for a CUDA trace, and the script's CPU smoke run with ``--profile`` (no device: no figure invented)."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import random
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")

_spec = importlib.util.spec_from_file_location("bench_common", os.path.join(BENCH, "common.py"))
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def test_overlapping_kernels_on_two_streams_count_once() -> None:
    events = [(0.0, 3.0, "kernel", "stencil"),  # stream 1
              (1.0, 2.0, "kernel", "quant"),  # stream 2, inside the first
              (2.0, 5.0, "kernel", "dequant")]  # stream 2, overlaps the first's end
    r = common.device_idle(events, (0.0, 10.0))
    assert r["busy_s"] == pytest.approx(5.0)  # the sum would be 7
    assert r["idle_fraction"] == pytest.approx(0.5)
    assert r["wall_s"] == pytest.approx(10.0)


def test_gaps_between_kernels_memcpys_and_memsets_are_idle() -> None:
    events = [(6.0, 7.0, "memcpy", "Memcpy DtoH (Device -> Pinned)"),  # unsorted on purpose
              (0.0, 1.0, "kernel", "a"),
              (7.0, 8.0, "memset", "Memset (Device)"),  # touches the memcpy: no gap, no overlap
              (3.0, 4.0, "kernel", "b")]
    r = common.device_idle(events, (0.0, 10.0))
    assert r["busy_s"] == pytest.approx(4.0)  # first-to-last would be 8
    assert r["idle_fraction"] == pytest.approx(0.6)


def test_device_work_is_clipped_to_the_window_and_host_events_are_not_work() -> None:
    events = [(-2.0, 1.0, "kernel", "before"), (9.0, 12.0, "memcpy", "Memcpy HtoD"), (20.0, 30.0, "kernel", "after"),
              (2.0, 8.0, "runtime", "cudaStreamSynchronize"), (1.0, 9.0, "cpu", "aten::copy_"),
              (3.0, 6.0, "device_sync", "Stream Sync")]
    r = common.device_idle(events, (0.0, 10.0))
    assert r["busy_s"] == pytest.approx(2.0)
    assert r["idle_fraction"] == pytest.approx(0.8)


def test_no_device_work_is_all_idle() -> None:
    r = common.device_idle([(1.0, 2.0, "runtime", "cudaLaunchKernel")], (0.0, 4.0))
    assert r["busy_s"] == 0.0 and r["idle_fraction"] == pytest.approx(1.0) and r["sync_calls"] == 0


def test_busy_is_the_union_on_random_intervals() -> None:
    rng = random.Random(26)
    for _ in range(200):
        cells: set[int] = set()
        events = []
        for _ in range(rng.randrange(0, 12)):
            s = rng.randrange(-5, 40)
            e = s + rng.randrange(0, 8)
            kind = rng.choice(["kernel", "memcpy", "memset", "runtime"])
            events.append((float(s), float(e), kind, "x"))
            if kind != "runtime":
                cells.update(c for c in range(s, e) if 0 <= c < 30)
        r = common.device_idle(events, (0.0, 30.0))
        assert r["busy_s"] == pytest.approx(len(cells)), events
        assert r["idle_fraction"] == pytest.approx(1 - len(cells) / 30), events


def test_gaps_add_up_to_the_idle_time_by_part_and_by_group() -> None:
    """``common.device_gaps``: on random work, the parts' idle and the groups' idle each add up to the window less
    the busy time that ``device_idle`` measures; a gap is named by the work that ended last before it."""
    rng = random.Random(3)
    for _ in range(50):
        ev = []
        for _ in range(rng.randint(0, 30)):
            s = rng.uniform(-1.0, 10.0)
            ev.append((s, s + rng.uniform(0.0, 1.5), rng.choice(["kernel", "memcpy", "memset", "runtime"]),
                       rng.choice("abc")))
        window = (0.0, rng.uniform(1.0, 10.0))
        parts = rng.randint(1, 12)
        idle = window[1] * common.device_idle(ev, window)["idle_fraction"]
        g = common.device_gaps(ev, window, parts=parts, top=10_000)
        width = window[1] / parts
        assert sum(p * width for p in g["idle_by_part"]) == pytest.approx(idle, abs=1e-9)
        assert sum(x["idle_s"] for x in g["gaps"]) == pytest.approx(idle, abs=1e-9)
        assert all(0.0 <= p <= 1.0 + 1e-12 for p in g["idle_by_part"])
    g = common.device_gaps([(0.0, 3.0, "kernel", "long"), (1.0, 2.0, "kernel", "short"), (4.0, 5.0, "memcpy", "c")],
                           (0.0, 6.0))
    assert [(x["before"], x["after"]) for x in g["gaps"]] == [("long", "c"), ("c", "(end)")]
    with pytest.raises(ValueError, match="device_gaps"):
        common.device_gaps([], (1.0, 1.0))


def test_counts_host_synchronisations_in_the_window() -> None:
    events = [(1.0, 1.1, "runtime", "cudaStreamSynchronize"), (2.0, 2.1, "runtime", "cudaStreamSynchronize"),
              (3.0, 3.1, "runtime", "cudaEventSynchronize"), (4.0, 4.1, "runtime", "cudaDeviceSynchronize"),
              (5.0, 5.1, "runtime", "cudaMemcpy"), (5.5, 5.6, "runtime", "cudaMemcpy2D"),
              (6.0, 6.1, "runtime", "cudaMemcpyAsync"), (6.5, 6.6, "runtime", "cudaMemcpy2DAsync"),
              (7.0, 7.1, "runtime", "cudaLaunchKernel"), (7.5, 7.6, "runtime", "cudaStreamWaitEvent"),
              (11.0, 11.1, "runtime", "cudaStreamSynchronize"),  # after the window
              (8.0, 9.0, "kernel", "cudaStreamSynchronize")]  # device work, whatever its name
    r = common.device_idle(events, (0.0, 10.0))
    assert r["syncs"] == {"cudaDeviceSynchronize": 1, "cudaEventSynchronize": 1, "cudaMemcpy": 1, "cudaMemcpy2D": 1,
                          "cudaStreamSynchronize": 2}
    assert r["sync_calls"] == 6
    assert r["busy_s"] == pytest.approx(1.0)


def test_a_window_that_ends_before_it_starts_is_refused() -> None:
    with pytest.raises(ValueError, match="ends before it starts"):
        common.device_idle([], (2.0, 1.0))


def _ev(name: str, start_us: float, end_us: float, dev: DeviceType, annotation: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start_us, end=end_us), device_type=dev,
                           is_user_annotation=annotation)


def test_profiler_events_sorts_a_cuda_trace_into_work_host_and_window() -> None:
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    prof = SimpleNamespace(events=lambda: [
        _ev("run", 0, 1_000_000, cpu, annotation=True),
        _ev("run", 100, 900_000, cuda, annotation=True),  # the device's mirror of the range: not work
        _ev("_wave_step_kernel", 100_000, 300_000, cuda),
        _ev("Memcpy DtoD (Device -> Device)", 200_000, 400_000, cuda),
        _ev("Memset (Device)", 500_000, 600_000, cuda),
        _ev("Event Sync", 600_000, 900_000, cuda),  # CUPTI's record of a wait: not work
        _ev("cudaStreamSynchronize", 550_000, 600_000, cpu),
    ])
    events, window = common.profiler_events(prof, "run")
    assert window == (0.0, 1.0)
    kinds = {name: kind for _, _, kind, name in events}
    assert kinds["_wave_step_kernel"] == "kernel" and kinds["Memset (Device)"] == "memset"
    assert kinds["Memcpy DtoD (Device -> Device)"] == "memcpy" and kinds["Event Sync"] == "device_sync"
    r = common.device_idle(events, window)
    assert r["busy_s"] == pytest.approx(0.4)
    assert r["idle_fraction"] == pytest.approx(0.6)
    assert r["syncs"] == {"cudaStreamSynchronize": 1}
    with pytest.raises(RuntimeError, match="no record_function"):
        common.profiler_events(prof, "other")


def test_profiler_events_takes_a_device_only_traces_window_from_its_markers() -> None:
    """A trace of device activity only holds no range: its window runs from the first marker call's start to the last
    one's end (``adjoint_codecs.py --profile-light``: two ``torch.cuda.synchronize()`` around the run)."""
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    prof = SimpleNamespace(events=lambda: [
        _ev("cudaDeviceSynchronize", 0, 10, cpu),
        _ev("cudaLaunchKernel", 100, 110, cpu),
        _ev("_wave_step_kernel", 120, 520_000, cuda),
        _ev("cudaDeviceSynchronize", 300_000, 310_000, cpu),  # the run's own, inside the window
        _ev("cudaDeviceSynchronize", 990_000, 1_000_000, cpu),
    ])
    events, window = common.profiler_events(prof, None, marker="cudaDeviceSynchronize")
    assert window == (0.0, 1.0)
    r = common.device_idle(events, window)
    assert r["busy_s"] == pytest.approx(0.51988) and r["idle_fraction"] == pytest.approx(1 - 0.51988)
    with pytest.raises(RuntimeError, match="fewer than two"):
        common.profiler_events(SimpleNamespace(events=lambda: [_ev("cudaDeviceSynchronize", 0, 1, cpu)]), None,
                               marker="cudaDeviceSynchronize")


def test_adjoint_codecs_profile_on_the_cpu_measures_no_idle_fraction(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, os.path.join(BENCH, "adjoint_codecs.py"), "--schedules", "zcut", "--codecs",
                          "none,quant4", "--profile", "--trace-dir", str(tmp_path / "traces"), "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("no device: idle fraction not measured") == 4  # (a), (b), (d) none, (d) quant4
    with open(tmp_path / "adjoint_codecs.json") as f:
        z = json.load(f)["schedules"]["zcut"]
    figs = [z["a"]["profile"], z["b"]["profile"], z["d"]["none"]["profile"], z["d"]["quant4"]["profile"]]
    for fig in figs:
        assert fig["wall_s"] > 0 and fig["run_s"] > 0
        assert fig["busy_s"] is None and fig["idle_fraction"] is None and fig["sync_calls"] is None
    assert sorted(os.listdir(tmp_path / "traces")) == ["trace_zcut_a_gpu.json", "trace_zcut_b_sync.json",
                                                       "trace_zcut_none.json", "trace_zcut_quant4.json"]


def test_median_traced_takes_the_middle_idle_and_keeps_every_turn() -> None:
    """``--profile-turns``' choice among a configuration's traced runs, on synthetic figures (in a subprocess: the
    script's imports stay out of this one)."""
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        from adjoint_codecs import median_traced
        figs = [dict(idle_fraction=i, wall_s=w, run_s=w, busy_s=0.5) for i, w in ((0.3, 0.9), (0.1, 0.7), (0.2, 0.8))]
        m = median_traced(figs)
        assert m["idle_fraction"] == 0.2 and m["wall_s"] == 0.8, m
        assert [t["idle_fraction"] for t in m["turns"]] == [0.3, 0.1, 0.2]  # in the order they ran
        assert median_traced(figs[:2])["idle_fraction"] == 0.1  # an even count: the lower middle
        cpu = [dict(idle_fraction=None, wall_s=w, run_s=w) for w in (3.0, 1.0, 2.0, 4.0)]
        assert median_traced(cpu)["wall_s"] == 2.0  # no device: by window
        try:
            median_traced([])
        except ValueError:
            print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-c", script, BENCH], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout[-3000:] + res.stderr[-3000:]


def test_adjoint_codecs_profile_turns_on_the_cpu(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, os.path.join(BENCH, "adjoint_codecs.py"), "--schedules", "zcut", "--codecs",
                          "none", "--profile", "--profile-turns", "2", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(tmp_path / "adjoint_codecs.json") as f:
        z = json.load(f)["schedules"]["zcut"]
    for fig in (z["a"]["profile"], z["b"]["profile"], z["d"]["none"]["profile"]):
        assert len(fig["turns"]) == 2 and all(t["wall_s"] > 0 for t in fig["turns"])
        assert fig["wall_s"] == min(t["wall_s"] for t in fig["turns"])  # the lower middle of two
    assert (tmp_path / "profile_zcut_none.txt").exists() and (tmp_path / "profile_zcut_none_turn1.txt").exists()
    bad = subprocess.run([sys.executable, os.path.join(BENCH, "adjoint_codecs.py"), "--profile-turns", "2"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--profile-turns" in bad.stderr


def test_adjoint_codecs_runs_each_codec_with_both_size_settings(tmp_path: pathlib.Path) -> None:
    """``--sizes exact,deferred``: each codec's (d) runs with ``defer_sizes`` off and on, in one process, traced too;
    the deferred row's image is the exact row's bit for bit (lossless and lossy: the restores decode the same bits);
    ``none`` runs once. A GPU budget of one uncompressed snapshot (7 compressed) for 16 sends some to host memory.
    ``--memstats`` without CUDA measures nothing and says so."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, os.path.join(BENCH, "adjoint_codecs.py"), "--schedules", "revolve", "--codecs",
                          "none,quant4", "--sizes", "exact,deferred", "--budget-slots", "1", "--snapshots", "16",
                          "--profile", "--pyprofile", "--memstats", "--out", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "(d) quant4 deferred" in res.stdout and "image == exact's" in res.stdout
    # --memstats without CUDA: said once, nothing measured, nothing invented
    assert res.stdout.count("memstats: not measured (no CUDA device)") == 1 and "memstats]" not in res.stdout
    with open(tmp_path / "adjoint_codecs.json") as f:
        z = json.load(f)
    assert z["sizes"] == ["exact", "deferred"]
    d = z["schedules"]["revolve"]["d"]
    assert sorted(d) == ["none", "quant4", "quant4+deferred"]
    assert [d[k]["defer_sizes"] for k in ("none", "quant4", "quant4+deferred")] == [False, False, True]
    assert d["quant4+deferred"]["image_equal_exact"] is True
    assert d["quant4+deferred"]["psnr_db"] == d["quant4"]["psnr_db"] < float("inf")
    assert d["none"]["psnr_db"] == "inf" and "image_equal_exact" not in d["quant4"]  # write_json: inf as "inf"
    assert all(d[k]["memstats"] is None for k in d)
    for k in ("quant4", "quant4+deferred"):
        st = d[k]["stats"]
        assert st["bytes_to_host"] > 0 and st["packed_bytes"] == d["quant4"]["stats"]["packed_bytes"]
        assert d[k]["profile"]["run_s"] > 0
    assert (tmp_path / "profile_revolve_quant4_deferred.txt").exists()
    py = (tmp_path / "pyprofile_revolve_quant4_deferred.txt").read_text()  # --pyprofile: the host's Python by function
    assert "== by own time" in py and "save" in py and (tmp_path / "pyprofile_revolve_quant4.txt").exists()
    bad = subprocess.run([sys.executable, os.path.join(BENCH, "adjoint_codecs.py"), "--sizes", "late"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and "--sizes takes exact, deferred and/or graphs" in bad.stderr
    if not torch.cuda.is_available():  # graphs replay CUDA graphs: refused where there is no device
        cpu = subprocess.run([sys.executable, os.path.join(BENCH, "adjoint_codecs.py"), "--sizes", "graphs"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=240)
        assert cpu.returncode == 2 and "--sizes graphs replays CUDA graphs" in cpu.stderr


def test_adjoint_codecs_memstats_figures() -> None:
    """``--memstats``'s record of a run (``memstats_delta``) and its line, on synthetic ``torch.cuda.memory_stats()``
    dicts: counters as changes over the run, peaks as they are after it, ``None`` (printed ``-``) for a figure this
    torch does not report. In a subprocess: the script's imports (``adjoint``, ``wave``) stay out of this one."""
    script = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import adjoint_codecs as a
        before = {"num_alloc_retries": 1, "num_device_alloc": 10, "num_device_free": 4, "num_sync_all_streams": 0,
                  "allocation.all.allocated": 1000, "segment.all.allocated": 12, "inactive_split.all.peak": 9}
        after = dict(before, num_device_alloc=25, num_device_free=7, **{"allocation.all.allocated": 1800,
                     "inactive_split.all.peak": 3})
        del after["num_sync_all_streams"]
        rec = a.memstats_delta(before, after, 3 << 30)
        print(json.dumps(rec))
        print(a.memstats_line(rec))
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-c", script, BENCH], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    rec_line, line = res.stdout.strip().splitlines()[-2:]
    assert json.loads(rec_line) == {"num_alloc_retries": 0, "num_device_alloc": 15, "num_device_free": 3,
                                    "num_sync_all_streams": None, "allocation.all.allocated": 800,
                                    "segment.all.allocated": 0, "inactive_split.all.peak": 3,
                                    "max_memory_reserved": 3 << 30}
    assert line == ("alloc retries +0, cudaMalloc +15, cudaFree +3, sync all streams -, allocations +800, segments +0; "
                    "peak inactive splits 3, max reserved 3.000 GiB")


def test_more_turns_while_a_side_spreads_up_to_the_most() -> None:
    """``common.more_turns`` (benchmarks/zoo.py's paired turns): another turn while a side's turns spread over 10% and
    fewer than ``most`` turns were measured; none once the turns agree or ``most`` is reached."""
    steady = {"eager": [1.00, 1.02, 1.05], "plan": [0.98, 1.00, 1.01]}
    noisy = {"eager": [1.00, 1.37, 1.20], "plan": [0.98, 1.00, 1.01]}
    assert not common.more_turns(steady, 15)
    assert common.more_turns(noisy, 15)
    assert not common.more_turns(noisy, 3)  # three turns a side already
    assert not common.more_turns(noisy, 0)
    assert common.more_turns({"eager": [1.0, 1.2], "plan": [1.0, 1.0]}, 3, spread=0.10)
    assert not common.more_turns({"eager": [1.0, 1.2], "plan": [1.0, 1.0]}, 3, spread=0.25)
