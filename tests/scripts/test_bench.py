"""scripts/bench.py still runs end to end (a smoke test: nothing here is about speed).

Timings on a shared CI machine are noise, so this asserts only that the benchmark completes at a
tiny size and reports every figure the results page is built from, as positive numbers.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_common():
    """scripts/benchmarks/common.py, loaded by path (scripts/ is not a package on sys.path)."""
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "scripts" / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_contender_is_compared_with_the_reference_runs_on_either_side_of_it():
    times = iter([1.0, 4.0, 3.0, 2.0, 5.0])  # R A R B R: the disk slows down during the repeat
    order = []

    def run(kind):
        order.append(kind)
        return {"seconds": next(times)}

    runs = load_common().bracketed(run, "raw", ["a", "b"])
    assert order == ["raw", "a", "raw", "b", "raw"]
    assert runs["a"][0]["ref_seconds"] == 2.0 and runs["b"][0]["ref_seconds"] == 4.0
    assert [r["ref_seconds"] for r in runs["raw"]] == [1.0, 3.0, 5.0]


@pytest.mark.acceptance  # 20 s or more of whole launches: the acceptance step (CONTRIBUTING.md)
@pytest.mark.process
def test_bench_runs_at_a_tiny_size_and_reports_every_ratio(tmp_path):
    """Slower than 20 s under load: every section of scripts/bench.py but the torch ones, once, at
    a tiny size (each section starts its own processes: W=1 and W=2 saves, the engine, start-up)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--size", "16MiB", "--world-size", "1,2",
         "--repeat", "1", "--steps", "3", "--engine-mib", "4", "--no-torch", "--log-lines", "2000", "--startup-repeat", "1",
         "--s3-mib", "16",
         "--dir", str(tmp_path), "--json", str(out), "--plot", str(tmp_path / "bench.png")],
        capture_output=True, text=True, timeout=600)  # a hang guard: under load it took over 120 s
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (tmp_path / "bench.png").stat().st_size > 0
    for op, ref in (("save", "raw"), ("load", "limit")):
        assert set(result[op]) == {"1", "2"}
        for w, kinds in result[op].items():
            assert {ref, "trainjob", "safetensors", "numpy"} <= set(kinds)
            assert (op, w) != ("save", "2") or "gather" in kinds
            assert op != "save" or kinds["raw+sha256"]["ratio_to_limit"]["median"] > 0  # the hashing floor
            for figures in kinds.values():
                for key in ("mb_per_s", "ratio_to_limit", "peak_rss_over_state", "peak_rss_mib"):
                    assert all(v > 0 for v in figures[key].values()), (op, w, key)
            assert kinds[ref]["ratio_to_limit"]["median"] == 1.0
    # N vs 2N steps cancel start-up; at 3 steps that difference can be noise of either sign.
    assert set(result["engine"]) == {"linear", "big"} and result["engine"]["big"]["state_mib"] == 4
    for engine in result["engine"].values():
        assert all(v > 0 for v in engine["bare_ms_per_step"].values())
        assert {"engine_ms_per_step", "ratio"} <= set(engine)
    assert result["status"]["lines"] == 2000 and result["status"]["peak_mib"] > 0
    assert result["targets"] and all(isinstance(v, bool) for v in result["targets"].values())
    assert all(p["two_thread_speedup"] > 0 for p in result["cpu_probe"].values())
    assert result["machine"]["cores"] >= 1 and result["state_bytes"] == 16 << 20
    startup = result["startup"]["commands"]
    assert {"trainjob --help", "trainjob status (one line)", "python -c 'import trainjob'"} <= set(startup)
    assert all(c[k]["median"] > 0 for c in startup.values() for k in ("seconds", "x_python", "x_numpy"))
    assert sum(name.startswith("start-up:") for name in result["targets"]) == 3
    assert result["s3"]["mib"] == 16 and len(result["s3"]["targets"]) == 2  # the test extra has the server
    assert all(result["s3"][k]["median"] > 0 for k in ("save_ratio", "load_ratio"))
    assert all(v["median"] > 0 for v in result["s3"]["seconds"].values())


@pytest.mark.process
def test_the_trainer_section_runs_at_a_tiny_size_and_reports_every_ratio(tmp_path):
    """Slow: the trainer section runs torch scripts beside trainjob, DCP and torch.save peers."""
    import pytest
    pytest.importorskip("torch", reason="the trainer section needs torch")
    out = tmp_path / "trainer.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--only", "trainer", "--trainer-dim", "64",
         "--trainer-steps", "4", "--trainer-every", "2", "--repeat", "1", "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trainer = json.loads(out.read_text())["trainer"]
    for key in ("trainjob_run_s", "bare_run_s", "run_ratio", "trainjob_peak_mib", "bare_peak_mib"):
        assert trainer[key]["median"] > 0, key
    # N vs 2N steps cancel start-up; at 2 steps that difference can be noise of either sign.
    assert {"trainjob_ms_per_step", "bare_ms_per_step", "step_ratio"} <= set(trainer)
    assert set(trainer["peers_s"]) == {f"{op} {who}" for op in ("save", "load") for who in ("trainjob", "dcp", "torch")}
    assert all(s["median"] > 0 for s in trainer["peers_s"].values())
    assert len(trainer["targets"]) == 5 and all(isinstance(v, bool) for v in trainer["targets"].values())
