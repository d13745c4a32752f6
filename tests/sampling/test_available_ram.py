"""The one free-RAM rule: MemAvailable, at most the cgroup's memory limit."""

from __future__ import annotations

import dataclasses

import psutil

from torchdoctor.sampling.hostinfo import available_ram, read_host_info


def test_available_ram_is_what_the_kernel_says_is_available():
    host = read_host_info()
    before = psutil.virtual_memory().available
    ours = available_ram()
    after = psutil.virtual_memory().available
    # psutil reads the same MemAvailable; other programs move it a little between the reads
    cap = host.cgroup_memory_limit or ours
    slack = 256 * 2**20
    assert ours <= min(max(before, after), cap) + slack
    assert ours >= min(min(before, after), cap) - slack
    assert available_ram(host) > 0


def test_a_cgroup_limit_caps_what_is_available():
    host = dataclasses.replace(read_host_info(), cgroup_memory_limit=64 * 2**20)
    assert available_ram(host) == min(64 * 2**20, psutil.virtual_memory().available)
    unlimited = dataclasses.replace(host, cgroup_memory_limit=None)
    assert available_ram(unlimited) > 0
