"""The engine: each step is schedule → propose → target forward → verify → commit. `LLM` is the
offline front door.

"Only commit mutates" means: the forward and the verifier return new values and touch no request,
and `commit` alone appends tokens, advances the committed length, finishes requests and hands the
step's hidden states to the proposer. Two other stages keep state of their own: the scheduler
admits, pages and preempts requests (their pages and status), and a proposer keeps per-request
drafting state in `propose` (a draft model's KV position, DSPARK's confidence forecast), which
`commit` and `release` settle."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

import torch
from tqdm import tqdm

from specserve import grammar, sampling
from specserve.config import EngineConfig, engine_config
from specserve.detokenizer import find_stop
from specserve.drafters import with_shipped_drafter_path
from specserve.grammar import GrammarCompiler
from specserve.kv_pages import KVPool, PageAllocator, log_pool, split_pages
from specserve.loader import LoadedCheckpoint, is_embedded, load_checkpoint
from specserve.loader.tokenizer import chat_token_ids
from specserve.models import ARCHITECTURES, DTYPES
from specserve.models.tensor_parallel import TensorParallelModel
from specserve.quantization import served_quantization
from specserve.radix_cache import RadixCache
from specserve.runner import ForwardOutput, ModelRunner
from specserve.scheduler import Scheduler
from specserve.speculative import TargetInfo, build_proposer
from specserve.speculative.verify import verify
from specserve.types import Proposal, Request, RequestOutput, SamplingParams, SpecStats, StepPlan, VerifyResult

log = logging.getLogger(__name__)


KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8, "float64": torch.float64}


def attention_dtype(kv_cache_dtype: str, quantization: str, dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype. auto: float16 under int8 weights (as llama.cpp's default f16 cache: half the bytes to
    stream, and the NLL of held-out answers moved by less than the run-to-run noise, benchmarks/quant_quality.py),
    else the compute dtype. int8: one scale per slot and KV head, a little over half float16's bytes (what
    long contexts stream each step). Float32, float16 and int8 pools attend in the row-invariant kernel
    (native/rows.cpp), so int8 rounding never sees bits that differ between a decode step and a verify window and
    speculation reproduces plain decoding; float64 pools take the padded-SDPA path."""
    if kv_cache_dtype == "auto":
        return torch.float16 if quantization == "int8" and dtype == torch.float32 else dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be auto, {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


class Engine:
    def __init__(self, config: EngineConfig, checkpoint: LoadedCheckpoint | None = None,
                 draft_checkpoint: LoadedCheckpoint | None = None) -> None:
        if config.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {config.dtype!r}: use one of {', '.join(DTYPES)}")
        if config.parallel.dp_size != 1:
            raise ValueError(f"--dp-size {config.parallel.dp_size}: an engine is one replica; `specserve serve` "
                             "runs replicas behind its HTTP front")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        dtype = DTYPES[config.dtype]
        ckpt = checkpoint or load_checkpoint(config.model_path, dtype)
        self.model_config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        quantization = served_quantization(config.quantization, ckpt)
        log.info("quantization: %s%s", quantization, "" if config.quantization else
                 f" (the default for {'quantized' if ckpt.quantized else 'unquantized'} weights)")
        if config.parallel.tp_size > 1:
            self.model = TensorParallelModel(ckpt, dtype, quantization, config.parallel, config.num_threads)
        else:
            self.model = ARCHITECTURES[ckpt.config.architecture](ckpt.config, ckpt.weights, dtype,
                                                                 quantization=quantization)

        cache = config.cache
        kv_dtype = attention_dtype(cache.kv_cache_dtype, quantization, dtype)
        start = time.perf_counter()
        self.model.warm_up(kv_dtype)
        log.info("warmed up the target (its first prefill and decode step) in %.1f s", time.perf_counter() - start)
        target = TargetInfo(self.model, ckpt.config, self.tokenizer, dtype, ckpt.source, cache.page_size, kv_dtype)
        spec = config.spec
        if is_embedded(ckpt.source):
            spec = with_shipped_drafter_path(spec)      # the embedded target's DSPARK drafter ships with it
        self.proposer = build_proposer(spec, target, draft_checkpoint)

        geometries = [self.model.kv_geometry(kv_dtype)]
        if self.proposer.kv_geometry is not None:
            geometries.append(self.proposer.kv_geometry)
        num_pages = cache.num_pages or split_pages(cache.memory_bytes, cache.page_size, geometries)
        self.allocator = PageAllocator(num_pages)
        self.pool = KVPool(geometries[0], num_pages, cache.page_size)
        log_pool("target", self.pool)
        self.draft_pool = KVPool(geometries[1], num_pages, cache.page_size) if len(geometries) > 1 else None
        if self.draft_pool is not None:
            log_pool("draft", self.draft_pool)
            self.proposer.attach_pool(self.draft_pool)
        self.runner = ModelRunner(self.model, self.pool, self.proposer.aux_layer_ids)

        self.max_model_len = min(config.scheduler.max_model_len or ckpt.config.max_position_embeddings,
                                 ckpt.config.max_position_embeddings, num_pages * cache.page_size)
        self.prefix_cache = None if cache.disable_radix_cache else RadixCache(self.allocator, cache.page_size)
        self.scheduler = Scheduler(config.scheduler, self.allocator, cache.page_size, self.max_model_len,
                                   self.proposer.draft_slots, self.prefix_cache)
        self.eos_token_ids = set(ckpt.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.generator = torch.Generator().manual_seed(config.seed)
        self._grammar_compiler: GrammarCompiler | None = None
        self.requests: dict[str, Request] = {}
        self.stats = SpecStats()
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None,
                    chat: bool = False) -> str:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt is empty: give at least one token of text")
            token_ids = self.encode(prompt, chat)
            text = prompt
        else:
            token_ids, text = list(prompt), None
            bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.model_config.vocab_size})")
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if bad := [t for t, _ in params.logit_bias if t >= self.model_config.vocab_size]:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, longer than the context allows "
                             f"({self.max_model_len} tokens including one new token): shorten the prompt")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not params.greedy and params.seed is None and self.config.spec.sampling == "coupled":
            # a seed of its own makes the request's tokens the same whatever is verified beside it
            params = dataclasses.replace(params, seed=int(torch.randint(1 << 62, (1,), generator=self.generator)))
        req = Request(request_id, token_ids, params, prompt=text, arrival_time=time.perf_counter())
        if params.grammar is not None:
            req.grammar_matcher = self.grammar_compiler().matcher(params.grammar)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def grammar_compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this checkpoint has none")
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                     self.eos_token_ids)
        return self._grammar_compiler

    def encode(self, prompt: str, chat: bool) -> list[int]:
        if chat:
            return chat_token_ids(self.tokenizer, [{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return None
        self._finish(req, "abort")
        return self.output(req)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (safe to call twice)."""
        if isinstance(self.model, TensorParallelModel):
            self.model.close()

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        for req in plan.preempted:
            self.proposer.release(req)
        proposal = self.proposer.propose(plan)
        proposal, allowed = grammar.constrain(plan, proposal, self.model_config.vocab_size)
        out = self.runner.forward(plan, proposal)
        result = verify(out.logits, plan, proposal, self.generator, allowed)
        return self.commit(plan, proposal, result, out)

    def commit(self, plan: StepPlan, proposal: Proposal, result: VerifyResult,
               out: ForwardOutput) -> list[RequestOutput]:
        outputs = []
        now = time.perf_counter()
        for i, (sched, drafts, res) in enumerate(zip(plan.scheduled, proposal.draft_tokens, result.per_request)):
            req = sched.request
            req.num_computed_tokens = sched.start + sched.num_feed
            if out.prompt_logits and out.prompt_logits[i] is not None:
                self._append_prompt_logprobs(req, *out.prompt_logits[i])
            if res is None:
                continue
            req.num_computed_tokens += res.num_accepted
            if req.first_token_time is None:
                req.first_token_time = now
            kept = self._append(req, res)
            if req.grammar_matcher is not None:
                self._advance_grammar(req, req.output_token_ids[len(req.output_token_ids) - kept:])
            req.stats.record(len(drafts), min(res.num_accepted, kept), kept)
            self.stats.record(len(drafts), min(res.num_accepted, kept), kept)
            outputs.append(self.output(req))
            if req.finished:
                self.requests.pop(req.request_id, None)
        self.proposer.commit(plan, result, out)
        for sched in plan.scheduled:
            # A finished prefill is cached at once, so requests running beside it share it too.
            req = sched.request
            if not req.finished and sched.samples and sched.start < len(req.prompt_token_ids):
                self._cache_prefix(req)
        return outputs

    def _append(self, req: Request, res) -> int:
        """Append emitted tokens one by one, stopping at EOS, a stop token or string, or a length limit."""
        p = req.params
        for i, token in enumerate(res.emitted):
            req.output_token_ids.append(token)
            if p.logprobs or p.top_logprobs:
                req.logprobs.append(res.logprobs[i])
                if p.top_logprobs:
                    req.top_logprobs.append(res.top_logprobs[i])
            new_text = req.text.extend(self.tokenizer, req.output_token_ids) if self.tokenizer else 0
            reason = None
            if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
                reason = "stop"
            elif p.stop and (cut := find_stop(p.stop, req.text.text, new_text)) is not None:
                req.stop_text_len = cut
                reason = "stop"
            elif len(req.output_token_ids) >= p.max_new_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                self._finish(req, reason)
                return i + 1
        return len(res.emitted)

    @staticmethod
    def _advance_grammar(req: Request, tokens: list[int]) -> None:
        for token in tokens:
            if req.grammar_matcher.is_terminated():
                break
            if not req.grammar_matcher.accept_token(token):
                raise RuntimeError(f"request {req.request_id} emitted token {token} that its grammar forbids")

    @staticmethod
    def _append_prompt_logprobs(req: Request, first: int, logits: torch.Tensor) -> None:
        """Raw logprobs of prompt tokens first + 1 .. first + len(logits) (the first token has none)."""
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)
            req.prompt_top_logprobs.append(None)
        tokens = torch.tensor(req.prompt_token_ids[first + 1:first + 1 + len(logits)])
        chosen, tops = sampling.logprobs(logits, tokens, req.params.top_logprobs)
        req.prompt_logprobs.extend(chosen)
        req.prompt_top_logprobs.extend(tops)

    def _cache_prefix(self, req: Request) -> None:
        """Insert the request's whole pages whose target KV and draft context are both written."""
        if self.prefix_cache is None or not req.pages:
            return
        valid = min(req.num_computed_tokens, self.proposer.context_length(req))
        num_pages = valid // self.pool.page_size
        self.prefix_cache.insert(req.all_token_ids[:num_pages * self.pool.page_size], req.pages[:num_pages])

    def _finish(self, req: Request, reason: str) -> None:
        if self.tokenizer:
            req.text.flush(self.tokenizer, req.output_token_ids)
        self._cache_prefix(req)
        self.scheduler.finish(req, reason)
        self.proposer.release(req)

    def output(self, req: Request) -> RequestOutput:
        text = req.text.text
        if req.stop_text_len is not None:
            text = text[:req.stop_text_len]
        p = req.params
        prompt_done = p.prompt_logprobs and len(req.prompt_logprobs) == len(req.prompt_token_ids)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids, text=text,
            token_ids=list(req.output_token_ids), finished=req.finished, finish_reason=req.finish_reason,
            logprobs=list(req.logprobs) if p.logprobs or p.top_logprobs else None,
            top_logprobs=list(req.top_logprobs) if p.top_logprobs else None,
            prompt_logprobs=list(req.prompt_logprobs) if prompt_done else None,
            prompt_top_logprobs=list(req.prompt_top_logprobs) if prompt_done else None,
            spec=req.stats.copy(), num_preemptions=req.num_preemptions, num_cached_tokens=req.num_cached_tokens,
            time_to_first_token=(req.first_token_time - req.arrival_time) if req.first_token_time else None)


class LLM:
    """Offline generation: `LLM(model_path=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model_path: str | None = None, checkpoint: LoadedCheckpoint | None = None,
                 draft_checkpoint: LoadedCheckpoint | None = None, **engine_args) -> None:
        self.engine = Engine(engine_config(model_path, **engine_args), checkpoint, draft_checkpoint)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any; `with LLM(...) as llm:` does it on leaving."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, chat: bool = False,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, param_list):
                ids.append(self.engine.add_request(prompt, sp, chat=chat))
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finals: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_unfinished:
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        bar.update(1)
        return [finals[i] for i in ids]
