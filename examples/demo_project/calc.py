"""A tiny calculator with one bug for the agents to fix."""


def add(a, b):
    return a - b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b
