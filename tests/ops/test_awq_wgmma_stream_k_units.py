"""Stream-K's unit math (csrc/awq_wgmma.cu, awq_wgmma_kernel with SK; launch; ops.cpp's awq_wgmma_cuda), modelled in
Python with the C++ integer semantics (every int the kernel keeps in 32 bits is checked to fit), on CPU: grids the GPU
tests cannot afford (past 46342 blocks, up to one block per pair of chunks, near 2^30 units) and many shapes.
Checked: every (tile, chunk) runs on exactly one block; every segment is a non-empty, even run of chunks from an even
chunk; a tile's parts are the blocks b_first .. b_first + parts - 1 in k order, each with its own partial slot
(2 b or 2 b + 1) among the 2 x dp_tiles that ops.cpp allocates, and as many segments as the last block's ticket
count; an odd K / 64 runs whole tiles. The formulas are the kernel's own lines (test_model_mirrors_the_source)."""
import itertools
import random
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "csrc"
I32 = 2 ** 31
SHAPES = [(64, 4), (64, 2), (128, 2), (192, 1), (256, 1)]


def i32(v):
    assert -I32 <= v < I32, f"32-bit int overflow: {v}"
    return v


def kgroups(bm, tw):  # consumer warpgroups per block (kGroups)
    return 2 if tw == 2 or bm >= 192 else 1


