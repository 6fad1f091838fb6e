"""Small validation helpers shared by the config modules."""


def _positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _one_of(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} {value!r} is not one of {', '.join(choices)}")
