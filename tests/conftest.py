"""Shared fixtures."""

import os

import pytest
import torch


@pytest.fixture(scope="module")
def one_cpu_thread():
    """One CPU thread for a module's runs (and the processes they start): as fast for models this small,
    and immune to the oversubscription of a busy 2-core machine. The previous settings come back after."""
    previous, threads = os.environ.get("ATRCTL_THREADS"), torch.get_num_threads()
    os.environ["ATRCTL_THREADS"] = "1"
    yield
    if previous is None:
        del os.environ["ATRCTL_THREADS"]
    else:
        os.environ["ATRCTL_THREADS"] = previous
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    """A results folder holding the one warm base every run of the module starts from: that of the
    module's own `recipe()` (its fast settings)."""
    from atrctl.base_cache import ensure_base

    folder = tmp_path_factory.mktemp("results")
    ensure_base(request.module.recipe(), folder)
    return folder
