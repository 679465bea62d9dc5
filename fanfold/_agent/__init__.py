"""The in-sandbox agent: its C source, how to build it, and the host's client for it."""
