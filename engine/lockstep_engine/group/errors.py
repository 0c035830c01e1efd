"""The engine group's errors: every one ends the group (the ranks exit, and their supervisor restarts them)."""


class GroupError(RuntimeError):
    """A rank of the engine group failed or cannot be reached."""


class AuthenticationError(GroupError):
    """A rank or a control message could not prove knowledge of the group secret: it is refused."""
