"""The model runner's admission steps: prompt chunks beside decoding requests, launched as CUDA-graph replays
(engine/admission.py: the prompt chunks as pieces of the prompt buckets, or every prompt token as a one-row
request with --admission-decode-rows), then the decoding rows' own graph, and sampled as one step. A mixin of
engine.runner.ModelRunner: these methods use the runner's graphs, staging and _run, and the runner calls
_launch_admission for a step of several shapes and _prompt_forward / _run_beside for one launched ahead."""
from __future__ import annotations

import torch

from engine.admission import Piece, plan_replays, row_layout
from engine.inputs import StepInputs, first_position, prepare_inputs
from engine.pending import PendingStep
from engine.plan import ScheduledSeq
from engine.speculative.speculator import TreeBatch


class AdmissionSteps:
    def _launch_admission(self, plain: list[ScheduledSeq], batch: TreeBatch | None, watched: tuple | None,
                          ahead_ids: torch.Tensor | None, t1: float, round_why: str | None) -> PendingStep | str:
        """A step of prompt chunks beside decoding requests (all plain, or all trees) as graph replays: the chunks'
        pieces (engine/admission.py), then the decoding rows' own graph; its plain rows are the chunks' then the
        decoders'. ahead_ids: scheduled ahead, the decoders' tokens (the requests scheduled ahead, in order). Why
        not, when it cannot."""
        decoding = [(s.num_ahead > 0) if ahead_ids is not None else s.decodes for s in plain]
        prompts = [s for s, d in zip(plain, decoding) if not d]
        decoders = [s for s, d in zip(plain, decoding) if d]
        if decoders and batch is not None:
            return "mixed step"
        if decoders and self.graphs.row_sizes and not self._dense_routed(prompts):  # (trees: "mixed step" above)
            step = self._admission_rows(prompts, decoders, watched, ahead_ids, t1, round_why)
            if not isinstance(step, str):
                return step  # (else its prompt chunks replay as pieces)
        replays = self._replays(prompts)
        if isinstance(replays, str):
            return replays
        if batch is not None and self.graphs.bucket(batch.num_requests, batch.width) is None:
            return f"no graph for {batch.num_requests}x{batch.width}"
        if decoders and self.graphs.bucket(len(decoders), 1, max(first_position(s) + 1 for s in decoders)) is None:
            return f"no graph for {len(decoders)}x1"
        tree_inputs = prepare_inputs([], batch, self.block_size, self.device, self.staging) if batch else None
        first = self._prompt_forward(prompts, replays)
        rest = None  # the decoding rows' replay last: its outputs are the graph's own buffers, read at once
        if batch is not None:
            rest = self.graphs.run(tree_inputs.input_ids, tree_inputs.meta, batch.num_requests, batch.width)
        elif decoders:
            rest = self.graphs.replay_rows(self._decode_in_graph(decoders, ahead_ids).graph_key, len(decoders))
        return self._run_beside(prompts, decoders, batch, watched, first, rest, tree_inputs, t1, round_why)

    def _admission_rows(self, prompts: list[ScheduledSeq], decoders: list[ScheduledSeq], watched: tuple | None,
                        ahead_ids: torch.Tensor | None, t1: float, round_why: str | None) -> PendingStep | str:
        """An admission step as one plain-decoding replay of one-row requests (Admissions.run_rows), or why not."""
        done = self.admissions.run_rows(prompts, decoders, ahead_ids, self.staging, self.plain_graphs,
                                        self.sampler.fault_seed is not None)
        if isinstance(done, str):
            return done
        hidden, layers, tokens = done
        inputs = StepInputs(None, None, *row_layout(prompts + decoders), None)
        return self._run(prompts + decoders, None, watched, inputs, t1, round_why,
                         forward=(hidden, layers, "replay: admission rows"), tokens=tokens)

    def _replays(self, prompts: list[ScheduledSeq]) -> list[Piece] | str:
        """The prompt buckets' replays that compute these chunks (engine/admission.py), or why not."""
        if self._dense_routed(prompts):
            return "prompt chunks for dense prefill"
        return plan_replays(prompts, self.graphs)

    def _dense_routed(self, prompts: list[ScheduledSeq]) -> bool:
        """--dense-prefill-min-tokens routes some of these chunks (an eager step)."""
        return bool(self.dense_prefill_min_tokens) and any(s.num_new_tokens >= self.dense_prefill_min_tokens
                                                           for s in prompts)

    def _prompt_forward(self, prompts: list[ScheduledSeq], replays: list[Piece] | str
                        ) -> tuple[torch.Tensor, list[torch.Tensor], str]:
        """The prompt chunks' rows of an admission step (hidden, captured layers, graph mode): their replays, or
        one eager forward when there are none (replays: why not; only beside a tree step launched ahead, whose
        verify rows need the graph: the synchronous admission step runs eagerly whole instead)."""
        if not isinstance(replays, str):
            return (*self.admissions.run(prompts, replays, self.staging), "replay: admission")
        inputs = prepare_inputs(prompts, None, self.block_size, self.device, self.staging, self.eager_pad_to,
                                self.dense_prefill_min_tokens)
        hidden, layers = self.model(inputs.input_ids, inputs.meta, self.kv_caches,
                                    capture_layer_ids=self.speculator.capture_layer_ids)
        rows = inputs.tree_row0  # (without its padding rows)
        return hidden[:rows], [layer[:rows] for layer in layers], f"eager: {replays}"

    def _run_beside(self, prompts: list[ScheduledSeq], decoders: list[ScheduledSeq], batch: TreeBatch | None,
                    watched: tuple | None, first: tuple, rest: tuple | None, tree_inputs: StepInputs | None,
                    t1: float, round_why: str | None) -> PendingStep:
        """An admission step's outputs, the prompt chunks' (first: hidden, layers, graph mode) then the decoding
        rows' (rest: hidden, layers; None without decoding rows), sampled as one step: its plain rows are the
        chunks' then the decoders', its verify rows (tree_inputs: their slots and roots) after them."""
        hidden, layers, mode = first
        if rest is not None:
            hidden = torch.cat([hidden, rest[0]])
            layers = [torch.cat([a, b]) for a, b in zip(layers, rest[1])]
        inputs = StepInputs(None, None, *row_layout(prompts + decoders), tree_inputs.tree_slots if batch else None,
                            tree_inputs.tree_starts if batch else None)
        return self._run(prompts + decoders, batch, watched, inputs, t1, round_why, forward=(hidden, layers, mode),
                         graph_tail=len(decoders) if self.plain_graphs is not None else 0)
