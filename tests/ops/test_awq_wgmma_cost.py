"""The time model behind the Hopper kernel's dispatch (torchforge.ops.awq_wgmma_cost): block counts, rounds of
blocks on the SMs, and the choices it makes on the swept H100 shapes (BENCHMARKS.md, eleventh session)."""
import expecttest

from torchforge.ops.awq_mma_cuda import wgmma_cuda_config, wgmma_rows_ok
from torchforge.ops.awq_wgmma_cost import (SPLIT_SPLITS, TAIL_SPLITS, WGMMA_MIN_M, best_wgmma_config, best_wgmma_shape,
                                           cluster_slots, decode_mma_time_us, dequant_cublas_time_us, wgmma_blocks,
                                           wgmma_cluster_time_us, wgmma_split_time_us, wgmma_stream_k_time_us,
                                           wgmma_tail_time_us, wgmma_time_us)


def test_blocks_and_rounds():
    # 72 groups of 256 columns in 18432; (256, 1) puts 2 blocks on each (two warpgroups, one column tile each), (128, 2)
    # and (64, 2) one (two warpgroups, two tiles each), (64, 4) 1 (one warpgroup, all four)
    assert wgmma_blocks(256, 18432, (256, 1)) == 72 * 2
    assert wgmma_blocks(256, 18432, (128, 2)) == 72 * 2
    assert wgmma_blocks(160, 18432, (64, 2)) == 72 * 3
    assert wgmma_blocks(1, 64, (256, 1)) == 2  # a partial group of columns still takes its blocks
    assert wgmma_blocks(64, 18432, (64, 4)) == 72
    # rounds of 132: 288 blocks take 3 -> 3 x 112 chunks at the per-chunk cost
    t3 = wgmma_time_us(512, 7168, 18432, (256, 1)) - wgmma_time_us(1, 0, 1, (256, 1))
    assert abs(t3 - 3 * 112 * 0.77) < 1e-9
    assert wgmma_time_us(512, 7168, 18432, (256, 1), sms=288) < wgmma_time_us(512, 7168, 18432, (256, 1))


def test_choices_on_the_swept_shapes():
    # measured best block shapes: a round fewer decides, or at the same rounds the lower per-chunk cost
    # 160 rows on 18432x7168, whole tiles: (64, 2) 0.177 ms against (128, 2)'s 0.195 (eleventh session); (192, 1), 144
    # blocks in 2 rounds, 0.146 (twenty-sixth)
    assert best_wgmma_shape(160, 7168, 18432)[0] == (192, 1)
    # 14336x4096 at 160 rows, 112 blocks in 1 round (twenty-sixth session): (192, 1) 0.048 ms, (256, 1) 0.054, (128, 2)
    # 0.059 (eleventh)
    assert best_wgmma_shape(160, 4096, 14336)[0] == (192, 1)
    # 7168x7168 at 256 rows: 56 blocks of (256, 1), in 2 K slices: 0.056-0.057 ms against 0.080 whole and 0.064 for
    # (128, 2) in 2 slices (twenty-sixth session); the slices as clusters 0.051 (thirty-third)
    assert best_wgmma_config(256, 7168, 7168, clusters=False)[0] == (256, 1, 2, 0, False)
    assert best_wgmma_config(256, 7168, 7168)[0] == (256, 1, 2, 0, True)
    # dequantize + cuBLAS where the kernel leaves most SMs idle (64 blocks at most on 4096 columns)
    assert best_wgmma_shape(256, 4096, 4096)[1] > dequant_cublas_time_us(256, 4096, 4096)  # 0.041 against 0.035
    assert best_wgmma_shape(256, 7168, 18432)[1] < dequant_cublas_time_us(256, 7168, 18432)  # 0.196 against 0.228


# dequantize + cuBLAS as measured (H100, twenty-eighth session, `bench/w4a16_linear.py --cublas-fit`, weights rotated):
# (rows, K, N) -> ms, where the dispatch weighs it against the kernels
CUBLAS_MEASURED_MS = {(256, 7168, 3072): 0.050, (384, 7168, 3072): 0.055, (256, 4096, 4096): 0.035,
                      (512, 4096, 4096): 0.040, (256, 7168, 7168): 0.095, (512, 7168, 7168): 0.125,
                      (256, 7168, 18432): 0.229, (512, 7168, 18432): 0.312, (384, 14336, 4096): 0.144,
                      (512, 4096, 14336): 0.146, (256, 5120, 5120): 0.057, (1024, 5120, 5120): 0.096}


