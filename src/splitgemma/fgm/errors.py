"""The one exception type of the .fgm tools (converter, random-model writer, checkpoint reader)."""


class ConversionError(ValueError):
    """An expected failure with a message meant for the user (bad checkpoint, bad config, bad flags).

    The CLI prints the message without a traceback. ``problems`` holds one line per problem when
    several were found at once (e.g. every missing or misshapen checkpoint tensor).
    """

    def __init__(self, message: str, problems: "list[str] | None" = None):
        self.problems = list(problems or [])
        if self.problems:
            message = message + "\n" + "\n".join("  - " + p for p in self.problems)
        super().__init__(message)
