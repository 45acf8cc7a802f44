"""Model presets: the transformer shapes a campaign can train. Torch-free (no import of the model
here), so the campaign config and the command lines read the one table the model builds from, on
a laptop without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    note: str  # for --help (parameters at a ~60k-gene vocabulary)


MODEL_PRESETS = {
    "tiny": Preset(64, 2, 4, 128, "4M parameters"),
    "scgpt": Preset(512, 12, 8, 512, "51M, as published"),  # scGPT's published shape
    "base": Preset(768, 12, 12, 3072, "133M"),
    "large": Preset(1024, 24, 16, 4096, "367M"),
}


def preset_shape(name: str) -> dict:
    """d_model, n_layers, n_heads, d_ff of a preset (ValueError naming the choices otherwise)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
    p = MODEL_PRESETS[name]
    return dict(d_model=p.d_model, n_layers=p.n_layers, n_heads=p.n_heads, d_ff=p.d_ff)
