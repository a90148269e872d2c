"""Test-wide settings."""

import pytest
import torch

from lightning_superpipe import EmulatedLink, SuperpipeStrategy

# The models under test are tiny: one thread is faster than two, and CI's two cores are shared with other
# processes, where OpenMP threads oversubscribing them made the suite ten times slower.
torch.set_num_threads(1)


@pytest.fixture(params=["cpu", "lazy", "thread"])
def emulated_link(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test three times: on the plain CPU link, and on the emulated asynchronous link in both modes, so that
    the engine's CUDA code paths (deferred copies, events, staging, the gradient worker) and the happens-before
    checker see every streaming test. Strategies the test builds without a `link=` get the emulated one."""
    if request.param != "cpu":
        original = SuperpipeStrategy.__init__

        def with_link(self: SuperpipeStrategy, *args: object, link: object = None, **kwargs: object) -> None:
            link = link if link is not None else EmulatedLink(mode=request.param, seed=0, max_delay_s=2e-4)
            original(self, *args, link=link, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(SuperpipeStrategy, "__init__", with_link)
    return request.param
