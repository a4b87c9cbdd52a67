"""Oracle drafter for tests: proposes a known ("golden") continuation, e.g. a reference greedy run.

`golden` gives, for a request, the whole golden token sequence (prompt + continuation, indexed by absolute
position): a mapping request_id -> tokens, or a function DraftRequest -> tokens | None. At depth d the golden
token is t[len(token_ids) - 1 + d], known while that position is inside the golden sequence and (with
check_prefix) the committed tokens still equal the golden prefix.

Ranks per depth: the golden token sits at rank 0, with `num_distractors` deterministic distractors below it
at log-probs base - spread * rank. In noise mode each depth independently, with probability `noise`, puts the
golden token at a rank r in 1..noise_rank instead (distractors fill ranks 0..r-1); when r >= K it is not
proposed at all. Unknown depths get distractors only, at a much lower base. Everything is a deterministic
function of (seed, request_id, position), see `golden_rank`.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from engine.speculative.drafter import DraftRequest, pack_candidates, proposal_width

KNOWN_BASE, UNKNOWN_BASE = -0.1, -8.0  # log-prob of rank 0 when the golden token is known / unknown


class OracleDrafter:
    target_layer_ids: tuple[int, ...] = ()

    def __init__(
        self,
        golden: Mapping[str, Sequence[int]] | Callable[[DraftRequest], Sequence[int] | None],
        vocab_size: int,
        horizon: int = 8,
        *,
        num_distractors: int = 3,
        noise: float = 0.0,  # probability that a depth's golden token is demoted to rank 1..noise_rank
        noise_rank: int = 1,
        spread: float = 2.0,
        seed: int = 0,
        exclude: Iterable[int] = (),  # never proposed (e.g. a DFlash mask token)
        check_prefix: bool = True,
        device: torch.device | str = "cpu",
    ):
        if horizon < 1 or num_distractors < 0 or noise_rank < 1 or not 0 <= noise <= 1:
            raise ValueError("oracle drafter: need horizon >= 1, num_distractors >= 0, noise_rank >= 1, "
                             "0 <= noise <= 1")
        self.golden, self.vocab_size, self.horizon = golden, vocab_size, horizon
        self.num_distractors, self.noise, self.noise_rank = num_distractors, noise, noise_rank
        self.spread, self.seed, self.check_prefix, self.device = spread, seed, check_prefix, device
        self.exclude = frozenset(int(t) for t in exclude)

    def release(self, request_id: str) -> None:
        pass  # stateless

    def golden_sequence(self, req: DraftRequest) -> Sequence[int] | None:
        """The golden sequence for `req`, or None when unknown or (check_prefix) diverged from it."""
        seq = self.golden(req) if callable(self.golden) else self.golden.get(req.request_id)
        if seq is None:
            return None
        if self.check_prefix:
            n = len(req.token_ids)
            if len(seq) < n or list(seq[:n]) != list(req.token_ids):
                return None
        return seq

    def golden_rank(self, request_id: str, position: int) -> int:
        """Rank of the golden token for absolute position `position` (before the K cut-off)."""
        if self.noise <= 0:
            return 0
        rng = random.Random(f"{self.seed}:{request_id}:{position}:rank")
        return rng.randint(1, self.noise_rank) if rng.random() < self.noise else 0

    def _distractors(self, request_id: str, position: int, count: int, avoid: set[int]) -> list[int]:
        rng = random.Random(f"{self.seed}:{request_id}:{position}:distractors")
        count = min(count, self.vocab_size - len(avoid | self.exclude))
        out: list[int] = []
        while len(out) < count:
            t = rng.randrange(self.vocab_size)
            if t not in avoid and t not in self.exclude:
                avoid.add(t)
                out.append(t)
        return out

    def candidates(self, req: DraftRequest, k: int) -> list[list[tuple[int, float]]]:
        """Per depth 1..L: [(token id, log-prob)], descending."""
        seq = self.golden_sequence(req)
        root = len(req.token_ids) - 1
        rows = []
        for d in range(1, self.horizon + 1):
            pos = root + d
            gold = int(seq[pos]) if seq is not None and pos < len(seq) else None
            if gold is not None and gold in self.exclude:
                gold = None
            if gold is None:
                toks = self._distractors(req.request_id, pos, min(k, self.num_distractors + 1), set())
                rows.append([(t, UNKNOWN_BASE - self.spread * i) for i, t in enumerate(toks)])
                continue
            rank = self.golden_rank(req.request_id, pos)
            if rank >= k:  # demoted out of the top-K: K distractors, so padding cannot bring it back
                toks = self._distractors(req.request_id, pos, k, {gold})
            else:
                width = min(k, max(self.num_distractors + 1, rank + 1))
                others = self._distractors(req.request_id, pos, width - 1, {gold})
                toks = others[:rank] + [gold] + others[rank:]
            rows.append([(t, KNOWN_BASE - self.spread * i) for i, t in enumerate(toks)])
        return rows

    def propose(self, batch: list[DraftRequest], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = proposal_width(top_k, self.vocab_size, len({t for t in self.exclude if 0 <= t < self.vocab_size}))
        rows = [row for req in batch for row in self.candidates(req, k)]
        lp, ids = pack_candidates(rows, k, self.vocab_size, self.exclude, device=self.device)  # [N*L, K]
        return lp.view(len(batch), self.horizon, k), ids.view(len(batch), self.horizon, k)


class DeviceOracle:
    """The oracle for measuring the engine's DDTree round (benchmarks) and for steps drafted ahead of their
    predecessor's results (tests): golden continuations gathered on the device from one padded table, with no
    per-request Python beyond a row lookup. Depth d proposes the golden token at rank 0 and K - 1 distinct
    distractors below it; positions past the golden sequence propose distractors only, far lower. No prefix
    check: a request that left its golden sequence simply has its drafts rejected. `golden` maps a prompt (as a
    tuple) to prompt + continuation; a request finds its row by its first prompt_len tokens.

    miss_rate: the share of golden positions where the drafter's top-1 is wrong (rank 0 and 1 swapped: the
    golden token comes second, as likely as a real drafter's runner-up), drawn once per (row, position) from
    `seed`, so every pass and every mode (chain or tree) faces the same drafter: acceptance under control."""

    target_layer_ids: tuple[int, ...] = ()
    SPREAD = 2.0

    def __init__(self, golden: dict[tuple, list[int]], prompt_len: int, vocab_size: int, horizon: int, device,
                 miss_rate: float = 0.0, seed: int = 0):
        self.prompt_len, self.vocab_size, self.horizon, self.device = prompt_len, vocab_size, horizon, device
        self.miss_rate, self.seed = miss_rate, seed
        self.load(golden)

    def load(self, golden: dict[tuple, list[int]]) -> None:
        """Replays these sequences (prompt tuple -> prompt + continuation) from now on."""
        seqs = list(golden.values())
        table = torch.full((len(seqs), max(map(len, seqs)) + self.horizon + 1), -1, dtype=torch.int64)
        for i, seq in enumerate(seqs):
            table[i, :len(seq)] = torch.tensor(seq)
        self.table, self.index = table.to(self.device), {key: i for i, key in enumerate(golden)}
        draws = torch.rand(table.shape, generator=torch.Generator().manual_seed(self.seed))
        self.miss = (draws < self.miss_rate).to(self.device)  # [rows, positions] bool: top-1 wrong there
        self.rows: dict[str, int] = {}  # request id -> its golden row
        self.num_positions = table.shape[1] - self.horizon  # root positions with a proposal of their own
        # top_k -> the proposal at every (row, root position), flat [rows * num_positions, L, K]: a step gathers
        # its requests' with one index per tensor (the formula per step was ~14 launches, ~0.3 ms of host time
        # a step at batch 8, on the host-bound steps the benchmarks measure)
        self.proposals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.batch_rows: dict[tuple[str, ...], torch.Tensor] = {}  # request ids -> their rows, on the device

    def release(self, request_id: str) -> None:
        self.rows.pop(request_id, None)

    def _row(self, req: DraftRequest) -> int:
        if req.request_id not in self.rows:
            self.rows[req.request_id] = self.index[tuple(req.token_ids[:self.prompt_len])]
        return self.rows[req.request_id]

    def propose(self, batch: list[DraftRequest], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.tensor([r.root_position for r in batch]).to(self.device, non_blocking=True)
        return self._gather(self._batch_rows(batch), positions, top_k)

    def propose_ahead(self, batch: list[DraftRequest], top_k: int, root_ids: torch.Tensor,
                      root_positions: torch.Tensor, num_new: torch.Tensor, feats=None, emitted_ids=None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """propose() for requests whose roots are still on the device (root_positions [N] int64 there; the
        drafter protocol's ahead call, engine.speculative.drafter)."""
        return self._gather(self._batch_rows(batch), root_positions, top_k)

    def _batch_rows(self, batch: list[DraftRequest]) -> torch.Tensor:
        """[N] int64 on the device: the requests' golden rows (the same batch comes back step after step)."""
        key = tuple(r.request_id for r in batch)
        if key not in self.batch_rows:
            if len(self.batch_rows) > 256:
                self.batch_rows.clear()
            self.batch_rows[key] = torch.tensor([self._row(r) for r in batch]).to(self.device)
        return self.batch_rows[key]

    def _gather(self, rows: torch.Tensor, root_positions: torch.Tensor, top_k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The proposals at these rows and root positions (positions past the table's propose what is past the
        golden sequence: distractors only), gathered from the precomputed ones."""
        if top_k not in self.proposals:
            num_rows, num_positions = self.table.shape[0], self.num_positions
            self.proposals[top_k] = self._compute(
                torch.arange(num_rows, device=self.device).repeat_interleave(num_positions),
                torch.arange(num_positions, device=self.device).repeat(num_rows), top_k)
        logprobs, ids = self.proposals[top_k]
        flat = rows * self.num_positions + root_positions.clamp(max=self.num_positions - 1)
        return logprobs.index_select(0, flat), ids.index_select(0, flat)

    def _compute(self, rows: torch.Tensor, root_positions: torch.Tensor, top_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The proposals at these rows and root positions (all inside the table), from the golden table."""
        depths = torch.arange(1, self.horizon + 1, device=self.device)
        where = (rows[:, None], root_positions[:, None] + depths)
        gold = self.table[where]  # [N, L], -1 past the golden sequence
        ranks = torch.arange(top_k, device=self.device)
        offsets = ranks
        if self.miss_rate > 0:  # a miss proposes gold + 1 first and the golden token second
            offsets = torch.where(self.miss[where][..., None] & (ranks < 2), 1 - ranks, ranks)
        ids = (gold.clamp(min=0)[..., None] + offsets) % self.vocab_size  # [N, L, K] distinct
        base = torch.where(gold >= 0, KNOWN_BASE, UNKNOWN_BASE)
        return (base[..., None] - self.SPREAD * ranks).float(), ids
