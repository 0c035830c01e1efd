"""Where an engine's ranks run: the `Executor` the engine core drives, and the engine group behind it
(rendezvous, window-plan broadcast, the worker loop). See docs/ARCHITECTURE.md."""
