"""Contracts shared by producers and trainers: queue/map interfaces, the item wire format,
epoch plans and routing. Nothing here imports Lance or Polars."""
