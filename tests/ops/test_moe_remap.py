"""torchforge::moe_remap: never an invalid id, pruned picks -> (0, 0), Triton kernel (interpreted on CPU) ==
reference, opcheck, torch.compile, clear errors."""
import pytest
import torch
from torch.library import opcheck

from torchforge.ops import moe_remap
from torchforge.ops._triton import can_launch
from torchforge.ops.moe_remap import launch_moe_remap, moe_remap_ref
from torchforge.prune import build_expert_map

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(seed, *, T=None, E=None, k=None, kept=None, id_dtype=torch.int64, w_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    E = E or int(torch.randint(1, 64, (1,), generator=g))
    kept = kept or int(torch.randint(1, E + 1, (1,), generator=g))
    T = T if T is not None else int(torch.randint(0, 50, (1,), generator=g))
    k = k or min(E, int(torch.randint(1, 9, (1,), generator=g)))
    layer_map = build_expert_map(torch.rand(1, E, generator=g), keep_k=kept)[0]
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    return ids.to(id_dtype), torch.rand(T, k, generator=g).to(w_dtype), layer_map


def check_invariants(ids, w, out_ids, out_w, layer_map):
    num_kept = int((layer_map >= 0).sum())
    assert out_ids.dtype == ids.dtype and out_w.dtype == w.dtype and out_ids.shape == ids.shape
    assert bool(((out_ids >= 0) & (out_ids < num_kept)).all()), "invalid compact id"
    mapped = layer_map.long()[ids.long()]
    pruned = mapped < 0
    assert torch.equal(out_ids[pruned], torch.zeros_like(out_ids[pruned]))
    assert bool((out_w[pruned] == 0).all())
    assert torch.equal(out_ids[~pruned].long(), mapped[~pruned])
    assert torch.equal(out_w[~pruned], w[~pruned])


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_never_an_invalid_id_random_maps(id_dtype):
    for seed in range(40):
        kept = 1 if seed % 4 == 0 else None  # all pruned but one
        ids, w, layer_map = random_case(seed, kept=kept, id_dtype=id_dtype)
        out_ids, out_w = moe_remap(ids, w, layer_map)
        check_invariants(ids, w, out_ids, out_w, layer_map)


def test_seed_example_and_dtypes():
    layer_map = torch.tensor([2, -1, 0, 1, -1], dtype=torch.int32)
    ids = torch.tensor([[0, 1], [4, 3], [2, 0]])
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        w = torch.tensor([[0.5, 0.25], [0.75, 0.125], [1.0, 2.0]], dtype=dt)
        out_ids, out_w = moe_remap(ids, w, layer_map)
        assert out_ids.tolist() == [[2, 0], [0, 1], [0, 2]]
        assert out_w.tolist() == [[0.5, 0.0], [0.0, 0.125], [1.0, 2.0]]
    # NaN weight on a pruned pick still becomes exactly 0
    out_ids, out_w = moe_remap(torch.tensor([1, 2]), torch.tensor([float("nan"), 1.0]), layer_map)
    assert out_w.tolist() == [0.0, 1.0]


def test_out_of_range_ids():
    layer_map = torch.tensor([0, -1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"moe_remap: topk_ids has 2 values outside \[0, 3\) \(e.g. 3\); layer_map "
                                         "has 3 entries, one per ORIGINAL expert"):
        moe_remap(torch.tensor([[3, 0], [-1, 2]]), torch.ones(2, 2), layer_map)
    # the reference semantics used on CUDA (and by the kernel): clamped to id 0 with weight 0
    out_ids, out_w = moe_remap_ref(torch.tensor([3, -1, 2]), torch.ones(3), layer_map)
    assert out_ids.tolist() == [0, 0, 1] and out_w.tolist() == [0.0, 0.0, 1.0]


def test_bad_arguments():
    layer_map = torch.tensor([0, 1], dtype=torch.int32)
    ids, w = torch.tensor([[0, 1]]), torch.ones(1, 2)
    with pytest.raises(TypeError, match="topk_ids must be int32 or int64"):
        moe_remap(ids.float(), w, layer_map)
    with pytest.raises(TypeError, match="topk_weights must be float32/float16/bfloat16"):
        moe_remap(ids, w.long(), layer_map)
    with pytest.raises(TypeError, match="layer_map must be int32"):
        moe_remap(ids, w, layer_map.float())
    with pytest.raises(ValueError, match=r"layer_map must be \[E\].*got shape \(1, 2\); pass expert_map\[layer\]"):
        moe_remap(ids, w, layer_map[None])
    with pytest.raises(ValueError, match=r"topk_weights has shape \(2, 1\) but topk_ids has \(1, 2\)"):
        moe_remap(ids, w.T, layer_map)


def test_opcheck():
    op = torch.ops.torchforge.moe_remap.default
    for seed, (id_dtype, w_dtype) in enumerate([(torch.int64, torch.float32), (torch.int32, torch.bfloat16),
                                                 (torch.int64, torch.float16)]):
        ids, w, layer_map = random_case(seed, T=7, E=16, k=4, kept=5, id_dtype=id_dtype, w_dtype=w_dtype)
        opcheck(op, (ids, w, layer_map))
    ids, w, layer_map = random_case(9, T=0, E=4, k=2)
    opcheck(op, (ids, w, layer_map))


def test_weight_gradient_follows_the_keep_mask():
    # the op's autograd formula against autograd through the pure-torch reference
    ids, w, layer_map = random_case(3, T=9, E=16, k=4, kept=6)
    ids[0, 0] = 20  # out of range on the reference: a pruned pick (the CPU op raises, so the reference alone)
    w1, w2 = w.clone().requires_grad_(), w.clone().requires_grad_()
    g = torch.randn_like(w)
    (moe_remap_ref(ids, w1, layer_map)[1] * g).sum().backward()
    ids_ok = ids.clone()
    ids_ok[0, 0] = 0
    w3 = w.clone().requires_grad_()
    (moe_remap_ref(ids_ok, w3, layer_map)[1] * g).sum().backward()
    (moe_remap(ids_ok, w2, layer_map)[1] * g).sum().backward()
    assert torch.equal(w2.grad, w3.grad)
    assert int((w2.grad == 0).sum()) == int((layer_map.long()[ids_ok] < 0).sum())
    assert w1.grad[0, 0] == 0
    # opcheck's aot_dispatch utility sums every output into one scalar, which fails on the int ids output first
    opcheck(torch.ops.torchforge.moe_remap.default, (ids_ok, w.clone().requires_grad_(), layer_map),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_compile_fullgraph():
    torch._dynamo.reset()
    ids, w, layer_map = random_case(3, T=9, E=12, k=3, kept=4)

    @torch.compile(fullgraph=True)
    def f(i, x):
        out_ids, out_w = moe_remap(i, x, layer_map)
        return out_ids + 1, out_w * 2

    out_ids, out_w = f(ids, w)
    ref_ids, ref_w = moe_remap_ref(ids, w, layer_map)
    assert torch.equal(out_ids, ref_ids + 1) and torch.equal(out_w, ref_w * 2)


# --------------------------------------------------------------------------------- Triton kernel
needs_kernel = pytest.mark.skipif(not can_launch(torch.empty(0, device=DEVICE)),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


@needs_kernel
@pytest.mark.parametrize("id_dtype, w_dtype", [(torch.int64, torch.float32), (torch.int32, torch.float16),
                                               (torch.int32, torch.bfloat16)])
def test_kernel_matches_reference(id_dtype, w_dtype):
    for seed in range(6):
        ids, w, layer_map = random_case(seed, kept=1 if seed == 0 else None, id_dtype=id_dtype, w_dtype=w_dtype)
        # out-of-range ids are clamped to (0, 0) by both (the kernel does no host-side check)
        if ids.numel():
            ids.view(-1)[:: 5] = torch.tensor([layer_map.numel(), -1, 10**6], dtype=id_dtype).repeat(
                ids.numel())[: ids.view(-1)[:: 5].numel()]
        ids, w, layer_map = ids.to(DEVICE), w.to(DEVICE), layer_map.to(DEVICE)
        out_ids, out_w = launch_moe_remap(ids, w, layer_map, block=16)  # several programs and a tail
        ref_ids, ref_w = moe_remap_ref(ids, w, layer_map)
        assert out_ids.dtype == id_dtype and out_w.dtype == w_dtype
        assert torch.equal(out_ids, ref_ids) and torch.equal(out_w, ref_w)


@needs_kernel
def test_kernel_empty_and_non_contiguous():
    # the kernel runs on DEVICE: CUDA where there is one, the interpreter on CPU otherwise
    ids, w, layer_map = (t.to(DEVICE) for t in random_case(1, T=0, E=8, k=2))
    out_ids, out_w = launch_moe_remap(ids, w, layer_map)
    assert out_ids.shape == (0, 2) and out_w.shape == (0, 2)
    ids, w, layer_map = random_case(2, T=20, E=8, k=4, kept=3)
    out_ids, out_w = launch_moe_remap(ids.T.to(DEVICE), w.T.to(DEVICE), layer_map.to(DEVICE), block=32)
    ref_ids, ref_w = moe_remap_ref(ids.T, w.T, layer_map)
    assert torch.equal(out_ids.cpu(), ref_ids) and torch.equal(out_w.cpu(), ref_w)


@pytest.mark.cuda
def test_cuda_op_uses_kernel_and_clamps():
    layer_map = torch.tensor([0, -1, 1], dtype=torch.int32, device="cuda")
    out_ids, out_w = moe_remap(torch.tensor([3, -1, 2, 1], device="cuda"), torch.ones(4, device="cuda"), layer_map)
    assert out_ids.tolist() == [0, 0, 1, 0] and out_w.tolist() == [0.0, 0.0, 1.0, 0.0]