def test_dequant_cublas_estimate_follows_the_measured():
    """The estimate within 0.87-1.13x of every measured time above (1.13 is 4096x4096 at 512 rows; the estimate
    without GEMM_US_PER_K was 0.81x on 3072x7168 at 256 rows and 1.19x on 5120x5120 at 1024)."""
    ratios = {key: dequant_cublas_time_us(*key) / 1e3 / ms for key, ms in CUBLAS_MEASURED_MS.items()}
    assert all(0.87 <= r <= 1.13 for r in ratios.values()), ratios


def test_shapes_only_where_they_were_swept():
    # (192, 1) and (256, 1) were timed from 160 rows: below 129 the model does not give them rows (2048x16384 at 100
    # rows went to (192, 1), 92 of its rows empty, before this rule)
    for m in (32, 64, 100, 128):
        for n, k in ((16384, 2048), (18432, 7168), (7168, 7168), (4096, 14336)):
            assert best_wgmma_config(m, k, n)[0][:2] not in WGMMA_MIN_M, (m, n, k)
            assert best_wgmma_shape(m, k, n)[0] not in WGMMA_MIN_M, (m, n, k)
    assert best_wgmma_config(100, 2048, 16384, clusters=False)[0][:2] == (64, 2)
    assert best_wgmma_config(100, 2048, 16384)[0][:2] == (128, 2)  # in 2 K slices as clusters: 32 tiles, 20 us
    assert best_wgmma_config(129, 4096, 4096)[0][:2] == (192, 1)


