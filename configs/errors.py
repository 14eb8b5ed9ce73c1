"""The errors a config or a command line that cannot be used raises, and how much of a message may quote."""

from __future__ import annotations

# Characters of a config class's own check message (or of a YAML parser's problem): room for every real one (the
# longest is about 115), while a huge value quoted in it cannot flood the terminal.
CHECK_LIMIT = 160


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line for a person."""


class UsageError(ValueError):
    """A request that cannot be carried out as asked; the message is one line for a person."""
