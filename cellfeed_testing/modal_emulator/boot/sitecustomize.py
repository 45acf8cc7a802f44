"""Loaded at start-up by every process of an emulated Modal world (this folder is first on its
PYTHONPATH): the emulated objects replace modal's remote ones before any user code runs."""

import os

if os.environ.get("MODAL_EMULATOR"):
    from cellfeed_testing.modal_emulator.client import install

    install()