def test_block_outputs_match_the_kernel():
    # ops.cpp sizes partials by awq_wgmma_block_outputs; the kernel writes kAcc x kThreads = TW (BM / 2) x 128 kGroups
    # floats per part: the model's _block_outputs and _groups agree with both
    from torchforge.ops.awq_wgmma_cost import _block_outputs, _groups
    for (bm, tw), groups in {(64, 4): 1, (64, 2): 2, (128, 2): 2, (192, 1): 2, (256, 1): 2}.items():
        assert _groups((bm, tw)) == groups
        assert _block_outputs((bm, tw)) == tw * (bm // 2) * 128 * groups
        assert wgmma_blocks(bm, 256, (bm, tw)) == 4 // (tw * groups)


def test_decode_kernel_steps_every_16_rows():
    # the decode kernel dequantizes each weight once per 16 rows: equal within a step, one step more per 16 rows
    assert decode_mma_time_us(49, 7168, 18432) == decode_mma_time_us(64, 7168, 18432)
    step = decode_mma_time_us(65, 7168, 18432) - decode_mma_time_us(64, 7168, 18432)
    assert abs(step - 18432 * 7168 * 1e-6 * 0.168) < 1e-6
    # and never below the int4 weight read: 66 MB at 2.4 TB/s
    assert decode_mma_time_us(1, 7168, 18432) >= 18432 * 7168 / 2 / 2.4e12 * 1e6
    # against it, (64, 2) wgmma blocks win on 18432x7168 from 56 rows (0.078 ms against 0.086), not at 48 (0.077
    # against 0.069); on 14336x4096 from 72 (0.047 against 0.050)
    assert best_wgmma_shape(56, 7168, 18432)[1] < decode_mma_time_us(56, 7168, 18432)
    assert best_wgmma_shape(48, 7168, 18432)[1] > decode_mma_time_us(48, 7168, 18432)
    assert best_wgmma_shape(72, 4096, 14336)[1] < decode_mma_time_us(72, 4096, 14336)
    assert best_wgmma_shape(64, 4096, 14336)[1] > decode_mma_time_us(64, 4096, 14336)


def test_tail_slices():
    # 144 blocks of (128, 2) on 18432 columns at 256 rows: one full round of 132, then 12 tiles; in 6 slices each
    # they take 72 blocks of 19 chunks, first in the launch (measured: 0.144-0.146 ms against 0.197 with the 12 whole)
    t = wgmma_tail_time_us(256, 7168, 18432, (128, 2), 6)
    assert t < wgmma_time_us(256, 7168, 18432, (128, 2))
    assert min(wgmma_tail_time_us(256, 7168, 18432, (128, 2), s) for s in TAIL_SPLITS) == t
    # (256, 1) with two warpgroups (twenty-sixth session) takes both: 144 blocks at 256 rows, the 12 past one round in
    # 4 K slices, 0.129 ms (its stream-K 0.127, (128, 2)'s stream-K 0.139); 288 at 512 rows, the 24 past two rounds,
    # 0.232 against (128, 2)'s tail slices' 0.257
    assert best_wgmma_config(256, 7168, 18432)[0] == (256, 1, 4, 132, False)
    assert best_wgmma_config(512, 7168, 18432)[0] == (256, 1, 4, 264, False)
    # no tail to slice: fewer blocks than SMs, a whole number of rounds, or slices that overflow the round
    assert wgmma_tail_time_us(128, 7168, 18432, (128, 2), 2) == float("inf")   # 72 blocks
    assert wgmma_tail_time_us(256, 7168, 16896, (128, 2), 2) == float("inf")   # 66 x 2 = 132 blocks
    assert wgmma_tail_time_us(256, 7168, 18432, (128, 2), 12) == float("inf")  # 12 x 12 = 144 > 132
    # 7168x7168 at 256 rows: 56 blocks of (256, 1), under one round, nothing to slice
    assert wgmma_tail_time_us(256, 7168, 7168, (256, 1), 2) == float("inf")


def test_every_tile_in_slices_at_few_rows():
    # twelfth session, H100 (ms): at 64 rows (64, 2) blocks with every tile in K slices beat the whole tiles and the
    # decode kernel: 18432x7168 3 slices 0.068 (whole 0.077), 7168x7168 4 slices 0.032 (decode kernel 0.038),
    # 14336x4096 2 slices 0.033 (decode kernel 0.041)
    for (n, k), splits in (((18432, 7168), 3), ((7168, 7168), 4), ((14336, 4096), 2)):
        best = min(SPLIT_SPLITS, key=lambda s: wgmma_split_time_us(64, k, n, (64, 2), s))
        assert best == splits and wgmma_split_time_us(64, k, n, (64, 2), splits) < decode_mma_time_us(64, k, n)
        if n != 18432:  # (18432x7168 takes stream-K since the twenty-first session: test_stream_k)
            assert best_wgmma_config(64, k, n, clusters=False)[0] == (64, 2, splits, 0, False)
            assert best_wgmma_config(64, k, n)[0] == (64, 2, splits, 0, True)  # as clusters: test_clusters
    assert wgmma_split_time_us(64, 7168, 18432, (64, 2), 3) < wgmma_time_us(64, 7168, 18432, (64, 2))
    # up to 256 rows since the twenty-sixth session (7168x7168 at 256 rows: (256, 1) in 2 slices, 0.056 ms against
    # 0.080 whole; the estimate 0.057); past it only in one round of blocks up to 512 rows (twenty-seventh session:
    # 4096x14336 at 512 rows, 64 tiles of (256, 1) in 2 slices, 0.109 ms against stream-K's 0.122; 18432x7168 at 384
    # rows in 3 slices of (128, 2), 3 rounds, was slower than whole tiles); nor more slices than chunks
    assert abs(wgmma_split_time_us(256, 7168, 7168, (256, 1), 2) - 57) < 3
    assert wgmma_split_time_us(257, 7168, 18432, (128, 2), 2) == float("inf")
    assert wgmma_split_time_us(384, 7168, 18432, (128, 2), 3) == float("inf")
    assert wgmma_blocks(512, 4096, (256, 1)) * 2 <= 132 and abs(wgmma_split_time_us(512, 14336, 4096, (256, 1), 2) - 109) < 10
    assert best_wgmma_config(512, 14336, 4096, clusters=False)[0] == (256, 1, 2, 0, False)
    assert wgmma_split_time_us(513, 14336, 4096, (256, 1), 2) == float("inf")
    assert wgmma_split_time_us(64, 128, 18432, (64, 2), 3) == float("inf")


def test_dispatch_takes_a_symbolic_row_count():
    """Under torch.compile with dynamic shapes, inductor runs the op's Python (the dispatch) with SymInts for the rows
    of x and, where one compiled function meets several weights, for the weight's size; the dispatch specializes on
    them (divmod on a SymInt raised in the time model before, on the device)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        m, n = x.shape[0], w.shape[0] * 64
        return x * wgmma_cuda_config(m, 7168, n)[2] + wgmma_rows_ok(m, 7168, n)

    x, w = torch.ones(64, 2), torch.ones(112, 1)  # 7168 columns
    graph = make_fx(f, tracing_mode="symbolic")(x, w)
    assert torch.equal(graph(x, w), f(x, w)) and f(x, w)[0, 0] == 5  # 4 K slices + taken, as for plain ints


def _cell(config) -> str:
    block_m, tile_set, splits, dp_tiles, cluster = config[0], config[1], config[2], config[5], config[6]
    if splits == 0:
        return f"{block_m}x{tile_set}/sk"
    return f"{block_m}x{tile_set}" + (f"/{splits}" + ("t" if dp_tiles else "") + ("c" if cluster else "")
                                      if splits > 1 else "")


class TestDispatchTable(expecttest.TestCase):
    def test_dispatch_table(self):
        """The block shape the op takes per matrix and row count; /s: every tile in s K slices, /st: the last round's
        tiles in s K slices, /sc: every tile's s K slices as one cluster, /sk: stream-K ("-": the decode kernel up to
        128 rows, else dequantize + cuBLAS)."""
        ms = (32, 48, 56, 64, 72, 96, 128, 129, 160, 192, 256, 384, 512, 513)
        lines = [f"{'rows':>10} " + " ".join(f"{m:>8}" for m in ms)]
        for n, k in ((18432, 7168), (7168, 7168), (14336, 4096), (4096, 14336), (4096, 4096)):
            cells = [_cell(wgmma_cuda_config(m, k, n)) if wgmma_rows_ok(m, k, n) else "-" for m in ms]
            lines.append(f"{f'{n}x{k}':>10} " + " ".join(f"{c:>8}" for c in cells))
        self.assertExpectedInline("\n".join(lines), """\
      rows       32       48       56       64       72       96      128      129      160      192      256      384      512      513
