"""PEFT LoRA adapters for SmolLM2 made on the spot, and transformers + peft as the reference for what a
request with one of them must produce (greedy, fp32 on the CPU). Shared by the engine's and the API's
LoRA tests; the adapters are random (seeded) and saved in PEFT's own layout."""

from __future__ import annotations

import os

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, rslora): one on every target, one small rslora adapter on three
ADAPTERS = {"every-layer": (8, 24, ALL_TARGETS, False), "attention-rs": (4, 6, ["q_proj", "v_proj", "down_proj"], True)}


class PeftReference:
    """SmolLM2 under transformers with the ADAPTERS (saved under `root`, one directory each)."""

    def __init__(self, root: str):
        import peft
        from transformers import AutoModelForCausalLM

        from lockstep_engine.sources import SMOLLM2_GGUF, fetch_smollm2

        path = fetch_smollm2()
        base = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=SMOLLM2_GGUF,
                                                    dtype=torch.float32)
        base.eval()
        torch.manual_seed(0)
        self.model = None
        self.dirs: dict[str, str] = {}
        for name, (rank, alpha, targets, rslora) in ADAPTERS.items():
            config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                     init_lora_weights=False)
            if self.model is None:
                self.model = peft.get_peft_model(base, config, adapter_name=name)
            else:
                self.model.add_adapter(name, config)
        with torch.no_grad():
            for key, param in self.model.named_parameters():
                if "lora_B" in key:  # not a no-op, and small enough to keep the text sane
                    param.copy_(torch.randn_like(param) * 0.05)
        for name in ADAPTERS:
            directory = os.path.join(root, name)
            self.model.save_pretrained(directory, selected_adapters=[name])
            # peft saves a non-default adapter under a folder of its name
            nested = os.path.join(directory, name)
            self.dirs[name] = nested if os.path.isdir(nested) else directory
        self._cache: dict = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], adapter: str | None, max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), adapter, max_new_tokens)
        if key not in self._cache:
            kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)
            if adapter is None:
                with self.model.disable_adapter():
                    out = self.model.generate(input_ids=torch.tensor([prompt]), **kwargs)
            else:
                self.model.set_adapter(adapter)
                out = self.model.generate(input_ids=torch.tensor([prompt]), **kwargs)
            self._cache[key] = out[0, len(prompt):].tolist()
        return self._cache[key]