def ops_plan(M, N, K, BM, TW, dp_tiles, sms):
    """ops.cpp awq_wgmma_cuda with splits 0: tiles, the capped dp_tiles, tickets and partial slots (None: refused)."""
    sets = 4 // (TW * kgroups(BM, TW))
    tiles = (N // 64 + 3) // 4 * sets * ((M + BM - 1) // BM)
    if tiles >= I32 or tiles * (K // 64) >= I32:
        return None
    dp = min(dp_tiles if dp_tiles > 0 else sms, max(1, tiles * (K // 128)))
    return {"tiles": tiles, "dp": dp, "tickets": tiles, "part_slots": 2 * dp}


def launch_blocks(M, N, K, BM, TW, dp):
    """awq_wgmma_launch + launch: (stream-K instantiation?, blocks)."""
    ncols = i32((N // 64 + 3) // 4 * (4 // (TW * kgroups(BM, TW))))
    tiles = i32(ncols * ((M + BM - 1) // BM))
    if K // 64 % 2 == 0:
        return True, min(dp, i32(tiles * (K // 128)))
    return False, tiles  # splits 1, dp_tiles 0: whole tiles, no partials


class Kernel:
    def __init__(self, M, N, K, BM, TW, grid):
        self.ncols = i32((N // 64 + 3) // 4 * (4 // (TW * kgroups(BM, TW))))
        self.mblocks = i32((M + BM - 1) // BM)
        self.chunks = i32(K // 64)
        self.grid = grid
        self.pairs = self.chunks // 2
        self.units = i32(i32(self.mblocks * self.ncols) * self.pairs)
        self.uq, self.ur = self.units // grid, self.units % grid

    def block_start(self, b):  # uq * b + (int)((long long)ur * b / grid)
        return i32(i32(self.uq * b) + i32(self.ur * b // self.grid))

    def block_of(self, u):  # (int)(((long long)(u + 1) * grid - 1) / units)
        return i32(((u + 1) * self.grid - 1) // self.units)

    def first_tile(self, b):
        return self.block_start(b) // self.pairs

    def segments(self, bid):  # next_segment
        u, u_end = self.block_start(bid), self.block_start(bid + 1)
        while u < u_end:
            pid = u // self.pairs
            c_begin = i32(2 * i32(u - i32(pid * self.pairs)))
            c_end = min(self.chunks, i32(c_begin + i32(2 * i32(u_end - u))))
            u = i32(u + (c_end - c_begin) // 2)
            yield pid, c_begin, c_end

    def parts(self, bid, pid):  # b_first, parts, my_part
        b_first = self.block_of(i32(pid * self.pairs))
        return b_first, self.block_of(i32(i32(pid * self.pairs) + self.pairs - 1)) - b_first + 1, bid - b_first

    def slot(self, pid, b_first, j):  # part(j)
        return 2 * (b_first + j) + (0 if self.first_tile(b_first + j) == pid else 1)


def check(M, N, K, BM, TW, dp_tiles, sms=132):
    plan = ops_plan(M, N, K, BM, TW, dp_tiles, sms)
    if plan is None:
        return "refused"
    sk, grid = launch_blocks(M, N, K, BM, TW, plan["dp"])
    if not sk:
        assert grid == plan["tiles"] and plan["part_slots"] >= 1
        return "whole"
    # (grid <= dp by the launcher's own min(); what must hold is below: every slot a block writes is allocated)
    kn = Kernel(M, N, K, BM, TW, grid)
    tiles = kn.mblocks * kn.ncols
    assert tiles == plan["tiles"] <= plan["tickets"]
    per_tile, written = {}, {}
    for bid in range(grid):
        segs = list(kn.segments(bid))
        assert segs, f"block {bid} has no units"  # it would return early, and its tile's ticket never complete
        for pid, cb, ce in segs:
            assert 0 <= pid < tiles and 0 <= cb < ce <= kn.chunks and cb % 2 == 0 and (ce - cb) % 2 == 0
            b_first, parts, my_part = kn.parts(bid, pid)
            slot = None
            if parts > 1:
                slot = kn.slot(pid, b_first, my_part)
                assert 0 <= slot < plan["part_slots"] and slot not in written, (slot, written.get(slot), bid, pid)
                written[slot] = (bid, pid)
            per_tile.setdefault(pid, []).append((bid, cb, ce, parts, my_part, b_first, slot))
    assert len(per_tile) == tiles
    for pid, segs in per_tile.items():
        assert [s[1] for s in segs] == [0] + [s[2] for s in segs[:-1]] and segs[-1][2] == kn.chunks  # k order
        (parts,), (b_first,) = {s[3] for s in segs}, {s[5] for s in segs}
        assert parts == len(segs)  # the last of `parts` tickets reduces
        assert [s[0] for s in segs] == list(range(b_first, b_first + parts))
        assert [s[4] for s in segs] == list(range(parts))
        for j in range(parts if parts > 1 else 0):  # what the last block reads is what part j wrote
            assert written[kn.slot(pid, b_first, j)] == (b_first + j, pid)
    return "sk"


def test_model_mirrors_the_source():
    cu = (SRC / "awq_wgmma.cu").read_text()
    for line in ["const int pairs = chunks / 2;",
                 "const int units = stream_k ? mblocks * ncols * pairs : 1;",
                 "return uq * b + static_cast<int>(static_cast<long long>(ur) * b / grid);",
                 "s.pid = u / pairs;",
                 "s.c_begin = 2 * (u - s.pid * pairs);",
                 "s.c_end = min(chunks, s.c_begin + 2 * (u_end - u));",
                 "u += (s.c_end - s.c_begin) / 2;",
                 "return static_cast<int>((static_cast<long long>(u + 1) * grid - 1) / units);",
                 "auto first_tile = [&](int b) { return block_start(b) / pairs; };",
                 "b_first = block_of(s.pid * pairs);",
                 "parts = block_of(s.pid * pairs + pairs - 1) - b_first + 1;",
                 "index = 2 * static_cast<size_t>(b_first + j) + (first_tile(b_first + j) == s.pid ? 0 : 1);",
                 "SK ? std::min(dp_tiles, tiles * (K / 128))",
                 "constexpr int kGroups = TW == 2 || BM >= 192 ? 2 : 1;",
                 "const int ncols = (N / 64 + 3) / 4 * (4 / (TW * kGroups<BM, TW>));",
                 "constexpr int kSets = 4 / (TW * kGroups<BM, TW>);",
                 "const int ncols = (nblocks + 3) / 4 * kSets;",
                 "if (s == 0 && k / 64 % 2 == 0 && producer_warp && producer_pool_ok<T, S, BM, TW, false, true>())"]:
        assert line in cu, line
    ops = (SRC / "ops.cpp").read_text()
    assert "dp_tiles = std::min(dp_tiles > 0 ? dp_tiles : sms, std::max<int64_t>(1, tiles * (K / 128)));" in ops
    assert "const int64_t part_slots = splits == 0 ? 2 * dp_tiles" in ops
    # ops_plan's tile count mirrors awq_wgmma_tiles (in awq_wgmma.cu)
    assert "{ return tile_set == 2 || block_m >= 192 ? 2 : 1; }" in cu
    assert "const int64_t sets = 4 / (tile_set * wgmma_groups(block_m, tile_set));" in cu


@pytest.mark.parametrize("shape", SHAPES)
def test_stream_k_units_sweep(shape):
    seen = set()
    for M, N, K, dp in itertools.product([1, 64, 65, 200, 1000], [64, 320, 1024, 4096], [64, 128, 192, 256, 768, 1984,
                                         2048], [0, 1, 3, 5, 37, 131, 1000, 10 ** 12]):
        seen.add(check(M, N, K, *shape, dp))
    assert seen == {"sk", "whole"}


def test_stream_k_every_grid_up_to_one_block_per_pair():
    for (BM, TW), M, N, K in itertools.product(SHAPES, [65, 300], [320, 1024], [128, 256, 640]):
        units = Kernel(M, N, K, BM, TW, 1).units
        for grid in range(1, units + 1):
            assert check(M, N, K, BM, TW, grid) == "sk"


def test_stream_k_random_shapes():
    rnd = random.Random(1)
    for _ in range(300):
        BM, TW = rnd.choice(SHAPES)
        check(rnd.randint(1, 3000), 64 * rnd.randint(1, 80), 64 * rnd.randint(1, 200), BM, TW,
              rnd.choice([0, rnd.randint(1, 50_000)]), rnd.choice([132, 114, 1]))


@pytest.mark.parametrize("M, N, K, BM, TW, dp", [
    (11767, 4096, 4096, 64, 2, 50_000),  # test_awq_wgmma_cuda's 46341-block case: q 1, r 44208
    (11767, 4096, 4096, 64, 2, 10 ** 9),  # one block per pair
    (20000, 8192, 256, 64, 2, 60_000),  # two pairs per tile, 40 000 tiles
    (100_000, 4096, 128, 64, 2, 10 ** 9),  # one pair per tile, 25 000 tiles
])
def test_stream_k_past_46341_blocks(M, N, K, BM, TW, dp):
    assert check(M, N, K, BM, TW, dp) == "sk"


@pytest.mark.parametrize("dp", [1, 132, 46_342, 10 ** 12])
def test_stream_k_near_2_30_units_fits_32_bits(dp):
    """2097088 rows of (64, 2) on 256 columns x 65534 chunks: 1.07e9 units (ops.cpp's cap: tiles x chunks < 2^31).
    Sampled blocks only: their ranges, block_of and the segments' 32-bit sums."""
    M, N, K, BM, TW = 64 * 32767 - 1, 256, 64 * 65534, 64, 2
    plan = ops_plan(M, N, K, BM, TW, dp, 132)
    sk, grid = launch_blocks(M, N, K, BM, TW, plan["dp"])
    kn = Kernel(M, N, K, BM, TW, grid)
    assert sk and kn.units > 2 ** 29
    assert kn.block_start(grid) == kn.units
    for b in sorted({b for b in (0, 1, grid // 3, grid // 2, grid - 2, grid - 1) if 0 <= b < grid}):
        start, end = kn.block_start(b), kn.block_start(b + 1)
        assert 0 <= start < end and kn.block_of(start) == b == kn.block_of(end - 1)
        if end - start <= 64 * kn.pairs:
            segs = list(kn.segments(b))
            assert sum(ce - cb for _, cb, ce in segs) == 2 * (end - start)
            for pid, _, _ in segs:
                b_first, parts, my_part = kn.parts(b, pid)
                assert parts == 1 or kn.slot(pid, b_first, my_part) < plan["part_slots"]
