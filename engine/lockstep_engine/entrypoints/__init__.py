"""Command-line entry points of the engine (`lockstep serve`, `generate`, `fetch`)."""
