"""Fault injection (mesh.compute.faults): refused without KVMESH_ALLOW_FAULT_INJECTION=1, naming the setting;
accepted with it; and what the injected faults do."""

from __future__ import annotations

import time

import pytest
import torch

from mesh.compute.faults import Faults, InjectedFault, perturb_weights
from mesh.compute.settings import WorkerSettings
from mesh.config import PACKAGE_VERSION, SettingError, load_settings


@pytest.mark.parametrize(
    ("variable", "value"),
    [("KVMESH_FAULT_TOKEN_DELAY_S", "0.05"), ("KVMESH_FAULT_ERROR_RATE", "0.5"), ("KVMESH_FAULT_WEIGHT_NOISE", "0.3")],
)
def test_a_fault_setting_without_the_allowance_refuses_to_start_naming_it(variable: str, value: str):
    with pytest.raises(SettingError) as error:
        load_settings(WorkerSettings, env={variable: value})
    assert str(error.value) == (
        f"{variable}={float(value)!r}: fault injection is for tests: set KVMESH_ALLOW_FAULT_INJECTION=1 to accept it"
    )


def test_fault_settings_are_accepted_with_the_allowance_and_checked():
    settings = load_settings(
        WorkerSettings,
        env={
            "KVMESH_ALLOW_FAULT_INJECTION": "1",
            "KVMESH_FAULT_TOKEN_DELAY_S": "0.05",
            "KVMESH_FAULT_ERROR_RATE": "0.25",
        },
    )
    faults = settings.faults()
    assert (faults.token_delay_s, faults.error_rate, faults.is_on) == (0.05, 0.25, True)
    with pytest.raises(SettingError, match=r"^KVMESH_FAULT_ERROR_RATE=1.5: must be from 0 to 1$"):
        load_settings(WorkerSettings, env={"KVMESH_ALLOW_FAULT_INJECTION": "1", "KVMESH_FAULT_ERROR_RATE": "1.5"})
    assert not load_settings(WorkerSettings, env={}).faults().is_on


def test_the_version_defaults_to_the_package_version_and_must_not_be_empty():
    assert load_settings(WorkerSettings, env={}).version == PACKAGE_VERSION != ""
    assert load_settings(WorkerSettings, env={"KVMESH_VERSION": "2.0.0-rc1"}).version == "2.0.0-rc1"
    with pytest.raises(SettingError, match=r"^KVMESH_VERSION=' ': must not be empty$"):
        load_settings(WorkerSettings, env={"KVMESH_VERSION": " "})


def test_an_error_rate_fails_that_share_of_requests():
    Faults(error_rate=0.0).check()
    with pytest.raises(InjectedFault):
        Faults(error_rate=1.0).check()
    faults = Faults(error_rate=0.3, seed=7)
    num_failed = 0
    for _ in range(1000):
        try:
            faults.check()
        except InjectedFault:
            num_failed += 1
    assert 250 < num_failed < 350


async def test_a_token_delay_waits_per_token():
    started = time.monotonic()
    await Faults(token_delay_s=0.02).delay(5)
    await Faults().delay(1000)
    assert 0.1 <= time.monotonic() - started < 0.5


def test_weight_noise_changes_every_floating_weight_by_its_own_scale_and_the_same_way_each_time():
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 50))

    original, first, second = model(), model(), model()
    assert perturb_weights(first, 0.3) == perturb_weights(second, 0.3) == 5  # embedding, norm's 2, linear's 2
    for before, after, again in zip(original.parameters(), first.parameters(), second.parameters(), strict=True):
        assert torch.equal(after, again)  # a fixed seed: every worker given the fault has the same other weights
        with torch.no_grad():
            change = float((after - before).std() / before.std()) if before.std() > 0 else 0.0
        assert 0.2 < change < 0.4 or torch.equal(after, before)  # LayerNorm's starts constant: std 0, unchanged
