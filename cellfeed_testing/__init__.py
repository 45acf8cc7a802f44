"""Test tooling that is not part of the product: the Modal emulator (`cellfeed_testing.modal_emulator`)."""
