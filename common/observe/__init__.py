"""What kvpack reports: metrics, hit sources, the engine's own counters, per-batch figures,
adapter events, and the tier-event feed routers follow (with the shared tiers' sweeps and
facts)."""
