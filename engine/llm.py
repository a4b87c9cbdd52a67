"""Offline API for tests, benchmarks and scripts:
`LLM(model=None, dtype=..., device=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

from engine.config import EngineConfig, SpecConfig
from engine.core import EngineCore
from engine.messages import Delta
from engine.request import SamplingParams


def encode_text(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of a text prompt: as one user turn of the chat template (chat=True), else the plain text."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass token-id lists instead of text")
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list | None = None
    stats: dict = field(default_factory=dict)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class LLM:
    def __init__(self, model: str | None = None, dtype: str | None = None, device: str = "cpu",
                 drafter="none", spec_budget: int = 16, draft_model: str | None = None, chain: bool = False,
                 adaptive: bool = True, spec_guard: bool = True, config: EngineConfig | None = None,
                 **engine_kwargs):
        """drafter: none | ngram | dflash | oracle, or a drafter object (engine.speculative.drafter.Drafter).
        `config` (a whole EngineConfig) replaces the other settings; a drafter object still applies."""
        drafter_obj = None if isinstance(drafter, str) else drafter
        if config is None:
            name = drafter if drafter_obj is None else "oracle"
            spec = SpecConfig(drafter=name, budget=spec_budget, draft_model=draft_model, chain=chain,
                              adaptive=adaptive, guard=spec_guard)
            config = EngineConfig(model=model, dtype=dtype, device=device, spec=spec, **engine_kwargs)
        self.config = config
        self.engine = EngineCore(self.config, drafter=drafter_obj)
        self.tokenizer = self.engine.tokenizer
        # tensor parallel: the other ranks stop when this object goes (or at exit) even without shutdown()
        self._stop = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stops the engine's other tensor-parallel ranks (a no-op for one rank)."""
        self._stop()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        return encode_text(self.tokenizer, prompt, chat)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (temperature, top_p, ...)."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False) -> list[GenerationOutput]:
        """prompts: a string, a list of strings, a list of token ids, or a list of token-id lists. sampling: one
        SamplingParams for every prompt or a list of one per prompt; without it, the checkpoint's
        generation_config.json defaults apply."""
        sampling = sampling or self.default_sampling_params()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [p if isinstance(p, list) else self.encode(p, chat) for p in prompts]
        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(token_lists)
        if len(per_prompt) != len(token_lists):
            raise ValueError(f"{len(per_prompt)} sampling parameters for {len(token_lists)} prompts")
        ids = [self.engine.add_request(t, SamplingParams(**vars(sp))) for t, sp in zip(token_lists, per_prompt)]
        tokens = {rid: [] for rid in ids}
        texts = {rid: [] for rid in ids}
        logprobs = {rid: [] for rid in ids}
        done: dict[str, Delta] = {}
        start = time.perf_counter()
        steps = 0
        while len(done) < len(ids):
            for delta in self.engine.step():
                tokens[delta.request_id].extend(delta.new_token_ids)
                texts[delta.request_id].append(delta.text)
                logprobs[delta.request_id].extend(delta.new_logprobs or [])
                if delta.finished:
                    done[delta.request_id] = delta
            for error in self.engine.pop_request_errors():
                raise RuntimeError(f"request {error.request_id} failed: {error.message}")
            steps += 1
        elapsed = time.perf_counter() - start
        results = []
        for rid, prompt_ids, sp in zip(ids, token_lists, per_prompt):
            detokenized = sp.detokenize and self.tokenizer is not None
            out = done[rid]
            stats = {"elapsed_s": elapsed, "steps": steps}
            if out.accept_lengths:
                stats["spec"] = spec_summary(out.accept_lengths)
            results.append(GenerationOutput(prompt_ids, tokens[rid], "".join(texts[rid]) if detokenized else None,
                                            out.finish_reason, logprobs[rid] if sp.logprobs is not None else None,
                                            stats, out.stop_reason))
        return results


def spec_summary(accept_lengths: list[int]) -> dict:
    """Steps, mean accept length tau (tokens per verify step, bonus included) and per-depth acceptance counts."""
    depth_counts = [0] * (max(accept_lengths) - 1 if accept_lengths else 0)
    for n in accept_lengths:
        for d in range(n - 1):
            depth_counts[d] += 1
    return {"steps": len(accept_lengths), "mean_accept_length": sum(accept_lengths) / len(accept_lengths),
            "accepted_per_depth": depth_counts}
