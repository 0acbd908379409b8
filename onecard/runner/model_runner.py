"""The model runner (process B, torch): loads the model, sizes and owns the paged KV cache, runs steps.

Contract: ``ModelRunner(config)`` loads weights, and meanwhile boots the precompile's compile workers where
it applies (``compile_pool``; ``precompile()`` uses and closes them, runner/precompile.py);
``determine_num_blocks()`` sizes the KV pool (GPU: profile a forward at max_num_batched_tokens, then blocks =
(total × util − peak torch memory − non-torch memory) / bytes per block; ``kv_cache_memory_bytes`` or
``num_gpu_blocks`` override; CPU: ``Env.cpu_kv_cache_bytes``); ``initialize_kv_cache(num_blocks)``
allocates ``[num_blocks, block_size, kv_heads, head_dim]`` K and V per layer in the KV format
(``kv_format``, from --kv-cache-dtype: the serving dtype, or an fp8 dtype allocated as uint8 and viewed; bytes per
block from onecard/kv_dtype.py; an fp8_e4m3 cache without checkpoint scales logs a warning and uses 1.0); ``submit(SchedulerOutput) ->
PendingOutput`` queues one forward over the flattened batch and the sampling of each request's last position
when it ``samples``, and returns without waiting for the GPU; ``PendingOutput.result()`` is the step's only host
sync (its sampled ids). ``execute(sched)`` is ``submit(sched).result()``. A step may be submitted while the
previous one is in flight (async scheduling): a request's token that the previous step samples is read from
that step's sampled ids on the device (input ids, and the output counts of penalties).
Constrained requests (structured outputs) get their grammar's token bitmask applied to the logits before
sampling (runner/structured.py); a batch without one pays one attribute check per request. Under async
scheduling the mask waits for the step in flight's samples after this step's forward has been queued.
``initialize_host_tier()`` (with ``--kv-offloading-size``) allocates the host KV tier's memory after the KV cache
and returns its size in blocks (refused when the machine has less memory available); each step then first makes
the copies its SchedulerOutput lists (runner/kv_offload.py), before its forward.
A step with drafts (speculative decoding; synchronous loop only) computes logits at every verified position and
hands them to runner/spec_verify.py, which returns the accepted tokens. With --speculative-config the CUDA graphs
cover verify steps too (runner/cuda_graphs.py: each sequence padded to 1 + the step's longest draft; the hidden
rows of the real tokens come back in input order); steps with a prefill chunk run eagerly.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from onecard import kv_dtype
from onecard.config import ConfigError, EngineConfig, host_tier_blocks
from onecard.kernels import dispatch
from onecard.kernels.attention.metadata import AttentionMetadata
from onecard.runner.graph_shapes import graph_batch_sizes, verify_graph_shapes
from onecard.runner.input_batch import ModelInputs, build_inputs
from onecard.runner.sampler import Sampler, SamplingBatch, compute_logprobs
from onecard.runner.step_io import RunnerOutput, SchedulerOutput
from onecard.runner.step_output import PendingOutput
from onecard.runner.structured import GrammarMasker, apply_token_bitmask

logger = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_KV_DTYPES = {**_DTYPES, "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(slots=True)
class _RequestState:
    generator: torch.Generator | None


class ModelRunner:
    def __init__(self, config: EngineConfig):
        from onecard.models.loader import load_model
        from onecard.runner.precompile import start_workers

        self.config = config
        self.device = torch.device(config.device)
        # the card's name (the speculative-decoding cost model reads it); None off a GPU
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.dtype = _DTYPES[config.model.dtype]
        dispatch.set_default_backend(config.env.kernel_backend, config.env.triton_interpret)
        if self.device.type == "cuda":                                    # (PDL is never used off a GPU)
            from onecard.kernels.triton_common import set_pdl

            set_pdl(config.env.pdl_max_tokens)
            paths = dispatch.init_paths(self.device)                      # grouped-GEMM probe, capability
            if paths.get("emulated"):
                logger.warning("ONECARD_EMULATE_CC: every kernel-path decision takes sm%s's branch on this sm%s "
                               "card (tests and benchmarks only)", paths["capability"], paths["real_capability"])
            logger.info("kernel paths: %s", paths)
        torch.manual_seed(config.model.seed)
        t0 = time.perf_counter()
        # the precompile's workers boot (seconds of imports) while the weights load; precompile() closes them
        self.compile_pool = start_workers(self.device, config.env)
        try:
            self.model = load_model(config.model, self.device, self.dtype)
        except BaseException:
            if self.compile_pool is not None:
                self.compile_pool.close()
            raise
        # derived weights of the batch-1 paths (the folded routers), before the memory profile counts them
        folds = self.model.build_router_folds(self.device)
        if folds:
            logger.info("batch-1 folded routers: %.1f MiB (paths.BATCH1_ROUTER_FOLD)", folds / 2**20)
        self.load_seconds = time.perf_counter() - t0
        self.weights_bytes = int(getattr(self.model, "weights_bytes", 0))
        self.block_size = config.cache.block_size
        self.num_layers = config.model.num_layers
        self.num_kv_heads = config.model.num_kv_heads
        self.head_dim = config.model.head_dim
        self.kv_format = kv_dtype.resolve(config.cache.kv_cache_dtype, config.model.dtype)
        self.kv_torch_dtype = _KV_DTYPES[self.kv_format]
        self._check_kv_scales()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.sampler = Sampler(config.model.seed, self.device)
        self.states: dict[str, _RequestState] = {}
        self.block_tables: dict[str, np.ndarray] = {}
        # the last submitted step's sampled ids [S] (on the device) and each sampled request's row in them
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[str, int] | None = None
        self._last_pending: PendingOutput | None = None
        self.vocab_size = int(config.model.hf_config["vocab_size"])
        self.graphs = None  # CUDAGraphRunner, set by capture_graphs()
        self.precompile_summary: dict | None = None
        # structured outputs: the vocabulary view is built in the background when serving on a GPU (~1 s for a
        # 152k vocabulary), at the first constrained request otherwise
        self.grammar = GrammarMasker(config.model.tokenizer, self.vocab_size, list(config.model.eos_token_ids),
                                     config.scheduler.max_num_seqs, self.device, eager=self.device.type == "cuda")
        self.host_pool = None  # HostKVPool, set by initialize_host_tier()

    def _check_kv_scales(self) -> None:
        """fp8_e4m3 needs scales to use its range; vLLM warns and uses 1.0 where the checkpoint has none."""
        attns = [layer.self_attn for layer in getattr(self.model, "layers", [])]
        if not kv_dtype.is_fp8(self.kv_format):
            for a in attns:                      # a native cache takes no scale: none may leak into the kernels
                a.k_scale = a.v_scale = 1.0
            return
        missing = sum(1 for a in attns if a.kv_scales_from_checkpoint != {"k", "v"})
        if missing and self.kv_format == "fp8_e4m3":
            logger.warning("Using KV cache scaling factor 1.0 for fp8_e4m3 in %d of %d layers: the checkpoint has "
                           "no k_scale / v_scale for them. If this is unintended, verify that the checkpoint "
                           "provides k/v scaling factors.", missing, len(attns))

    # ------------------------------------------------------------------ KV sizing
    @property
    def kv_bytes_per_token(self) -> int:
        return kv_dtype.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_format)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks:
            num = cache.num_gpu_blocks
        elif cache.kv_cache_memory_bytes:
            num = cache.kv_cache_memory_bytes // self.block_bytes
        elif self.device.type == "cuda":
            num = self._profile_num_blocks()
        else:
            num = self.config.env.cpu_kv_cache_bytes // self.block_bytes
        max_len = self.config.scheduler.max_model_len
        usable = max(0, num - 1) * self.block_size          # block 0 is the scheduler's null block
        if usable < max_len:
            raise ConfigError(
                f"--max-model-len={max_len} does not fit: the KV cache holds {usable} tokens "
                f"({num} blocks of {self.block_size}, one reserved). The largest max_model_len that fits is "
                f"{usable}; lower --max-model-len, or raise --gpu-memory-utilization / "
                "--kv-cache-memory-bytes.")
        return int(num)

    def _profile_num_blocks(self) -> int:
        sched = self.config.scheduler
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free0, total = torch.cuda.mem_get_info()
        tokens = sched.max_num_batched_tokens
        seqs = max(1, min(sched.max_num_seqs, tokens))
        tmp_blocks = (tokens + self.block_size - 1) // self.block_size + seqs
        self.initialize_kv_cache(tmp_blocks, log=False)
        tmp_bytes = tmp_blocks * self.block_bytes
        self.profile_forward(tokens, seqs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - tmp_bytes
        self.kv_caches = []
        torch.cuda.empty_cache()
        free1, _ = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        non_torch = max(0, (total - free1) - reserved - (total - free0 - torch.cuda.memory_reserved()))
        reserve = self._attention_reserve()
        budget = total * self.config.cache.gpu_memory_utilization - peak - non_torch - reserve
        budget = min(budget, free1 - (256 << 20))
        logger.info("memory profile: total %.2f GiB, peak torch %.2f GiB, non-torch %.2f GiB, prefill attention "
                    "reserve %.2f GiB, KV budget %.2f GiB", total / 2**30, peak / 2**30, non_torch / 2**30,
                    reserve / 2**30, budget / 2**30)
        return max(0, int(budget // self.block_bytes))

    def _attention_reserve(self) -> int:
        """Bytes the prefill attention on SDPA (below sm80: paths.prefill_sdpa) may hold beyond what the profile's
        short sequences showed: a max_model_len sequence's gathered K and V and a full chunk's output copies
        (paths.prefill_sdpa_workspace); 0 where the Triton kernel takes every chunk."""
        from onecard.kernels import paths
        from onecard.kernels.attention import sdpa

        if (dispatch.backend_for(self.device) != "triton"
                or not paths.prefill_sdpa_on(paths.capability(self.device))
                or not sdpa.available(self.device, self.head_dim)):
            return 0
        sched = self.config.scheduler
        hq = int(self.config.model.hf_config["num_attention_heads"])
        return paths.prefill_sdpa_workspace(sched.max_model_len, sched.max_num_batched_tokens, hq, self.num_kv_heads,
                                            self.head_dim, self.dtype.itemsize, self.kv_torch_dtype.itemsize)

    @torch.inference_mode()
    def profile_forward(self, tokens: int, seqs: int, layer_ids: list[int] | None = None) -> None:
        """The memory profile's step: ``tokens`` prefill tokens over ``seqs`` sequences through the model (over
        ``layer_ids`` only, if given: the precompile's dry run), then logits for max_num_seqs rows."""
        per = tokens // seqs
        lens = [per] * seqs
        lens[-1] += tokens - per * seqs
        bs = self.block_size
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
        blocks_per = [(n + bs - 1) // bs for n in lens]
        table = torch.zeros(seqs, max(blocks_per), dtype=torch.int32, device=self.device)
        slot = []
        nxt = 0
        for i, n in enumerate(lens):
            table[i, :blocks_per[i]] = torch.arange(nxt, nxt + blocks_per[i], dtype=torch.int32)
            slot.append(torch.arange(n, device=self.device) + nxt * bs)
            nxt += blocks_per[i]
        cu_host = np.zeros(seqs + 1, dtype=np.int32)
        np.cumsum(lens, out=cu_host[1:])
        cu = torch.from_numpy(cu_host).to(self.device)
        md = AttentionMetadata(
            slot_mapping=torch.cat(slot).long(), query_start_loc=cu,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device), block_table=table,
            max_query_len=max(lens), max_seq_len=max(lens), host_query_start_loc=cu_host,
            host_seq_lens=np.asarray(lens, dtype=np.int32))
        hidden = self.model(ids, pos, self.kv_caches, md, layer_ids)
        last = hidden[cu[1:].long() - 1]
        logits = self.model.compute_logits(last.repeat((self.config.scheduler.max_num_seqs + seqs - 1) // seqs, 1))
        torch.softmax(logits, dim=-1)

    def initialize_kv_cache(self, num_blocks: int, log: bool = True) -> None:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        dt = self.kv_torch_dtype
        # fp8: allocated as bytes (a plain zero fill on every card) and viewed as the fp8 dtype
        alloc = torch.uint8 if kv_dtype.is_fp8(self.kv_format) else dt

        def one() -> torch.Tensor:
            return torch.zeros(shape, dtype=alloc, device=self.device).view(dt)

        self.kv_caches = [(one(), one()) for _ in range(self.num_layers)]
        self.num_blocks = num_blocks
        if log:
            logger.info("KV cache: %s, %d B/token; %d blocks x %d tokens = %d tokens, %.2f GiB", self.kv_format,
                        self.kv_bytes_per_token, num_blocks, self.block_size, num_blocks * self.block_size,
                        num_blocks * self.block_bytes / 2**30)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def initialize_host_tier(self) -> int:
        """Allocate the host KV tier (``--kv-offloading-size`` GiB, after ``initialize_kv_cache``); its blocks."""
        from onecard.hardware import host_memory, host_tier_refusal
        from onecard.runner.kv_offload import HostKVPool

        size = self.config.cache.kv_offloading_size
        if not size:
            return 0
        num_slots = host_tier_blocks(size, self.block_bytes)
        if num_slots < 1:
            raise ConfigError(f"--kv-offloading-size={size} GiB holds no KV block ({self.block_bytes} bytes "
                              "each); give it more.")
        why = host_tier_refusal(num_slots * self.block_bytes, host_memory())
        if why is not None:
            raise ConfigError(why)
        self.host_pool = HostKVPool(self.kv_caches, num_slots, self.device)
        return num_slots

    # ------------------------------------------------------------------ one step
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.submit(sched, async_copy=False).result()

    @torch.inference_mode()
    def submit(self, sched: SchedulerOutput, async_copy: bool = True) -> PendingOutput:
        for rid in sched.finished_request_ids:
            self.states.pop(rid, None)
            self.block_tables.pop(rid, None)
            self.grammar.drop(rid)
        for rid in sched.preempted_request_ids:
            self.block_tables.pop(rid, None)
        if self.host_pool is not None:
            self.host_pool.transfer(sched.kv_to_host, sched.kv_from_host, sched.kv_transfer_wait)
        if sched.is_empty:
            return PendingOutput.ready(RunnerOutput(sampled_token_ids={}))
        inputs = build_inputs(sched, self.block_size, self.block_tables, self._last_rows)
        if inputs.logits_per_sample is not None:
            for s in sched.scheduled:       # the scheduler trims rejected drafts' blocks: rebuild these tables
                if s.draft_token_ids:
                    self.block_tables.pop(s.request.request_id, None)
        hidden = self._forward(inputs)
        if not inputs.sample_rows:
            self._last_tokens = self._last_rows = self._last_pending = None
            return PendingOutput.ready(RunnerOutput(sampled_token_ids={}))
        if (inputs.num_decode_tokens == len(inputs.sample_rows) == hidden.shape[0]
                or inputs.logits_indices.shape[0] == hidden.shape[0]):
            last = hidden                                                     # every row samples, in order
        else:
            last = hidden[torch.from_numpy(inputs.logits_indices).to(self.device, non_blocking=True)]
        logits = self.model.compute_logits(last)                              # [S, V] fp32
        if inputs.logits_per_sample is not None:                              # speculative decoding
            from onecard.runner.spec_verify import verify

            self._last_tokens = self._last_rows = self._last_pending = None
            scheduled = [sched.scheduled[i] for i in inputs.sample_rows]
            return PendingOutput.ready(verify(self, scheduled, inputs.logits_per_sample, logits))
        reqs = [sched.scheduled[i].request for i in inputs.sample_rows]
        want = [r.sampling_params.logprobs for r in reqs]
        max_n = max((n for n in want if n is not None), default=None)
        raw_logits = logits
        errors = None
        if any(r.sampling_params.structured_outputs is not None for r in reqs):
            masked = self.grammar.masks(reqs, self._pending_token)
            if masked is not None:
                if max_n is not None:
                    logits = logits.clone()                  # logprobs stay the model's raw ones (vLLM)
                apply_token_bitmask(logits, *masked)
            errors = self.grammar.take_errors() or None
        batch = self.sampling_batch(reqs, logits.shape[-1])
        result = self.sampler.sample(logits, batch)
        lp = compute_logprobs(raw_logits, result.token_ids, max_n) if max_n is not None else None
        ids = [r.request_id for r in reqs]
        self._last_tokens = result.token_ids
        self._last_rows = {rid: i for i, rid in enumerate(ids)}
        self._last_pending = PendingOutput(ids, result.token_ids, lp, want, async_copy, errors)
        return self._last_pending

    def _pending_token(self, request_id: str) -> int | None:
        """The token the step in flight samples for a request (waits for that step's ids only)."""
        if self._last_pending is None:
            return None
        return self._last_pending.result().sampled_token_ids.get(request_id)

    def _fill_placeholders(self, input_ids: torch.Tensor, inputs: ModelInputs) -> None:
        """Write the previous step's sampled ids into the rows that compute them (on the device, no sync)."""
        rows, src = inputs.placeholder_rows, inputs.placeholder_src
        last = self._last_tokens
        k = len(rows)
        if rows == src and rows[-1] == k - 1:                   # the steady decode batch: rows 0..k-1 in order
            input_ids[:k].copy_(last[:k])
        else:
            idx = torch.tensor([rows, src], dtype=torch.long).to(self.device, non_blocking=True)   # [2, P]
            input_ids.index_copy_(0, idx[0], last.index_select(0, idx[1]))

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        fill = self._fill_placeholders if inputs.placeholder_rows else None
        if self.graphs is not None:
            hidden = self.graphs.try_run(inputs, fill)
            if hidden is not None:
                return hidden
        dev = self.device

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        md = AttentionMetadata(
            slot_mapping=t(inputs.slot_mapping), query_start_loc=t(inputs.query_start_loc),
            seq_lens=t(inputs.seq_lens), block_table=t(inputs.block_table),
            max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len,
            num_decode_tokens=inputs.num_decode_tokens, host_query_start_loc=inputs.query_start_loc,
            host_seq_lens=inputs.seq_lens)
        input_ids = t(inputs.input_ids)
        if fill is not None:
            fill(input_ids, inputs)
        return self.model(input_ids, t(inputs.positions), self.kv_caches, md)

    def sampling_batch(self, reqs, vocab: int, extra: list[list[int]] | None = None) -> SamplingBatch:
        """One row per entry of ``reqs``; ``extra[i]``: output tokens row i sees beyond the request's own (the
        drafts before a verified position: penalties and min_tokens count them)."""
        dev = self.device
        sps = [r.sampling_params for r in reqs]
        temps = [sp.temperature for sp in sps]
        all_greedy = all(t < 1e-5 for t in temps)
        gens: list[torch.Generator | None] = []
        for r in reqs:
            if all_greedy and r.sampling_params.seed is None:
                gens.append(None)
                continue
            st = self.states.get(r.request_id)
            if st is None:
                gen = None
                if r.sampling_params.seed is not None:
                    gen = torch.Generator(device=dev)
                    gen.manual_seed(r.sampling_params.seed)
                st = self.states[r.request_id] = _RequestState(generator=gen)
            gens.append(st.generator)
        if all_greedy:
            # greedy rows need only the argmax: no per-step parameter tensors (and no host->device copies)
            b = SamplingBatch(temperature=None, top_p=None, top_k=None, min_p=None, all_greedy=True,
                              any_top_p_k=False, any_min_p=False, generators=gens)
        else:
            f = torch.tensor([temps, [sp.top_p for sp in sps], [sp.min_p for sp in sps]],
                             dtype=torch.float32).to(dev, non_blocking=True)          # [3, B], one copy
            b = SamplingBatch(
                temperature=f[0], top_p=f[1], min_p=f[2],
                top_k=torch.tensor([sp.top_k for sp in sps], dtype=torch.int64).to(dev, non_blocking=True),
                all_greedy=False, any_top_p_k=any(sp.top_p < 1.0 or sp.top_k > 0 for sp in sps),
                any_min_p=any(sp.min_p > 0 for sp in sps), generators=gens)
        banned = []
        for i, (r, sp) in enumerate(zip(reqs, sps)):
            # outputs so far: the known ones plus any the step in flight samples (placeholders beyond this one)
            ahead = len(extra[i]) if extra is not None else 0
            if r.num_output_tokens + max(r.num_output_placeholders - 1, 0) + ahead < sp.min_tokens:
                ids = set(sp.stop_token_ids or [])
                if not sp.ignore_eos:
                    ids |= set(r.eos_token_ids)
                banned.append(sorted(i for i in ids if 0 <= i < vocab))
            else:
                banned.append([])
        if any(banned):
            b.banned = banned
        if any(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0 for sp in sps):
            n = len(reqs)
            counts = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
            seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
            for i, r in enumerate(reqs):
                out_list = r.output_token_ids + extra[i] if extra is not None and extra[i] else r.output_token_ids
                if out_list:
                    out_ids = torch.tensor(out_list, dtype=torch.long, device=dev)
                    counts[i].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
                    seen[i, out_ids] = True
                seen[i, torch.tensor(r.prompt_token_ids, dtype=torch.long, device=dev)] = True
            b.presence = torch.tensor([sp.presence_penalty for sp in sps], dtype=torch.float32, device=dev)
            b.frequency = torch.tensor([sp.frequency_penalty for sp in sps], dtype=torch.float32, device=dev)
            b.repetition = torch.tensor([sp.repetition_penalty for sp in sps], dtype=torch.float32, device=dev)
            pend = [(i, self._last_rows[r.request_id]) for i, r in enumerate(reqs) if r.num_output_placeholders > 1]
            if pend:                                      # the previous step's sample, not yet on the host
                rows_src = torch.tensor(pend, dtype=torch.long).to(dev, non_blocking=True).T     # [2, P]
                toks = self._last_tokens.index_select(0, rows_src[1])
                counts.index_put_((rows_src[0], toks), torch.ones_like(toks, dtype=torch.float32), accumulate=True)
                seen[rows_src[0], toks] = True
            b.output_counts, b.seen_mask = counts, seen
        return b

    # ------------------------------------------------------------------ CUDA graphs
    def graph_batch_sizes(self) -> list[int]:
        return graph_batch_sizes(self.config.scheduler.max_num_seqs)

    def verify_graph_shapes(self) -> list[tuple[int, int]]:
        """(b, q) verify graphs: captured with --speculative-config (runner/graph_shapes.py)."""
        spec = self.config.speculative
        if spec is None:
            return []
        return verify_graph_shapes(self.graph_batch_sizes(), spec.num_speculative_tokens)

    def precompile(self) -> dict | None:
        """Compile every kernel variant start-up and serving launch, in parallel (runner/precompile.py)."""
        from onecard.runner.precompile import precompile

        self.precompile_summary = precompile(self)
        return self.precompile_summary

    def graph_runner(self):
        """A CUDAGraphRunner over this runner's model and KV cache (not captured yet; off CUDA its "graphs" run
        eagerly in the same padded layouts: tests)."""
        from onecard.runner.cuda_graphs import CUDAGraphRunner

        max_blocks = (self.config.scheduler.max_model_len + self.block_size - 1) // self.block_size
        return CUDAGraphRunner(self.model, self.kv_caches, self.graph_batch_sizes(), max_blocks,
                               self.config.scheduler.max_model_len, self.device,
                               steps_in_flight=self.config.scheduler.async_scheduling,
                               verify_shapes=self.verify_graph_shapes())

    def capture_graphs(self) -> None:
        self.graphs = self.graph_runner()
        self.graphs.capture()
