"""Test tooling that is not part of the product: a local Modal control plane that modal's own client
talks to (`cellfeed_testing.modal_control_plane`), an S3-compatible server, process helpers."""
