"""Errors of the rewards package."""


class RewardError(ValueError):
    """An unknown reward name, a user reward that cannot be imported, or a reward that returned no number."""
