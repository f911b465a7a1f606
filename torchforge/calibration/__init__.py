"""Router statistics for expert pruning (seed 000 section 1.3). The layer-by-layer streamer is not built yet."""
from torchforge.calibration.router_stats import ROUTERS, RouterStats, collect_router_stats, find_routers

__all__ = ["ROUTERS", "RouterStats", "collect_router_stats", "find_routers"]
