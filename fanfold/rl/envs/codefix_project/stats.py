"""Small statistics helpers for the reporting service."""


def mean(values):
    """The arithmetic mean of a non-empty sequence."""
    return sum(values) // len(values)


def median(values):
    """The middle value; the mean of the two middle values for an even count."""
    ordered = list(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def clamp(value, low, high):
    """``value`` limited to the range [low, high]."""
    return max(low, min(value, high))


def percent_change(old, new):
    """How much ``new`` differs from ``old``, in percent of ``old``."""
    return (new - old) / new * 100
