"""bench/w4a16_linear.py's dispatch audit (CPU, rows shaped like a wgmma sweep's): the path the dispatch takes, its
time, the fastest measured path and their ratio."""
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import w4a16_linear  # noqa: E402

NAN = float("nan")


def _row(shape, m, cfg, kind, default, ms, decode, dequant):
    # the sweep's columns: W, M, block_m, tile_set, splits, kernel, default, ms, model ms, TFLOP/s, int4 GB/s, bf16 ms,
    # decode kernel ms, dequant+cuBLAS ms, tinygemm ms, bf16/ms, rel err
    return [shape, m, *cfg, kind, default, ms, NAN, 0.0, 0.0, 0.1, decode, dequant, NAN, 1.0, "1e-3"]


def test_audit_names_the_dispatched_and_the_fastest_path():
    rows = [  # sorted by (W, M, ms), as wgmma_sweep returns them
        _row("3072x7168", 300, (192, 1, 2), "ws", "", 0.046, NAN, 0.054),
        _row("3072x7168", 300, (64, 2, 0), "stream-K", "*", 0.049, NAN, 0.054),
        _row("4096x4096", 64, (64, 2, 4), "ws", "*", 0.020, 0.018, 0.030),
        _row("4096x4096", 512, (256, 1, 2), "ws", "*", 0.041, NAN, 0.039),
    ]
    taken = {("3072x7168", 300): False, ("4096x4096", 64): False, ("4096x4096", 512): True}
    audit = w4a16_linear.dispatch_audit(rows, lambda m, k, n: taken[(f"{n}x{k}", m)], decode_max_m=128)
    assert [r[:3] for r in audit] == [["3072x7168", 300, "dequant+cuBLAS"], ["4096x4096", 64, "decode kernel"],
                                      ["4096x4096", 512, "wgmma (default)"]]
    assert [r[4] for r in audit] == ["wgmma 192x1/2 ws", "decode kernel", "dequant+cuBLAS"]
    assert math.isclose(audit[0][6], 0.054 / 0.046) and audit[1][6] == 1.0
    assert math.isclose(audit[2][6], 0.041 / 0.039)


def test_a_config_swept_twice_counts_with_its_faster_time():
    """A stream-K default is swept twice under one name (as the default and as the stream-K entry): the fastest
    path is its faster time, so the ratio is never below 1."""
    rows = [_row("7168x7168", 64, (64, 2, 0), "stream-K", "*", 0.049, 0.060, 0.090),
            _row("7168x7168", 64, (64, 2, 0), "stream-K", "", 0.050, 0.060, 0.090)]
    (audit,) = w4a16_linear.dispatch_audit(rows, lambda m, k, n: True, decode_max_m=128)
    assert audit[2:] == ["wgmma (default)", 0.049, "wgmma 64x2/0 stream-K", 0.049, 1.0]


def test_model_column_estimates_every_ws_config_kind():
    """The sweep's "model ms" column: the time model's estimate for whole tiles, tail slices, every tile in slices and
    stream-K (the ones the dispatch chooses between), nan for the kernel without the producer."""
    from torchforge.ops import awq_wgmma_cost as cost

    def model_us(m, k, n, cfg):
        return w4a16_linear._model_ms(m, k, n, cfg, 132) * 1e3

    m, k, n = 512, 14336, 4096
    assert math.isclose(model_us(m, k, n, (256, 1, 1, 8, True)), cost.wgmma_time_us(m, k, n, (256, 1)))
    assert math.isclose(model_us(m, k, n, (256, 1, 2, 8, True)), cost.wgmma_split_time_us(m, k, n, (256, 1), 2))
    assert math.isclose(model_us(m, k, n, (256, 1, 0, 8, True, 0)), cost.wgmma_stream_k_time_us(m, k, n, (256, 1)))
    assert math.isclose(model_us(512, 7168, 18432, (256, 1, 4, 8, True, 264)),
                        cost.wgmma_tail_time_us(512, 7168, 18432, (256, 1), 4))
    assert math.isnan(w4a16_linear._model_ms(m, k, n, (256, 1, 2, 8, False), 132))
