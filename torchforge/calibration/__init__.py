"""Router statistics for expert pruning (seed 000 sections 1.1-1.4): of an in-memory model
(`collect_router_stats`), or streamed from a checkpoint one decoder layer at a time (`LayerwiseStreamer`)."""
from torchforge.calibration.router_stats import ROUTERS, RouterStats, collect_router_stats, find_routers
from torchforge.calibration.streamer import LayerwiseStreamer

__all__ = ["ROUTERS", "RouterStats", "collect_router_stats", "find_routers", "LayerwiseStreamer"]
