"""The paged attention's schedule (`attn_plan` in ext/csrc/attention.cu: tile rows, tiles a sequence, KV splits) run on
the host: a small program compiled with nvcc against attention.cu, the per-SM occupancy stubbed with the H100's
(1 CTA of the 128-row warpgroup tiles an SM, 2 of the 64-row tiles, 4 of the 16-row ones; 132 SMs)."""
from __future__ import annotations

import subprocess

import pytest

from ext import build

HARNESS = r"""
#include "attention.cu"
#include <cstdio>
#include <cstdlib>
namespace ddtree {
int attn_mma_gqa_ctas_per_sm(DType, int, int config) { return config == 2 ? 1 : (config == 1 ? 2 : 4); }
int attn_mma_mla_ctas_per_sm(DType, int) { return 1; }
cudaError_t attn_mma_gqa(const AttnParams&, DType, int, cudaStream_t) { return cudaSuccess; }
cudaError_t attn_mma_mla(const AttnParams&, DType, int, cudaStream_t) { return cudaSuccess; }
}  // namespace ddtree
int main(int argc, char** argv) {  // per case: group num_seqs max_query_len max_seq_len -> config tiles splits
  for (int i = 1; i + 3 < argc; i += 4) {
    const ddtree::AttnPlan p = ddtree::attn_plan(ddtree::kBFloat16, 128, 128, 128, false, true, atoi(argv[i]),
                                                 atoi(argv[i + 1]), 8, atoi(argv[i + 2]), atoi(argv[i + 3]), 132,
                                                 true, true);
    printf("%d %d %d\n", p.config, p.tiles_per_seq, p.num_splits);
  }
}
"""


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    if build.nvcc() is None:
        pytest.skip("nvcc is not on PATH (the CUDA toolkit is not installed)")
    folder = tmp_path_factory.mktemp("plan")
    (folder / "plan.cu").write_text(HARNESS)
    exe = folder / "plan"
    cmd = [build.nvcc(), "-std=c++17", "-arch=sm_80", "-I", str(build.CSRC), str(folder / "plan.cu"), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]

    def run(*cases: tuple[int, int, int, int]) -> list[tuple[int, ...]]:
        args = [str(x) for case in cases for x in case]
        out = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True).stdout
        return [tuple(int(x) for x in line.split()) for line in out.splitlines()]

    return run


def test_a_grid_past_one_wave_splits_where_its_waves_end_sooner(plan):
    """8 requests' 65-node trees at 4 heads a kv head: 260 rows, 3 tiles of 128, x 8 kv heads = 192 CTAs on 132 slots.
    One split is 2 waves of the whole context; 2 splits are 3 waves of half of it (on an H100, 1.61 against
    2.08 ms at 32k keys). 64 requests' 16-node trees (512 CTAs, 3.9 waves) gain nothing from splitting."""
    assert plan((4, 8, 65, 32833), (4, 8, 65, 4161), (4, 64, 17, 4113), (4, 64, 17, 32785)) == [
        (2, 3, 2), (2, 3, 2), (2, 1, 1), (2, 1, 1)]


def test_decode_tiles_past_one_wave_stay_whole(plan):
    """80 requests' decode rows are 640 CTAs on 528 slots (4 an SM): memory-bound, so not split by the wave count."""
    assert plan((4, 80, 1, 32768), (4, 200, 1, 32768)) == [(0, 1, 1), (0, 1, 1)]


def test_a_grid_within_one_wave_fills_it_and_short_contexts_stay_whole(plan):
    """Under one wave the splits fill the slots (24 CTAs: 5 splits of 32k keys); a split keeps at least two KV tiles
    (200 keys: one split whatever the grid); decode-shaped tiles (16 rows, 4 an SM) and 64-row tiles (2 an SM) fill
    their slots as before: 8 CTAs in 64 splits (the most), 32 in 8."""
    assert plan((4, 1, 65, 32833), (4, 8, 65, 200), (4, 1, 1, 32768), (4, 4, 9, 8192)) == [
        (2, 3, 5), (2, 3, 1), (0, 1, 64), (1, 1, 8)]
