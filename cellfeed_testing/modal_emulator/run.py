"""`modal run APP.py --flag ...` on the emulator: the local entrypoint's options are built by
modal's own CLI code from its signature (modal/cli/run.py: `_get_cli_runnable_signature`,
`_add_click_options`, as `modal run` builds them; S18), the command line is parsed by click, and
the entrypoint's body runs in this process, its Modal calls going to the emulator.

    MODAL_EMULATOR=host:port python -m cellfeed_testing.modal_emulator.run app/modal_app.py --dataset ...
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click


def command(app_file: str) -> click.Command:
    from modal.cli.run import _add_click_options, _get_cli_runnable_signature, _get_signature, safe_get_type_hints

    module_name = ".".join(Path(app_file).with_suffix("").parts)  # app/modal_app.py -> app.modal_app
    module = importlib.import_module(module_name)
    # modal's LocalEntrypoint, or the emulator's: both keep the function as .info.raw_f
    entrypoints = [v for v in vars(module).values() if callable(getattr(getattr(v, "info", None), "raw_f", None))]
    if len(entrypoints) != 1:
        raise click.UsageError(f"{app_file} has {len(entrypoints)} local entrypoints; the emulator runs one")
    func = entrypoints[0].info.raw_f
    signature = _get_cli_runnable_signature(_get_signature(func), safe_get_type_hints(func))

    def body(**kwargs):
        func(**kwargs)

    return click.command(name=f"modal run {app_file}")(_add_click_options(body, signature.parameters))


def main() -> None:
    from cellfeed_testing.modal_emulator.client import install

    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m cellfeed_testing.modal_emulator.run APP.py [--flag VALUE ...]")
    install()
    command(sys.argv[1])(sys.argv[2:])


if __name__ == "__main__":
    main()
