"""Input gradients of the quantized linear ops, so a model with frozen 4-bit layers can still be differentiated
with respect to its activations (adapters such as LoRA beside the layers, attribution): grad_x = grad_y @ W and
grad_bias = sum of grad_y, with W the dequantized weight the forward multiplies with. The packed weights, scales
and zero points get no gradient (they are integer codes and format metadata, not trainable parameters). For
nvfp4_linear in W4A4 mode the activation quantization passes the gradient straight through."""
import torch
from torch import Tensor


_SAVED = object()  # placeholder of a tensor input kept by save_for_backward (None is a valid input: no input_scale)


def _grads(ctx, grad_y: Tensor, weight: Tensor):
    """(grad_x, grad_bias) for y = x @ weight.T + bias, weight [N, K] dequantized in fp32."""
    grad_x = (grad_y.float() @ weight).to(grad_y.dtype) if ctx.needs_input_grad[0] else None
    grad_b = None
    if ctx.has_bias and ctx.needs_input_grad[ctx.bias_index]:
        grad_b = grad_y.reshape(-1, grad_y.shape[-1]).float().sum(0).to(ctx.bias_dtype)
    return grad_x, grad_b


def _register(name: str, bias_index: int, dequantize, extra: tuple = ()) -> None:
    """`dequantize(*weight_inputs)` -> the fp32 weight [N, K]; the op's inputs are (x, *weight_inputs, ...) with the
    bias at `bias_index`; the inputs at the indices `extra` (after the bias) are weight inputs too, passed last."""
    n_inputs = len(torch.ops.torchforge.__getattr__(name).default._schema.arguments)

    def setup_context(ctx, inputs, output):
        ctx.has_bias = inputs[bias_index] is not None
        ctx.bias_index = bias_index
        ctx.bias_dtype = inputs[bias_index].dtype if ctx.has_bias else None
        weights = (*inputs[1:bias_index], *(inputs[i] for i in extra))
        ctx.save_for_backward(*[t for t in weights if isinstance(t, Tensor)])
        ctx.weight_inputs = [_SAVED if isinstance(t, Tensor) else t for t in weights]  # tensors: saved above

    def backward(ctx, grad_y):
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if t is _SAVED else t for t in ctx.weight_inputs]
        grad_x, grad_b = _grads(ctx, grad_y, dequantize(*args))
        grads = [None] * n_inputs
        grads[0], grads[bias_index] = grad_x, grad_b
        return tuple(grads)

    torch.library.register_autograd(f"torchforge::{name}", backward, setup_context=setup_context)


def register() -> None:
    from torchforge.ops import awq_dequantize, gptq_dequantize, mma_layout_to_awq, nvfp4_dequantize

    # inputs: (x, qweight, scales, qzeros, group_size, bias)
    _register("w4a16_linear", 5, lambda q, s, z, g: awq_dequantize(q, s, z, g, torch.float32))
    # (x, qweight_mma, scales, qzeros, group_size, bias, tickets, act_perm): with act_perm the stored rows are
    # sorted (y = x[..., perm] @ W_sorted.T), so W's column k is the stored row at perm's position of k
    def mma_weight(q, s, z, g, perm):
        w = awq_dequantize(mma_layout_to_awq(q), s, z, g, torch.float32)
        return w if perm is None else w.index_select(1, torch.argsort(perm))

    _register("awq_mma_linear", 5, mma_weight, extra=(7,))
    # (x, qweight, scales, qzeros, g_idx, bias)
    _register("w4a16_gptq_linear", 5, lambda q, s, z, g_idx: gptq_dequantize(q, s.float(), z, g_idx))
    # (x, packed, scales, weight_scale_2, input_scale, bias): input_scale is not a weight input
    _register("nvfp4_linear", 5, lambda p, s, s2, _input_scale: nvfp4_dequantize(p, s, s2, torch.float32))
