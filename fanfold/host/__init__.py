"""Thin, typed wrappers over the Linux primitives fanfold needs (mounts, cgroups, spawn)."""