18432x7168        -  64x2/sk  64x2/sk  64x2/sk 128x2/sk 128x2/sk 128x2/sk 192x1/sk 192x1/sk 192x1/sk 256x1/4t    128x2 256x1/4t        -
 7168x7168        -  64x2/4c  64x2/4c  64x2/4c 128x2/4c 128x2/4c 128x2/4c 192x1/2c 192x1/2c 192x1/2c 256x1/2c    192x1    256x1        -
14336x4096        -  64x2/2c  64x2/2c  64x2/2c 128x2/2c 128x2/2c 128x2/2c    192x1    192x1    192x1    256x1    192x1    256x1        -
4096x14336        -        -  64x2/6c  64x2/6c 128x2/6c 128x2/6c 128x2/6c 192x1/3c 192x1/3c 192x1/3c 256x1/3c 192x1/2c 256x1/2c        -
 4096x4096        -        -        -        -        -        -  64x2/3c 192x1/3c 192x1/3c 192x1/3c 256x1/3c 192x1/2c 256x1/2c        -""")


def test_stream_k():
    # twenty-first session, H100, weights rotated (ms): 18432x7168 at 64 rows, (64, 2) in stream-K 0.056-0.057 against
    # 3 K slices 0.065-0.066; 7168x7168 at 64 rows 4.7 parts per tile, 0.035 against 4 slices 0.032; 14336x4096 at 64
    # rows 27 chunks per SM, 0.035 against 2 slices 0.032-0.033
    assert best_wgmma_config(64, 7168, 18432)[0] == (64, 2, 0, 0, False)
    assert wgmma_cuda_config(64, 7168, 18432) == (64, 2, 0, 8, True, 0, False)
    assert abs(wgmma_stream_k_time_us(64, 7168, 18432, (64, 2)) - 56.5) < 3
    assert wgmma_stream_k_time_us(64, 7168, 7168, (64, 2)) == float("inf")  # past STREAM_K_MAX_PARTS
    assert wgmma_stream_k_time_us(64, 4096, 14336, (64, 2)) == float("inf")  # under STREAM_K_MIN_CHUNKS
    assert wgmma_stream_k_time_us(256, 7168, 18432, (64, 4)) == float("inf")  # no fit for this shape
    # (256, 1), fitted in the twenty-sixth session: 0.127-0.130 ms at 256 rows on 18432x7168, 0.067 on 7168x7168
    assert abs(wgmma_stream_k_time_us(256, 7168, 18432, (256, 1)) - 130) < 7
    assert abs(wgmma_stream_k_time_us(256, 7168, 7168, (256, 1)) - 67) < 4
    # 111 chunks: stream-K's units are pairs of chunks, so the kernel would run whole tiles
    assert wgmma_stream_k_time_us(64, 7104, 18432, (64, 2)) == float("inf")
    assert best_wgmma_config(64, 7104, 18432)[0][2] != 0
    # no rows, or K under one chunk: no units (launch_awq_wgmma_cuda without a config asks for x of 0 rows too)
    assert wgmma_stream_k_time_us(0, 7168, 18432, (64, 2)) == float("inf")
    assert wgmma_stream_k_time_us(64, 32, 18432, (64, 2)) == float("inf")
    assert best_wgmma_config(0, 7168, 18432)[0][2] != 0
    # (128, 2) blocks from 96 rows on 18432x7168: 0.087-0.090 against 3 K slices' 0.105-0.109
    assert best_wgmma_config(128, 7168, 18432)[0] == (128, 2, 0, 0, False)


# K slices as clusters, measured (H100, thirty-third session, `bench/w4a16_linear.py --cluster-check`, weights rotated):
# (rows, K, N, block shape, slices) -> ms, one round of clusters unless noted
CLUSTER_MEASURED_MS = {(64, 7168, 7168, (64, 2), 4): 0.026, (64, 7168, 7168, (64, 2), 2): 0.041,
                       (128, 7168, 7168, (128, 2), 4): 0.034, (128, 7168, 7168, (192, 1), 2): 0.042,
                       (256, 7168, 7168, (256, 1), 2): 0.052, (64, 14336, 4096, (64, 2), 6): 0.032,
                       (128, 14336, 4096, (128, 2), 3): 0.066, (64, 4096, 14336, (64, 2), 2): 0.028}


def test_clusters():
    """The cluster estimate within 0.88-1.1x of the measured; the H100's cluster slots, scaled for other SM counts;
    no (64, 4) (no cluster path), no third round, no slice counts without slots."""
    ratios = {key: wgmma_cluster_time_us(*key) / 1e3 / ms for key, ms in CLUSTER_MEASURED_MS.items()}
    assert all(0.88 <= r <= 1.1 for r in ratios.values()), ratios
    assert [cluster_slots(s) for s in (1, 2, 3, 4, 5, 6, 8)] == [0, 66, 39, 30, 0, 17, 15]
    assert cluster_slots(4, sms=66) == 15
    assert wgmma_cluster_time_us(64, 7168, 7168, (64, 4), 4) == float("inf")
    assert wgmma_cluster_time_us(64, 7168, 7168, (64, 2), 5) == float("inf")
    # one round only: 72 tiles in clusters of 3 (39 slots) ran no faster than stream-K (18432x7168 at 72-128 rows)
    assert wgmma_cluster_time_us(128, 7168, 18432, (128, 2), 3) == float("inf")
    assert wgmma_cluster_time_us(128, 7168, 18432, (128, 2), 2) == float("inf")  # 72 tiles, 66 slots
    assert wgmma_cluster_time_us(64, 128, 7168, (64, 2), 4) == float("inf")  # 2 chunks
    # the partials against clusters, same slices (ms): 7168x7168 at 64 rows 0.032 / 0.026, at 128 0.045 / 0.034
    assert best_wgmma_config(64, 7168, 7168)[0] == (64, 2, 4, 0, True)
    assert best_wgmma_config(128, 7168, 7168)[0] == (128, 2, 4, 0, True)
    assert wgmma_cuda_config(128, 7168, 7168) == (128, 2, 4, 8, True, 0, True)
    # a device's own slots (op awq_wgmma_cluster_slots): none of 4 blocks leaves 3 slices (39 slots), none at all
    # leaves the partials, fewer slots add rounds
    own = tuple((s, 0 if s == 4 else n) for s, n in ((2, 66), (3, 39), (4, 30), (6, 17), (8, 15)))
    assert best_wgmma_config(64, 7168, 7168, clusters=own)[0] == (64, 2, 3, 0, True)
    assert best_wgmma_config(64, 7168, 7168, clusters=())[0] == (64, 2, 4, 0, False)
    one_round = wgmma_cluster_time_us(64, 7168, 7168, (64, 2), 4)
    assert wgmma_cluster_time_us(64, 7168, 7168, (64, 2), 4, slots=14) > one_round  # 28 tiles: two rounds, not taken (inf)
