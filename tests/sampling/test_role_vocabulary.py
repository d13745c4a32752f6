"""The role names: sampling/roles.py for torchdoctor, a copy in the standard-library agent."""

from __future__ import annotations

from torchdoctor.instrument.agent import contract
from torchdoctor.sampling import roles


def test_the_agent_names_roles_as_the_rest_of_torchdoctor_does():
    for name in ("TRAINER", "WORKER", "LAUNCHER", "RANK"):
        assert getattr(contract, name) == getattr(roles, name), name
    assert set(roles.COMPUTE) == {contract.TRAINER, contract.RANK}
