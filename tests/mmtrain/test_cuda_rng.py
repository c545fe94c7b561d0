"""Each rank saves and restores its own CUDA device's RNG, no other (checked on CPU with the CUDA
RNG functions replaced by recorders: a fake node of 4 GPUs, this rank on cuda:2)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mmtrain.state.train_state import rng_state, set_rng_state

OWN = 2


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: OWN)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)

    def get(device="cuda"):
        calls.append(("get", device))
        return torch.tensor([10 + device], dtype=torch.uint8)

    def set_(state, device="cuda"):
        calls.append(("set", device, int(state[0])))

    def every_device(*a):
        raise AssertionError("touched every device's RNG")

    monkeypatch.setattr(torch.cuda, "get_rng_state", get)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_device)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", every_device)
    return calls


def test_saves_and_restores_exactly_the_ranks_device(fake_cuda):
    state = rng_state()
    assert fake_cuda == [("get", OWN)]
    set_rng_state(state)
    assert fake_cuda[1:] == [("set", OWN, 10 + OWN)]


def test_an_older_all_devices_state_restores_only_the_ranks_entry(fake_cuda):
    state = {**rng_state(), "cuda": [torch.tensor([20 + d], dtype=torch.uint8) for d in range(4)]}
    del state["cuda_device"]
    set_rng_state(state)
    assert fake_cuda[1:] == [("set", OWN, 20 + OWN)]


@pytest.mark.parametrize("device, want", [("cuda", [OWN]), ("cuda:3", [3]), ("cpu", [])])
def test_prime_probes_forks_only_the_ranks_device(monkeypatch, device, want):
    from mmtrain.models.moe import grouped_mm
    from mmtrain.parallel.parallelize import prime_probes

    monkeypatch.setattr(torch.cuda, "current_device", lambda: OWN)
    forked = []

    def fork_rng(devices):
        forked.append(devices)
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    monkeypatch.setattr(grouped_mm, "grouped_mm_supported", lambda dev, dtype: True)
    prime_probes(torch.device(device))
    assert forked == [want]
