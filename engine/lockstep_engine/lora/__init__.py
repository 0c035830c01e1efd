"""LoRA adapters on the model side: reading PEFT adapters (`adapters`), weight slots attached to a
loaded model (`model`) and the batched LoRA kernels (`ops`, `kernels`)."""
