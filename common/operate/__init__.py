"""What an operator runs: clearing by scope, usage of a config's stores, pins, store
inspection."""
