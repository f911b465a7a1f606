"""torchforge.ops.zero_points and `symmetric=True` on the mma-layout ops and modules (CPU; the CUDA kernels' side is
in test_awq_mma_cuda.py / test_awq_mma_moe.py): the flag is set only where every zero point is 8, it changes no
result, and a false promise is refused on the CPU."""
import pytest
import torch

from torchforge.ops import awq_quantize
from torchforge.ops.awq_mma import awq_mma_linear, awq_mma_moe_down_combine, awq_mma_moe_gate_up_silu
from torchforge.ops.awq_mma_layout import awq_to_mma_layout
from torchforge.ops.awq_mma_moe_experts import awq_mma_moe_experts
from torchforge.ops.zero_points import ZERO8_WORD, check_symmetric, zeros_are_8


def test_zero8_word_is_eight_nibbles_of_8():
    assert ZERO8_WORD & 0xFFFFFFFF == 0x88888888 and -2**31 <= ZERO8_WORD < 2**31
    assert torch.tensor([ZERO8_WORD], dtype=torch.int32).view(torch.uint8).tolist() == [0x88] * 4


def test_zeros_are_8_sym_asym_meta_empty():
    w = torch.randn(128, 256)
    assert zeros_are_8(awq_quantize(w, 128, symmetric=True)[2])
    assert not zeros_are_8(awq_quantize(w, 128, symmetric=False)[2])
    z = awq_quantize(w, 128, symmetric=True)[2]
    assert zeros_are_8(z, z) and not zeros_are_8(z, None)
    z[1, 3] ^= 1  # one zero point of 9 among 8s
    assert not zeros_are_8(z)
    assert not zeros_are_8(torch.empty(2, 4, dtype=torch.int32, device="meta"))
    assert not zeros_are_8(torch.empty(0, 4, dtype=torch.int32))


def test_check_symmetric_refuses_a_false_promise_on_cpu():
    z = awq_quantize(torch.randn(128, 128), 64, symmetric=False)[2]
    check_symmetric("op", False, z)  # no promise: nothing checked
    with pytest.raises(ValueError, match=r"op: symmetric=True promises that every zero point is 8 \(qzeros words "
                                         r"0x88888888\), but qzeros holds other values"):
        check_symmetric("op", True, z)
    check_symmetric("op", True, torch.full_like(z, ZERO8_WORD), None)
    check_symmetric("op", True, torch.empty(2, 2, dtype=torch.int32, device="meta"))


@pytest.mark.parametrize("m", [1, 3])
def test_awq_mma_linear_symmetric_same_result_and_opcheck(m):
    torch.manual_seed(m)
    qw, s, z = awq_quantize(torch.randn(192, 256), 64, symmetric=True)
    mma, x = awq_to_mma_layout(qw), torch.randn(m, 256)
    out = awq_mma_linear(x, mma, s, z, 64, symmetric=True)
    assert torch.equal(out, awq_mma_linear(x, mma, s, z, 64))
    torch.library.opcheck(torch.ops.torchforge.awq_mma_linear, (x, mma, s, z, 64, None, None, None, True))
    _, _, z_asym = awq_quantize(torch.randn(192, 256), 64, symmetric=False)
    with pytest.raises(ValueError, match="awq_mma_linear: symmetric=True promises"):
        awq_mma_linear(x, mma, s, z_asym, 64, symmetric=True)


def _experts(E, H, I, G, sym, seed=0):
    torch.manual_seed(seed)
    gu = awq_quantize(torch.randn(E, 2 * I, H) * 0.2, G, symmetric=sym)
    dn = awq_quantize(torch.randn(E, H, I) * 0.2, G, symmetric=sym)
    return (awq_to_mma_layout(gu[0]), gu[1], gu[2]), (awq_to_mma_layout(dn[0]), dn[1], dn[2])


