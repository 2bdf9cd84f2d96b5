"""``dgemma VERB ...``: one module per verb under ``dgemma/cli/``.

Verb modules import the library inside their functions, not at module level: ``dgemma --help``,
a verb's ``--help`` and argument errors then answer without importing torch (start-up time).
"""
