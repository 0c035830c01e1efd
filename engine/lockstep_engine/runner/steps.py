"""The step primitives of a window, written once: forward, sample, advance.

The eager loop, the CUDA-graph capture and the pipelined loop all run a decode step as
`decode_forward` (this stage's layers, then the samples on the last stage) followed by `take`
(every rank adopts the samples, then `advance` feeds them back on the device); `step` is the two
together. Step 1 of a window computes every row's scheduled tokens (prefill chunks and decodes
mixed) and samples for the rows that reached their target. Steps 2..N run those rows as a decode
batch whose inputs advance on the device: the token sampled at step k is the input of step k+1,
positions, sequence lengths and slots move with it, and a row that stops (EOS, stop token,
max_tokens, max_model_len) writes to the sink slot from then on.
"""

from __future__ import annotations

import torch

from lockstep_engine.attention import AttentionMetadata
from lockstep_engine.layers import fused_kernels_for
from lockstep_engine.parallel import ParallelState, broadcast_from_sampler, pp_isend, pp_recv, pp_send
from lockstep_engine.runner.host_stream import WindowTail
from lockstep_engine.runner.outputs import FINISH_LENGTH, FINISH_NONE, FINISH_STOP, PromptLogprobs
from lockstep_engine.runner.step_inputs import (BlockTables, SamplingCache, first_step_arrays, output_counts,
                                                prompt_logprob_rows, sampling_arrays, sampling_tensors, to_device)
from lockstep_engine.runner.window_state import DecodeState, FirstStep
from lockstep_engine.sampler import SampleOutput, Sampler, SamplingTensors


# Prompt positions per lm_head call: bounds the [positions, vocab] float32 logits of a long prompt to
# what the memory profile reserves for the sampling rows at the default max_num_seqs (256).
PROMPT_LOGITS_CHUNK = 256