def test_moe_ops_symmetric_same_result_and_refused_when_false():
    E, H, I, G, T, k = 4, 128, 64, 64, 3, 2
    gu, dn = _experts(E, H, I, G, True)
    x, ids, w = torch.randn(T, H), torch.randint(0, E, (T * k,)), torch.rand(T, k)
    h = awq_mma_moe_gate_up_silu(x, ids, *gu, G, k, symmetric=True)
    assert torch.equal(h, awq_mma_moe_gate_up_silu(x, ids, *gu, G, k))
    out = awq_mma_moe_down_combine(h, ids, w, *dn, G, symmetric=True)
    assert torch.equal(out, awq_mma_moe_down_combine(h, ids, w, *dn, G))
    assert torch.equal(awq_mma_moe_experts(x, ids, w, gu, dn, G, k, symmetric=True), out)
    torch.library.opcheck(torch.ops.torchforge.awq_mma_moe_gate_up_silu,
                          (x, ids, *gu, G, k, None, None, None, True))
    torch.library.opcheck(torch.ops.torchforge.awq_mma_moe_experts,
                          (x, ids, w, *gu, *dn, G, k, None, None, None, None, None, None, True))
    agu, adn = _experts(E, H, I, G, False)
    for call in (lambda: awq_mma_moe_gate_up_silu(x, ids, *agu, G, k, symmetric=True),
                 lambda: awq_mma_moe_down_combine(h, ids, w, *adn, G, symmetric=True),
                 lambda: awq_mma_moe_experts(x, ids, w, gu, adn, G, k, symmetric=True)):
        with pytest.raises(ValueError, match="symmetric=True promises"):
            call()


@pytest.mark.parametrize("sym", [True, False])
def test_linear_modules_look_at_their_zeros(sym):
    from torchforge.nn import ForgeAWQLinear

    lin = torch.nn.Linear(128, 192, bias=False)
    mod = ForgeAWQLinear.from_linear(lin, group_size=64, symmetric=sym)
    assert not mod.zeros_are_8  # AWQ layout: the flag is for the mma kernels
    x = torch.randn(2, 128)
    before = mod(x)
    assert mod.use_mma_layout() and mod.zeros_are_8 == sym
    assert torch.equal(mod(x), before)
    asym = ForgeAWQLinear.from_linear(lin, group_size=64, symmetric=False)
    mod.load_state_dict(asym.state_dict())  # an asymmetric checkpoint into a module on the mma layout
    assert not mod.zeros_are_8
    mod.load_state_dict(ForgeAWQLinear.from_linear(lin, group_size=64, symmetric=True).state_dict())
    assert mod.zeros_are_8


def test_gptq_module_on_mma_layout_looks_at_its_zeros():
    from torchforge.nn.gptq_linear import w4_linear_from_gptq
    from torchforge.ops import gptq as gptq_ops

    torch.manual_seed(0)
    IC, OC, G = 128, 64, 64
    lin = torch.nn.Linear(IC, OC, bias=False)
    codes = torch.randint(0, 16, (IC, OC), dtype=torch.uint8)
    zeros = torch.full((IC // G, OC), 8, dtype=torch.uint8)
    mod = w4_linear_from_gptq(lin, gptq_ops.gptq_pack(codes), torch.rand(IC // G, OC).half(), zeros=zeros,
                              group_size=G, symmetric=True)
    assert mod.use_mma_layout() and mod.weight_layout == "mma" and mod.zeros_are_8
    zeros[0, 0] = 7
    mod2 = w4_linear_from_gptq(lin, gptq_ops.gptq_pack(codes), torch.rand(IC // G, OC).half(), zeros=zeros,
                               group_size=G, symmetric=False)
    assert mod2.use_mma_layout() and not mod2.zeros_are_8


def test_experts_and_fused_moe_look_at_their_zeros():
    from torchforge.nn import ForgeAWQExperts

    E, H, I = 4, 128, 64
    torch.manual_seed(0)
    w = torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    sym = ForgeAWQExperts(E, H, I, group_size=64, symmetric=True).pack_weights(*w)
    asym = ForgeAWQExperts(E, H, I, group_size=64, symmetric=False).pack_weights(*w)
    assert sym.use_mma_layout() and sym.zeros_are_8
    assert asym.use_mma_layout() and not asym.zeros_are_8
    sym.load_state_dict(asym.state_dict())
    assert not sym.zeros_are_8
