"""Shared check for the CUDA ops' tests: torch.compile(fullgraph=True) and CUDA-graph capture give the eager result."""
import torch


def check_compile_and_cuda_graph(fn, x):
    """fn(x) compiled without graph breaks equals eager bit for bit, and a captured CUDA graph of fn replays it on new
    contents of x (fn's other inputs are closed over)."""
    eager = fn(x)
    compiled = torch.compile(fn, fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    graph.replay()
    torch.testing.assert_close(captured, fn(x), rtol=0, atol=0)
