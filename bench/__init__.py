"""Speed benchmarks (issue 8): harness PPO step vs TRL's PPOTrainer, MFU, logging share, grid throughput."""
