"""Test tooling that is not part of the product: the Modal emulator (`testing.modal_emulator`)."""
