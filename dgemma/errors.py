"""The one exception type for problems with user input (paths, configs, data, checkpoints).

Library code raises :class:`DGemmaError` with a message that says what is wrong and how to fix
it; the CLI prints it as one line instead of a traceback.
"""


class DGemmaError(Exception):
    pass
