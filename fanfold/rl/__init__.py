"""The RL layer."""
