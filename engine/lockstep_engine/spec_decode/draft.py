"""The draft model: a second, smaller model with its own KV cache over the target's block ids.

Its cache has the target's blocks and sink, so the scheduler's block table serves both and a prompt
the target computes is computed by the draft in the same forward's layout (`prefill`). Each step
proposes K tokens with K forwards: the first over the row's last two tokens (the one before the last
may have been the last of K accepted drafts, which the draft never ran), the others one token each.
"""

from __future__ import annotations

import torch

from lockstep_engine.attention import AttentionMetadata
from lockstep_engine.attention_backends import make_backend
from lockstep_engine.config import EngineConfig, SpeculativeConfig
from lockstep_engine.log import log
from lockstep_engine.models.llama import LlamaForCausalLM
from lockstep_engine.parallel import SINGLE
from lockstep_engine.sampler import Sampler, SamplingTensors
from lockstep_engine.sources import resolve
from lockstep_engine.spec_decode.meta import QueryLayout
from lockstep_engine.spec_decode.rejection import DRAFT_STREAM, draft_probs, sample_from


class DraftModel:
    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target_vocab_size: int, device: torch.device,
                 dtype: torch.dtype, num_blocks: int | None = None):
        """Loads the draft's weights; its KV cache comes with `num_blocks`, or later from `allocate_cache` (the
        target's runner sizes its own cache knowing what the draft's takes per block)."""
        seed = config.seed if spec.seed is None else spec.seed
        source = resolve(spec.model, seed=seed, download_dir=config.download_dir, revision=config.revision)
        mc = source.config
        if mc.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model={spec.model!r} has a vocabulary of {mc.vocab_size} tokens, "
                             f"the target model {config.model!r} one of {target_vocab_size}: a draft model must "
                             f"share the target's vocabulary")
        backend = make_backend(config.attention_backend, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
                               config.block_size, device)
        with torch.device(device):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                self.model = LlamaForCausalLM(mc, SINGLE, backend)
            finally:
                torch.set_default_dtype(previous)
        self.model.load_weights(source.iter_weights(device))
        self.block_size, self.dtype, self.device = config.block_size, dtype, device
        log(f"draft model {spec.model!r} loaded ({mc.num_parameters / 1e6:.0f}M parameters)")
        if num_blocks is not None:
            self.allocate_cache(num_blocks)

    def kv_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        return sum(2 * a.num_kv_heads * a.head_dim for a in layers) * self.block_size * \
            torch.finfo(self.dtype).bits // 8

    def allocate_cache(self, num_blocks: int) -> None:
        """Its own KV cache over the target's block ids (and sink)."""
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(num_blocks + 1, self.block_size, attn.num_kv_heads, attn.head_dim,
                                       dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros_like(attn.k_cache)
        log(f"draft model KV cache: {num_blocks} blocks ({num_blocks * self.kv_bytes_per_block() / 2**30:.2f} GiB)")

    @property
    def graph_safe(self) -> bool:
        """Whether its forwards can be captured in a CUDA graph (its attention backend's say)."""
        return getattr(self.model.attention_layers()[0].backend, "graph_safe", False)

    def attention_layers(self):
        return self.model.attention_layers()

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The draft's KV of the tokens a target forward computes (a window's first step)."""
        self.model(input_ids, positions, meta)

    def propose(self, layout: QueryLayout, previous: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                done: torch.Tensor, t: SamplingTensors, num_generated: torch.Tensor, k: int,
                max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K drafts per row from its last token `tokens` at `positions` ([rows]; `previous`: the token before).
        Returns drafts [rows, K] and the draft's distributions [rows, K, vocab] (None when every row is greedy)."""
        rows = tokens.shape[0]
        two = torch.stack(((positions - 1).clamp(min=0), positions), dim=1)
        ids = torch.stack((torch.where(positions > 0, previous, tokens), tokens), dim=1)
        hidden = self.model(ids.flatten(), layout.clamp(two).flatten(), layout.meta(two, done, max_seq_len))
        hidden = hidden.view(rows, 2, -1)[:, 1]
        drafts, dists = [], []
        for j in range(k):
            if j:
                at = (positions + j).unsqueeze(1)
                hidden = self.model(drafts[-1], layout.clamp(at).flatten(), layout.meta(at, done, max_seq_len + j))
            logits = Sampler.processed_logits(self.model.compute_logits(hidden).float(), t, num_generated + j)
            greedy = logits.argmax(dim=-1)
            if t.all_greedy:
                drafts.append(greedy)
                continue
            q = draft_probs(logits, t)
            sampled = sample_from(q, t.seeds, num_generated + j, DRAFT_STREAM)
            drafts.append(torch.where(t.temperature <= 0, greedy, sampled))
            dists.append(q)
        return torch.stack(drafts, dim=1), torch.stack(dists, dim=1) if dists else None
