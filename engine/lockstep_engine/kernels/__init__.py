"""GPU kernels (Triton). Importing this package imports triton; the torch backend never does."""
