"""Tests of course_lib.landscape: every row sourced, the numbers consistent with each other, the course
modules the framework table points to exist, and the Markdown renderer."""

import importlib.util

import pytest

from course_lib import landscape as L

NUMERIC = ("tflops_16bit", "tflops_fp8", "hbm_gb", "hbm_tbps", "interconnect_gbps", "tdp_watts")


def _hw(name):
    return next(r for r in L.HARDWARE if r["name"].startswith(name))


def test_every_hardware_row_has_a_source_and_positive_or_missing_numbers():
    assert len(L.HARDWARE) >= 7
    for r in L.HARDWARE:
        assert r["source"].strip() and "http" in r["source"], r["name"]
        assert 2016 <= r["year"] <= 2025 and r["format_16bit"] in ("FP16", "BF16")
        for k in NUMERIC:
            assert k in r, (r["name"], k)
            assert r[k] is None or r[k] > 0, (r["name"], k, r[k])


def test_hardware_numbers_are_consistent():
    h100, h200, a100 = _hw("NVIDIA H100"), _hw("NVIDIA H200"), _hw("NVIDIA A100")
    for r in L.HARDWARE:                  # where FP8 exists it doubles the dense 16-bit rate
        if r["tflops_fp8"] is not None:
            assert r["tflops_fp8"] == pytest.approx(2 * r["tflops_16bit"], rel=0.01), r["name"]
    assert h200["tflops_16bit"] == h100["tflops_16bit"] and h200["hbm_gb"] > h100["hbm_gb"]
    assert a100["tflops_fp8"] is None and a100["tflops_16bit"] == 312.0   # estimate.A100_BF16_PEAK_FLOPS
    nvidia = sorted((r for r in L.HARDWARE if r["name"].startswith("NVIDIA")), key=lambda r: r["year"])
    peaks = [r["tflops_16bit"] for r in nvidia]
    assert peaks == sorted(peaks)        # every NVIDIA generation is faster than the one before
    assert _hw("Google TPU v4")["hbm_gb"] == pytest.approx(34.36, abs=0.01)   # 32 GiB


def test_every_framework_row_is_sourced_and_names_every_technique():
    names = {r["name"].split()[0] for r in L.FRAMEWORKS}
    assert {"Horovod", "DeepSpeed", "Megatron-LM", "Colossal-AI", "OneFlow", "PyTorch", "JAX"} <= names
    for r in L.FRAMEWORKS:
        assert r["source"].strip(), r["name"]
        assert set(L.TECHNIQUES) <= set(r), (r["name"], set(L.TECHNIQUES) - set(r))
        assert r["data_parallel"], r["name"]       # every one of them does data parallelism
    deepspeed = next(r for r in L.FRAMEWORKS if r["name"] == "DeepSpeed")
    assert "ZeRO stage 1-3" in deepspeed["zero_fsdp"]


def test_every_course_module_named_exists_except_fault():
    assert set(L.COURSE_MODULES) == set(L.TECHNIQUES)
    for technique, module in L.COURSE_MODULES.items():
        if module == "fault":             # the checkpointing module, written with its notebook
            continue
        assert importlib.util.find_spec(f"course_lib.{module}") is not None, (technique, module)


def test_markdown_table():
    rows = [{"a": 1, "b": None, "c": 2.0 / 3}, {"a": "x|y", "c": 1e-9}]
    assert L.markdown_table(rows, ["a", ("c", "C value"), "b"]).splitlines() == [
        "| a | C value | b |", "| --- | --- | --- |", "| 1 | 0.6667 |  |", "| x\\|y | 1e-09 |  |"]
    table = L.markdown_table(L.HARDWARE, [("name", "accelerator"), "tflops_16bit", "source"])
    assert table.count("\n") == len(L.HARDWARE) + 1 and "| NVIDIA H100 SXM | 989.4 |" in table
    with pytest.raises(ValueError, match="no row has the key 'nmae'"):
        L.markdown_table(rows, ["nmae"])
    with pytest.raises(ValueError, match="empty"):
        L.markdown_table([], ["a"])
