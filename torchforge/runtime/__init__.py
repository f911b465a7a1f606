"""Runtime adapters for serving engines (vLLM)."""
