"""The model runner of one rank: setup, the window loops and the device-to-host stream (docs/ARCHITECTURE.md)."""
