"""What kvpack decides: whose a request is (tenancy), what is a full hit (groups, hits,
split lookups, tails), how long a step may wait (budget), what stays (pins) and what goes
(eviction)."""
