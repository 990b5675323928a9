"""Naming the machine a measurement ran on (speckv_policy.machine)."""

from __future__ import annotations

import os
import platform

from speckv_policy.machine import cpu_model, describe_host


def test_cpu_model_reads_the_first_model_name_and_falls_back(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Example CPU 9000 @ 2GHz\n\nmodel name\t: other\n")
    assert cpu_model(str(info)) == "Example CPU 9000 @ 2GHz"
    info.write_text("processor\t: 0\nmodel name\t:   \n")  # empty name: the platform's answer, a string
    assert cpu_model(str(info)) == (platform.processor() or "")
    assert cpu_model(str(tmp_path / "missing")) == (platform.processor() or "")


def test_describe_host_names_the_cpu_threads_and_accelerator(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: Example CPU 9000\n")
    line = describe_host(cpuinfo=str(info))
    assert line.startswith(f"{platform.machine()} Example CPU 9000".strip())
    assert f"{os.cpu_count()} CPU threads" in line
    assert line.count(",") == 1  # no accelerator named
    assert describe_host("Example GPU", cpuinfo=str(info)) == f"{line}, Example GPU"
