"""Loaded at start-up by every process of an emulated Modal world (this folder is first on its
PYTHONPATH): the emulated objects replace modal's remote ones before any user code runs, and in a
container (`$MODAL_EMULATOR_IMAGE` set) the process can import only what its image installs (S20)."""

import os

if os.environ.get("MODAL_EMULATOR"):
    from cellfeed_testing.modal_emulator.client import install

    install()
    if os.environ.get("MODAL_EMULATOR_IMAGE"):
        from cellfeed_testing.modal_emulator.images import from_environment, install_guard

        install_guard(from_environment())
