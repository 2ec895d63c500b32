"""AENV_SHM_DIR: the node's VM driver keeps guest RAM files in the tmpfs the setting names
(a private, bounded one instead of the host's /dev/shm)."""
from pathlib import Path

from django.test import override_settings

from agent import driver


def test_the_driver_is_given_the_configured_tmpfs(tmp_path):
    with override_settings(AENV_SHM_DIR=tmp_path):
        assert driver._qemu_options()["shm_dir"] == tmp_path


def test_the_default_is_dev_shm():
    from django.conf import settings

    assert settings.AENV_SHM_DIR == Path("/dev/shm")
