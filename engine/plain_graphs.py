"""Plain decoding's epilogue as CUDA graphs: for every plain-decoding bucket (N requests x 1 row, each context
capacity) and sampling variant (engine/graph_sampling.py), one graph computes the N rows' logits and tokens
(argmax, or the sampler's draw at temperature > 0) from the forward graph's output. A decode step is then two
replays instead of the forward's replay plus the sampler's ~20-40 operator launches (a full-vocabulary sort for
top-p among them), which at small batches bound the step.

Invariants: the epilogue reads the forward graph's static output right after that graph's replay; its own
output (the tokens) is static, and every reader of it (the step's one copy to the host, the next step's input
ids when it is launched ahead) is enqueued before the bucket's next replay. Steps whose requests need more of
the sampler (logprobs, penalties, logit bias, min_tokens, grammars) run it after the forward's replay and say
why (StepStats.cuda_graph = "replay: forward only (<why>)").
"""
from __future__ import annotations

import logging

import torch

from engine import graph_sampling
from engine.cuda_graphs import collector_paused
from engine.graph_sampling import VARIANTS, GraphSampling
from engine.plan import ScheduledSeq
from engine.staging import Staging

logger = logging.getLogger("ddtree.engine")


class PlainGraphs:
    def __init__(self, graphs, model):
        """graphs: the engine's CudaGraphs (their buckets and forward outputs); emulated like them."""
        self.graphs, self.model = graphs, model
        self.sampling = GraphSampling(max(graphs.decode_sizes), graphs.device)
        self.keys = [b for b in graphs.buckets if b[1] == 1]
        self.epilogues: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (key, variant) -> graph, tokens
        self.pool = None
        self._told: set[str] = set()

    def plan(self, seqs: list[ScheduledSeq], key: tuple[int, int, int], fault_injection: bool = False
             ) -> tuple[str | None, str]:
        """(the variant, "") when this decode step, replayed in bucket `key`, can choose its tokens in a graph,
        else (None, why not)."""
        chosen, why = graph_sampling.variant(seqs, fault_injection)
        if chosen is not None and not self.graphs.emulate and (key, chosen) not in self.epilogues:
            chosen, why = None, f"batch {len(seqs)} has no sampling graph ({chosen})"
        if why and why not in self._told:
            self._told.add(why)
            logger.info("decode steps whose %s sample outside the CUDA graphs (counted in "
                        "engine_steps_total{mode=\"replay\"})", why)
        return chosen, why

    @torch.inference_mode()
    @collector_paused()
    def capture(self) -> None:
        """Every bucket's epilogue per variant, in one memory pool of their own."""
        for key in sorted(self.keys, key=lambda b: (-b[0], -b[2])):
            n = key[0]
            hidden = self.graphs.graphs[key].hidden[:n]
            self.sampling.params.zero_()
            for chosen in VARIANTS:
                self._epilogue(hidden, n, chosen)  # warm-up, eager
                torch.cuda.synchronize(self.graphs.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    tokens = self._epilogue(hidden, n, chosen)
                self.pool = graph.pool()
                self.epilogues[key, chosen] = (graph, tokens)
        torch.cuda.synchronize(self.graphs.device)
        logger.info("captured %d plain-decoding sampling graphs", len(self.epilogues))

    def run(self, seqs: list[ScheduledSeq], key: tuple[int, int, int], chosen: str, stage: Staging,
            hidden: torch.Tensor) -> torch.Tensor:
        """[len(seqs)] int64 tokens of a decode step whose forward graph (bucket `key`) just replayed (hidden: its
        rows, [len(seqs), hidden]); a view of a static buffer."""
        num = len(seqs)
        if chosen != graph_sampling.GREEDY:  # output index of the row: past the request's committed output
            self.sampling.stage(seqs, [s.request.num_output_tokens + s.num_ahead for s in seqs], stage)
        if self.graphs.emulate:
            return self._epilogue(hidden, num, chosen)
        graph, tokens = self.epilogues[key, chosen]
        graph.replay()
        return tokens[:num]

    def tokens(self, seqs: list[ScheduledSeq], key: tuple[int, int, int], stage: Staging, hidden: torch.Tensor,
               fault_injection: bool = False) -> torch.Tensor | None:
        """plan() then run(): the tokens of decoding rows whose forward graph (bucket `key`) replayed last, or None
        when they cannot be chosen in a graph."""
        chosen, _ = self.plan(seqs, key, fault_injection)
        return self.run(seqs, key, chosen, stage, hidden) if chosen is not None else None

    def _epilogue(self, hidden: torch.Tensor, n: int, chosen: str) -> torch.Tensor:
        logits = self.model.compute_logits(hidden, fp32=chosen != graph_sampling.GREEDY)
        return self.sampling.choose(logits, n, 1, None, chosen)
