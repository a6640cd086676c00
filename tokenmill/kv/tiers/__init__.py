"""KV tiers below the block pool: host RAM, local disk and a shared Redis, behind one connector interface."""