class Steps:
    """One rank's step primitives over its model shard and KV cache (bound once the cache exists)."""

    def __init__(self, model, state: ParallelState, device: torch.device, dtype: torch.dtype, hidden_size: int,
                 vocab_size: int, eos_token_ids, block_size: int, num_blocks: int, max_model_len: int):
        self.model = model
        self.state = state
        self.device, self.dtype = device, dtype
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.block_size, self.num_blocks = block_size, num_blocks
        self.sink_slot = num_blocks * block_size  # the extra last block of every layer's cache
        self.max_model_len = max_model_len
        self.sampler = Sampler(fused_kernels_for)
        self.sampling_cache = SamplingCache(vocab_size, eos_token_ids)
        self.block_tables = BlockTables(num_blocks)

    # ---- forward and sample -----------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                sends: list | None = None):
        """This stage's layers; hidden states come from the previous stage and go to the next
        (asynchronously when `sends` collects the pending sends). Returns the final hidden states on
        the last stage, None elsewhere."""
        state = self.state
        hidden = None
        if not state.is_first_stage:
            hidden = pp_recv((input_ids.shape[0], self.hidden_size), self.dtype, self.device, state)
        hidden = self.model(input_ids, positions, meta, hidden)
        if not state.is_last_stage:
            if sends is None:
                pp_send(hidden, state)
            else:
                sends.append(pp_isend(hidden, state))
            return None
        return hidden

    def sample_local(self, hidden, t: SamplingTensors, num_generated, counts, guide, recent=None) -> SampleOutput:
        logits = self.model.compute_logits(hidden)  # the sampler upcasts where it needs float32
        return self.sampler(logits, t, num_generated, counts, guide.allowed_mask() if guide else None, recent)

    def sample_first(self, hidden, first: FirstStep, guide) -> SampleOutput | None:
        """Step 1's samples on the last stage (its sampling rows' last tokens); None elsewhere."""
        if hidden is None:
            return None
        return self.sample_local(hidden[first.sample_index], first.sampling, first.num_generated, first.counts,
                                 guide, first.recent)

    def prompt_logprobs(self, hidden, first: FirstStep) -> dict[int, PromptLogprobs]:
        """Logprobs of the prompt tokens step 1 predicts, for the rows that asked for them (on the last
        stage, whose `hidden` holds every token of the step): the logits of those positions only."""
        prompt, k = first.prompt, first.prompt.k
        parts = []
        for start in range(0, first.prompt_index.shape[0], PROMPT_LOGITS_CHUNK):
            index = first.prompt_index[start:start + PROMPT_LOGITS_CHUNK]
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[index]).float(), dim=-1)
            chosen = logprobs.gather(1, first.prompt_targets[start:start + PROMPT_LOGITS_CHUNK].unsqueeze(1))
            top_logprobs, top_ids = logprobs.topk(k, dim=-1)
            parts.append((chosen.squeeze(1), (logprobs > chosen).sum(dim=-1) + 1, top_ids, top_logprobs))
        chosen, ranks, top_ids, top_logprobs = (torch.cat(column).tolist() for column in zip(*parts))
        out, offset = {}, 0
        for row, position, count in prompt.rows:
            end = offset + count
            out[row] = PromptLogprobs(position, chosen[offset:end], ranks[offset:end], top_ids[offset:end],
                                      top_logprobs[offset:end])
            offset = end
        return out

    def share_samples(self, out: SampleOutput | None, t: SamplingTensors, rows: int) -> SampleOutput:
        """With pipeline stages the last stage's samples go to every rank (`out` is None elsewhere)."""
        if out is None:
            out = SampleOutput(tokens=torch.empty(rows, dtype=torch.int64, device=self.device))
            if t.num_logprobs >= 0:
                out.logprobs = torch.empty(rows, dtype=torch.float32, device=self.device)
                out.ranks = torch.empty(rows, dtype=torch.int64, device=self.device)
                if t.num_logprobs > 0:
                    out.top_logprobs = torch.empty(rows, t.num_logprobs, dtype=torch.float32, device=self.device)
                    out.top_ids = torch.empty(rows, t.num_logprobs, dtype=torch.int64, device=self.device)
        if self.state.pp_size > 1:
            tensors = [out.tokens] + ([out.logprobs, out.ranks] if out.logprobs is not None else []) + \
                ([out.top_logprobs, out.top_ids] if out.top_ids is not None else [])
            broadcast_from_sampler(tensors, self.state)
        return out

    # ---- a decode step ----------------------------------------------------------------------
    def decode_meta(self, state: DecodeState, max_seq_len: int) -> AttentionMetadata:
        bs = self.block_size
        # Done rows may point past their reservation: clamp, then send them to the sink.
        block_index = (state.positions // bs).clamp(max=state.table.shape[1] - 1)
        slot = state.table.gather(1, block_index.unsqueeze(1)).squeeze(1) * bs + state.positions % bs
        slot = torch.where(state.done, self.sink_slot, slot)
        return AttentionMetadata(slot_mapping=slot, block_tables=state.table, seq_lens=state.positions + 1,
                                 query_start_loc=None, max_seq_len=max_seq_len, lora_slots=state.lora_slots)

    def decode_forward(self, state: DecodeState, max_seq_len: int, guide, sends: list | None = None):
        """This stage's share of a decode step of every sampling row: the samples on the last stage,
        None elsewhere. Inputs come from the device."""
        hidden = self.forward(state.tokens, state.positions, self.decode_meta(state, max_seq_len), sends)
        if hidden is None:
            return None
        return self.sample_local(hidden, state.sampling, state.num_generated, state.counts, guide, state.recent)

    def take(self, state: DecodeState, out: SampleOutput | None) -> SampleOutput:
        """Every rank adopts a decode step's samples and feeds them back; returns them."""
        out = self.share_samples(out, state.sampling, state.tokens.shape[0])
        state.positions = state.positions + (~state.done).long()
        self.advance(state, out)
        return out

    def step(self, state: DecodeState, max_seq_len: int, guide) -> SampleOutput:
        """One decode step: forward, sample, advance."""
        return self.take(state, self.decode_forward(state, max_seq_len, guide))

    @staticmethod
    def advance(state: DecodeState, out) -> None:
        """Feeds a step's samples back: valid rows take the token, stops and limits end rows. The
        finish code says why a row's sequence ended (a stop token before its length limit)."""
        valid = ~state.done
        state.tokens = torch.where(valid, out.tokens, state.tokens)
        hit_stop = (state.sampling.stop_ids == state.tokens.unsqueeze(1)).any(dim=1) & valid
        state.steps_done = state.steps_done + valid.long()
        if state.counts is not None:
            state.counts.scatter_add_(1, state.tokens.unsqueeze(1), valid.float().unsqueeze(1))
        if state.recent is not None:  # the bad words' view of the outputs moves on by this step's token
            shifted = torch.cat((state.recent[:, 1:], state.tokens.unsqueeze(1)), dim=1)
            state.recent = torch.where(valid.unsqueeze(1), shifted, state.recent)
        state.num_generated = state.num_generated + valid.long()
        at_limit = (state.steps_done >= state.budget) & valid
        finish = torch.where(hit_stop, FINISH_STOP, torch.where(at_limit, FINISH_LENGTH, FINISH_NONE))
        state.emitted = torch.stack((torch.where(valid, state.tokens, -1), finish))
        state.done = state.done | hit_stop | (state.steps_done >= state.max_steps)

    # ---- a window's state -------------------------------------------------------------------
    def first_step(self, rows, tail: WindowTail | None = None) -> FirstStep:
        """Step 1 of a window: every row's scheduled tokens, flattened, and its sampling rows. A row whose
        last token is still on the device (the previous window's `tail`, not handed to the host yet) takes
        that token, and its done flag, from the device."""
        host = first_step_arrays(rows, self.block_size, self.num_blocks, self.block_tables)
        sample_sel = host["sample_sel"]
        sampling_rows = list(rows) if sample_sel.size == len(rows) else [rows[i] for i in sample_sel.tolist()]
        if "carry_sample" in host:
            if tail is None:
                raise RuntimeError("a row's last token is pending on the device, but no window tail carries it")
            host["carry_source"] = tail.source_rows([sampling_rows[i].seq for i in host["carry_sample"].tolist()])
        decode_only = host["input_ids"].size == len(rows)
        # A decode row predicts no prompt token: windows of sampling decode rows only look no further.
        prompt = None if decode_only and len(sampling_rows) == len(rows) else prompt_logprob_rows(
            rows, host["query_start"], host["sample_sel"])
        if prompt is not None:
            host |= prompt.arrays
        sampling = sampling_arrays(sampling_rows, self.sampling_cache) if sampling_rows else None
        views = to_device(host | sampling.arrays if sampling else host, self.device)
        vocab = self.vocab_size
        t = counts = None
        if sampling is not None:
            t = sampling_tensors(sampling, views, len(sampling_rows), vocab, self.device)
            if sampling.penalties:
                counts = output_counts(views, len(sampling_rows), vocab, self.device)
        initial_done = None
        if "carry_source" in views:
            # Device to device, queued behind the previous window's last step: no host sync.
            source = views["carry_source"]
            views["input_ids"].index_copy_(0, views["carry_token"], tail.tokens.index_select(0, source))
            initial_done = torch.zeros(len(sampling_rows), dtype=torch.bool, device=self.device)
            initial_done.index_copy_(0, views["carry_sample"], tail.done.index_select(0, source))
        seq_lens = host["seq_lens"]
        meta = AttentionMetadata(
            slot_mapping=views["slots"], block_tables=views["block_table"], seq_lens=views["seq_lens"],
            query_start_loc=None if decode_only else views["query_start"],
            query_start_loc_host=host["query_start"].tolist(), seq_lens_host=seq_lens.tolist(),
            max_seq_len=int(seq_lens.max()), lora_slots=views.get("lora_tokens"))
        return FirstStep(
            input_ids=views["input_ids"], positions=views["positions"], meta=meta, block_table=views["block_table"],
            seq_lens=views["seq_lens"], sample_index=views["sample_index"], sample_sel=views["sample_sel"],
            sampling_rows=sampling_rows, sampling=t, counts=counts, num_generated=views["num_generated"],
            max_steps=views["max_steps"], budget=views["budget"],
            max_dec_len=int(seq_lens[host["sample_sel"]].max(initial=0)),
            prompt=prompt, prompt_index=views.get("prompt_index"), prompt_targets=views.get("prompt_targets"),
            recent=views.get("recent"), initial_done=initial_done, lora_rows=views.get("lora_rows"))

    def decode_state(self, first: FirstStep, out: SampleOutput) -> DecodeState:
        """Device state of the decode steps after step 1, with step 1's samples fed back."""
        sel = first.sample_sel
        state = self._state(first, out.tokens, first.seq_lens[sel], first.block_table[sel])
        self.advance(state, out)
        return state

    def decode_window_state(self, first: FirstStep) -> DecodeState:
        """A window of decode rows only: its step 1 is a decode step from the rows' last tokens."""
        return self._state(first, first.input_ids, first.positions, first.block_table)

    def _state(self, first: FirstStep, tokens, positions, table) -> DecodeState:
        n = len(first.sampling_rows)
        done = first.initial_done if first.initial_done is not None else \
            torch.zeros(n, dtype=torch.bool, device=self.device)
        return DecodeState(
            tokens=tokens, positions=positions, table=table, done=done,
            steps_done=torch.zeros(n, dtype=torch.int64, device=self.device),
            max_steps=first.max_steps, budget=first.budget, num_generated=first.num_generated,
            sampling=first.sampling, counts=first.counts, recent=first.recent, lora_slots=first.lora_rows)
