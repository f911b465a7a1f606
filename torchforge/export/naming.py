"""Tensor naming shared by export and load: HF fused experts <-> vLLM's per-expert checkpoint names."""
from __future__ import annotations

import re

# vLLM (and the original HF checkpoints) store routed experts one by one:
#   {prefix}.experts.{e}.{gate_proj|up_proj|down_proj}.{weight | qweight | qzeros | scales}
EXPERT_KEY = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>\w+)$")

AWQ_TENSORS = ("qweight", "qzeros", "scales")

# Linear layers vLLM fuses into one module (one quant method for all parts): suffix -> fused name.
VLLM_FUSED = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
    "q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj",
}


def vllm_names(name: str) -> set[str]:
    """Names vLLM may give the module `name` (itself and the fused module it becomes part of)."""
    parent, _, leaf = name.rpartition(".")
    out = {name}
    if leaf in VLLM_FUSED:
        out.add(f"{parent}.{VLLM_FUSED[leaf]}" if parent else VLLM_FUSED[leaf])
    return out
