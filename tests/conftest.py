"""Shared fixtures."""

import os
import shutil

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


@pytest.fixture(scope="session")
def warm_bases(tmp_path_factory):
    """A results folder for the whole session whose bases/ the modules' `results` folders copy from: each
    distinct base is warmed up once a session (ten modules share two), not once a module."""
    return tmp_path_factory.mktemp("warm-bases")


@pytest.fixture(scope="module")
def results(tmp_path_factory, request, warm_bases):
    """A results folder of the module's own holding the one warm base every run of the module starts from: that
    of the module's own `recipe()` (its fast settings)."""
    from atrctl.training.base_cache import ensure_base

    folder = tmp_path_factory.mktemp("results")
    base, _ = ensure_base(request.module.recipe(), warm_bases)
    shutil.copytree(base, folder / "bases" / base.name)
    return folder
